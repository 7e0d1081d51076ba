"""Step time of cw_grpo against grpo on the tiny Qwen2, same layout, measured in one run.

Two gloo processes (tp 1, pp 1, dp 2) build one actor per arm from the same weights and
alternate steps on the same seeded batches; the median step time of each, and of its phases
(old_logp: the forward-only pass; train: the training pass and the optimizer step), is
compared. Every torch.distributed collective of a step is counted with its payload, so the
table shows exactly what the covariance statistics add. The arms:

    grpo              no forward-only pass (l_old from the training pass)
    cw_grpo           the statistics from the trainer: a forward-only pass first
    cw_grpo+rollout   the statistics from the batch's sampling log-probs (algo.stats_logp=rollout;
                      here a seeded stand-in, as the timing does not depend on their values): no
                      pass, so beside grpo it costs the statistics alone

Target (issue "training step"): the statistics cost <= 5% of a step, cw_grpo+rollout <= 1.05x
the step time of grpo at the same passes; cw_grpo / cw_grpo+rollout is what the pass costs.

Usage: python benchmarks/bench_train_step.py [--steps N]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CollectiveCounter:
    """Counts calls and bytes of torch.distributed collectives while active."""

    NAMES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        self.calls = {}
        self.bytes = {}
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(tensor, *args, _name=name, _orig=original, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                self.bytes[_name] = (
                    self.bytes.get(_name, 0) + tensor.numel() * tensor.element_size()
                )
                return _orig(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


ARMS = {
    "grpo": ["algo.policy_loss=grpo"],
    "cw_grpo": ["algo.policy_loss=cw_grpo"],
    "cw_grpo+rollout": ["algo.policy_loss=cw_grpo", "algo.stats_logp=rollout"],
}
PHASES = ("old_logp", "train")


def worker(rank, world, port, steps, queue):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.common.timing import PhaseTimer
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.train_step import train_step

    actors = {}
    for name, overrides in ARMS.items():
        cfg = layout_check.layout_config(
            tp=1,
            pp=1,
            micro_batches=2,
            global_batch=32,
            group_size=4,
            steps=steps + 1,
            world_size=world,
            overrides=[*overrides, "optim.optimizer=adam", "optim.lr=1e-4"],
        )
        actors[name], _ = layout_check.tiny_actor(cfg, init_parallel=not actors)
    times = {name: {"step": [], **{p: [] for p in PHASES}} for name in actors}
    counts = {}
    for step in range(steps + 1):
        batch = synthetic_batch(prompts=8, group_size=4, seq_len=64, vocab_size=1000, seed=step)
        gen = torch.Generator().manual_seed(step)
        sampled = -3 * torch.rand(batch.tokens.shape, generator=gen) * batch.loss_mask
        batch = dataclasses.replace(batch, rollout_logp=sampled)
        for name, actor in actors.items():
            dist.barrier()
            timer = PhaseTimer()
            with CollectiveCounter() as counter:
                start = time.perf_counter()
                train_step(actor, batch, timer=timer)
                elapsed = time.perf_counter() - start
            if step > 0:  # the first step warms up
                times[name]["step"].append(elapsed)
                for phase in PHASES:
                    times[name][phase].append(timer.seconds.get(phase, 0.0))
            counts[name] = (counter.calls, counter.bytes)
    if rank == 0:
        medians = {
            name: {k: statistics.median(v) for k, v in phases.items()}
            for name, phases in times.items()
        }
        queue.put({"times": medians, "counts": counts})
    parallel.destroy()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from cwgrpo_megatron.common.processes import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args.steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    t = result["times"]
    print(
        f"tiny Qwen2 (4 layers, hidden 64), 32 sequences x 64 tokens per step, tp1 pp1 dp2, "
        f"median of {args.steps} steps (seconds)"
    )
    print(
        f"{'arm':<16} {'step':>8} {'old_logp':>9} {'train':>8} {'x grpo':>7}   "
        "collectives per step (calls / bytes)"
    )
    for name in ARMS:
        calls, nbytes = result["counts"][name]
        desc = ", ".join(f"{k} {calls[k]} / {nbytes[k]}" for k in sorted(calls))
        x = t[name]
        print(
            f"{name:<16} {x['step']:>8.4f} {x['old_logp']:>9.4f} {x['train']:>8.4f} "
            f"{x['step'] / t['grpo']['step']:>7.3f}   {desc}"
        )
    g_calls, g_bytes = result["counts"]["grpo"]
    c_calls, c_bytes = result["counts"]["cw_grpo+rollout"]
    added = {
        k: (c_calls.get(k, 0) - g_calls.get(k, 0), c_bytes.get(k, 0) - g_bytes.get(k, 0))
        for k in set(c_calls) | set(g_calls)
    }
    print(
        "the statistics add per step (cw_grpo+rollout - grpo): "
        + ", ".join(f"{k}: {c} calls, {b} bytes" for k, (c, b) in sorted(added.items()))
    )
    the_pass = t["cw_grpo"]["step"] / t["cw_grpo+rollout"]["step"]
    print(f"the forward-only pass: cw_grpo = {the_pass:.3f}x cw_grpo+rollout")
    ratio = t["cw_grpo+rollout"]["step"] / t["grpo"]["step"]
    met = "met" if ratio <= 1.05 else "MISSED"
    print(f"target: cw_grpo+rollout <= 1.05x grpo (the statistics' cost): {met} ({ratio:.3f}x)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
