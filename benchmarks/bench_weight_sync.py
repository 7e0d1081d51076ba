"""Seconds per weight sync, Megatron -> vLLM engine, against two baselines in the same run.

For a Qwen2 of about 100M parameters and one of Qwen2.5-0.5B's shape (random weights, bf16), at
TP1 (one process, in-process engine) and TP2 (two gloo processes, rank 0 owns engine
processes). Either way each rank writes its shards into the engine's /dev/shm buffer and the
engine loads it in place (`weight_sync.vllm_inplace`):

    ours      `megatron.publish.sync_weights`, the whole sync: HF names and layout, load
              into the engine, prefix-cache reset (the first sync, which allocates the
              buffer, is a warm-up and not timed)
    shm       vLLM reloading the same weights from a safetensors file already in /dev/shm
              (`reload_weights(weights_path=...)`; writing the file is not timed)
    file      the same, writing the file included (save_file of the gathered tensors + reload)
    copy      a plain torch copy of the same bytes into preallocated tensors

The four run in interleaved rounds (one warm-up round, then the median of `--repeats`), so a
slow phase of a shared host slows them alike. Target (issue "vLLM rollout engine"): ours <= 1.0x
the /dev/shm reload time. GB/s counts the HF tensors' bytes.

Usage: python benchmarks/bench_weight_sync.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_convert import QWEN_05B  # noqa: E402  (this folder is on sys.path: run as a script)

MODELS = {
    "~100M": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=2048,
        vocab_size=32000,
    ),
    "0.5B": QWEN_05B,
}
QUICK = {"tiny": dict()}


def make_hf_dir(folder: Path, overrides: dict) -> Path:
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    config = {**overrides, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    return save_tiny_qwen2(folder, **config)


def worker(rank, world, port, hf_dir, repeats, queue):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.model import build_model, load_hf_weights
    from cwgrpo_megatron.megatron.publish import hf_weights, sync_weights
    from cwgrpo_megatron.rollout import get_engine

    parallel.initialize(tp=world)
    arch = ModelArch.from_hf_dir(hf_dir)
    model = build_model(arch, params_dtype=torch.bfloat16, perform_initialization=False)
    load_hf_weights(model, arch, HFCheckpoint(hf_dir).get)
    engine = None
    if rank == 0:
        engine = get_engine("vllm")(hf_dir, dtype="bfloat16", max_model_len=256, seed=0)

    def ours():
        sync_weights(model, arch, engine, dtype="bfloat16")

    # the baselines' tensors: the same export, gathered by every rank together
    tensors = {n: t.contiguous() for n, t in hf_weights(model, arch, dtype="bfloat16")}
    shm = Path(tempfile.mkdtemp(prefix="bench-sync-", dir="/dev/shm")) if rank == 0 else None
    try:
        from safetensors.torch import save_file

        targets = {n: torch.empty_like(t) for n, t in tensors.items()} if rank == 0 else {}

        def reload_from_shm():
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(shm)})
            engine.llm.reset_prefix_cache()

        def write_and_reload():
            save_file(tensors, str(shm / "model.safetensors"))
            reload_from_shm()

        def copy():
            for name, t in tensors.items():
                targets[name].copy_(t)

        if rank == 0:
            shutil.copy(Path(hf_dir) / "config.json", shm)
        # interleaved rounds: a slow phase of this shared host hits every method alike
        methods = {"file": write_and_reload, "ours": ours, "shm": reload_from_shm, "copy": copy}
        result = interleaved(methods, repeats, everyone={"ours"}, rank=rank)
        result["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    finally:
        if shm is not None:
            shutil.rmtree(shm)
    if rank == 0:
        queue.put(result)
    parallel.destroy()
    if engine is not None:
        engine.shutdown()  # in-process this also ends the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def interleaved(methods: dict, repeats: int, *, everyone: set[str], rank: int) -> dict:
    """Median seconds of each method over `repeats` rounds, each round running every method
    once (after one warm-up round). Methods in `everyone` run on every rank (collectives);
    the rest on rank 0 while the others wait at a barrier."""
    times = {name: [] for name in methods}
    for round_ in range(repeats + 1):
        for name, fn in methods.items():
            if name in everyone or rank == 0:
                start = time.perf_counter()
                fn()
                if round_:
                    times[name].append(time.perf_counter() - start)
            dist.barrier()
    return {name: statistics.median(t) for name, t in times.items()} if rank == 0 else {}


def run_layout(hf_dir, world, repeats) -> dict:
    from cwgrpo_megatron.common.processes import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, world, port, str(hf_dir), repeats, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model at TP2 only (the suite's smoke run)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    models = QUICK if args.quick else MODELS
    print(
        f"{'model':<7} {'layout':<7} {'GB':>6} {'ours s':>8} {'shm s':>8} {'file s':>8} "
        f"{'copy s':>8} "
        f"{'ours GB/s':>10} {'ours/shm':>9}"
    )
    met = True
    with tempfile.TemporaryDirectory() as folder:
        for name, overrides in models.items():
            hf_dir = make_hf_dir(Path(folder) / name, overrides)
            for world in (2,) if args.quick else (1, 2):
                r = run_layout(hf_dir, world, args.repeats)
                gb = r["bytes"] / 1e9
                ratio = r["ours"] / r["shm"]
                met &= ratio <= 1.0
                print(
                    f"{name:<7} {'TP' + str(world):<7} {gb:>6.2f} {r['ours']:>8.3f} "
                    f"{r['shm']:>8.3f} {r['file']:>8.3f} {r['copy']:>8.3f} {gb / r['ours']:>10.2f} "
                    f"{ratio:>8.2f}x"
                )
    print(f"target ours <= 1.0x the /dev/shm reload: {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
