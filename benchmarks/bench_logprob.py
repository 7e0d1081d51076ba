"""Time and peak memory of log-prob + entropy from one vocabulary shard, three ways.

    ours   cwgrpo_megatron.comm.vocab_parallel_logprob_entropy (chunked, fused backward)
    plain  log_softmax over the whole shard, gather, -(p * logp).sum
    trl    TRL's recipe, rewritten here: selective_log_softmax (per-row logsumexp, or per-row
           log_softmax for bf16) plus entropy_from_logits (log_softmax in chunks of 128 rows)

Shapes: 4096 tokens x 32k vocab (fp32), and 8192 tokens x 152k vocab split as tp = 8, i.e. one
19k-column shard (bf16, as Megatron emits it). Each (shape, method, mode) runs in a fresh
process so that peak RSS (VmHWM, see memory.py) above the inputs is that method's alone. Memory
runs pin glibc's mmap threshold so that freed temporaries go back to the OS (exact peaks);
timing runs use the default allocator, which lets every method reuse freed memory.

Targets (issue "Foundation"): ours <= 1.0x the time of plain; peak above the input
<= 0.25x the shard's bytes in forward and <= 1.25x in forward+backward.

Usage: python benchmarks/bench_logprob.py [--quick] [--repeats N]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    "4096x32k fp32": (4, 1024, 32000, "float32"),
    "8192x152k/tp8 bf16": (8, 1024, 152064 // 8, "bfloat16"),
}
QUICK_SHAPES = {"quick 256x4k fp32": (2, 128, 4000, "float32")}
METHODS = ("ours", "plain", "trl")
MODES = ("fwd", "fwd+bwd")


def _plain(logits, target):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _trl(logits, target):
    # selective log-softmax: avoid a full log_softmax where the dtype allows it
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        norm = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        logp = picked - norm
    else:
        logp = torch.stack(
            [
                torch.log_softmax(row, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
                for row, t in zip(logits, target, strict=True)
            ]
        )
    # entropy in chunks of rows
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(128):
        lp = torch.log_softmax(chunk, dim=-1)
        parts.append(-(lp.exp() * lp).sum(-1))
    entropy = torch.cat(parts).view(logits.shape[:-1])
    return logp.float(), entropy.float()


def _ours(logits, target):
    return vocab_parallel_logprob_entropy(logits, target)


def measure(shape_name, method, mode, repeats, quick):
    """Child process: one method on one shape; prints a JSON line (time or peak)."""
    b, s, v, dtype_name = (QUICK_SHAPES if quick else SHAPES)[shape_name]
    dtype = getattr(torch, dtype_name)
    fn = {"ours": _ours, "plain": _plain, "trl": _trl}[method]
    backward = mode == "fwd+bwd"
    warm = torch.randn(2, 4, 64).to(dtype).requires_grad_(backward)
    out = fn(warm, torch.zeros(2, 4, dtype=torch.long))
    if backward:
        (out[0].sum() + out[1].sum()).backward()

    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(b, s, v, dtype=dtype)
    for rows in logits.view(-1, v).split(256):  # in place: no fp32 staging copy of bf16 input
        rows.normal_(generator=gen).mul_(3.0)
    target = torch.randint(0, v, (b, s), generator=gen)
    g_logp, g_ent = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)
    logits.requires_grad_(backward)

    def run():
        logp, entropy = fn(logits, target)
        if backward:
            (logp * g_logp + entropy * g_ent).sum().backward()
            logits.grad = None

    base = reset_peak()
    run()
    peak = peak_since_reset() - base
    times = []
    for _ in range(repeats if repeats > 0 else 0):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    shard_bytes = logits.numel() * logits.element_size()
    median = statistics.median(times) if times else None
    print(json.dumps({"time": median, "peak": peak, "shard": shard_bytes}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, for a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "METHOD", "MODE"))
    args = parser.parse_args()
    if args.child:
        measure(*args.child, args.repeats, args.quick)
        return
    memory_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")

    def child(shape, method, mode, repeats, env):
        cmd = [sys.executable, __file__, "--child", shape, method, mode]
        cmd += ["--repeats", str(repeats)] + (["--quick"] if args.quick else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{shape} {method} {mode} failed:\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    header = f"{'shape':<20} {'mode':<8} {'method':<6} {'time s':>8} {'x plain':>8} "
    print(header + f"{'peak MiB':>9} {'x shard':>8}")
    failures = []
    for shape in shapes:
        for mode in MODES:
            rows = {}
            for method in METHODS:
                # the peak under malloc settings that return freed memory at once, the time
                # without them; --quick (a smoke run) takes both from the first child
                rows[method] = child(shape, method, mode, args.repeats * args.quick, memory_env)
                if not args.quick:
                    rows[method]["time"] = child(shape, method, mode, args.repeats, None)["time"]
            for method in METHODS:
                r = rows[method]
                ratio = r["time"] / rows["plain"]["time"]
                mem = r["peak"] / r["shard"]
                print(
                    f"{shape:<20} {mode:<8} {method:<6} {r['time']:>8.3f} {ratio:>8.2f} "
                    f"{r['peak'] / 2**20:>9.1f} {mem:>8.2f}"
                )
            ours = rows["ours"]
            mem_target = 0.25 if mode == "fwd" else 1.25
            if ours["time"] > rows["plain"]["time"]:
                failures.append(f"{shape} {mode}: time {ours['time'] / rows['plain']['time']:.2f}x")
            if ours["peak"] > mem_target * ours["shard"]:
                failures.append(f"{shape} {mode}: memory {ours['peak'] / ours['shard']:.2f}x")
    print("targets: time <= 1.00x plain; peak <= 0.25x shard (fwd), <= 1.25x (fwd+bwd)")
    print("all targets met" if not failures else "MISSED: " + "; ".join(failures))


if __name__ == "__main__":
    import torch
    from memory import peak_since_reset, reset_peak

    from cwgrpo_megatron.comm import vocab_parallel_logprob_entropy

    main()
