"""Rollout throughput and weight-sync time with 1 and 2 engine replicas, in one run.

All modes train the same random Qwen2 on two trainer processes from the same config, through
`build_trainer` and the trainer's own phases, on the same cores:

    1 replica   DP2, one torchrun launch of 2 processes: one node, one vLLM engine on 2 cores
    2 replicas  DP2, two torchrun launches of 1 process side by side (`--nnodes 2`): two
                nodes, one engine each, on 1 core each (VLLM_CPU_OMP_THREADS_BIND)
    2, PP2      the same two nodes at PP2, one stage a node: each node's sync receives the
                other stage over the network (gloo on loopback here)

Per step, after `--warmup` untimed steps, rank 0 takes the rollout phase's time (`Rollouts.make`:
every replica generates its share, the slowest sets the time), and times the sync
(`WeightSync.push`: each node's ranks write their shards into their engine's buffer; at DP2
each node holds the whole model, so nothing crosses nodes; at PP2 each receives the stage it
lacks) and the cross-replica collective that the loop adds to the rollouts, with the step's
own payload: the all-gather that assembles the step's scored groups on every rank and tells
every rank of a failure on any (`components.rollouts.gather`). The table gives medians over
the timed steps, and the range of the rollout's seconds: two engines on one machine vary from
step to step and run to run.

Completions have no end token (`end_tokens=0`): every completion is `--tokens` long. On a
2-core machine the generation ratio mostly measures overhead: the two engines split the same
two cores that one engine uses, so it can only show what replication costs, not what it
gains on nodes with their own GPUs.

Usage: python benchmarks/bench_rollout_scale.py [--quick] [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    vocab_size=2048,
    max_position_embeddings=512,
)
MODES = {  # name: (launches, processes per launch, each launch's vLLM CPU cores, layout)
    "1 replica": (1, 2, ["0-1"], []),
    "2 replicas": (2, 1, ["0", "1"], []),
    "2, PP2": (2, 1, ["0", "1"], ["parallel.pp=2"]),
}


def worker(args) -> None:
    """One rank of a mode: build the trainer, time its phases; rank 0 writes `args.result`."""
    import torch
    import torch.distributed as dist

    from cwgrpo_megatron.build import build_trainer
    from cwgrpo_megatron.comm import all_gather_or_fail
    from cwgrpo_megatron.components.rollouts import gather
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    torch.set_num_threads(1)
    overrides = [
        f"model.path={args.model}",
        "model.chat_template=plain",
        f"data.train_files=[{args.data}]",
        "data.max_prompt_tokens=32",
        "train.total_steps=1000",
        f"train.prompts_per_step={args.prompts}",
        f"train.group_size={args.group}",
        f"train.micro_batch_size={args.group}",
        "rollout.backend=vllm",
        f"rollout.max_tokens={args.tokens}",
        f"rollout.max_model_len={32 + args.tokens}",
        "reward.workers=1",
        f"run.out_dir={args.out}",
        *args.layout,
        "run.save_every=0",
        "run.export_hf=never",
        "logging.tensorboard=false",
    ]
    init_distributed()
    rank, rows = dist.get_rank(), []
    try:
        trainer = build_trainer(load_config(overrides=overrides))
        try:
            for step in range(1, args.warmup + args.steps + 1):
                rollouts, weights = trainer.rollouts, trainer.sync
                prompts = rollouts.draw(step)
                make = functools.partial(rollouts.make, prompts)
                scored, seconds = gather(make, "timing", rollouts.control)
                rollout = seconds["rollout"]  # the slowest replica's generation
                start = time.perf_counter()
                pushed = weights.push(trainer.actor.model, rollouts.engine)
                weights.check(trainer.actor.model, rollouts.engine, step=step)
                received = pushed["sync/received_mb"]
                sync = time.perf_counter() - start
                # the loop's cross-replica collective again, alone, with this step's payload
                mine = [g for g in scored if g.position in prompts.positions]
                start = time.perf_counter()
                all_gather_or_fail(lambda mine=mine: mine, "timing", rollouts.control)
                collectives = time.perf_counter() - start
                rows.append(
                    dict(
                        rollout=rollout,
                        tokens=sum(len(c.token_ids) for g in scored for c in g.completions),
                        sync=sync,
                        received_mb=received,
                        collectives_ms=1e3 * collectives,
                    )
                )
        finally:
            trainer.close()
    finally:
        shutdown()
    if rank != 0 or args.result is None:
        return
    timed = rows[args.warmup :]
    result = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    result["tokens_per_s"] = result["tokens"] / result["rollout"]
    result["rollout_range"] = [min(r["rollout"] for r in timed), max(r["rollout"] for r in timed)]
    Path(args.result).write_text(json.dumps(result))


def run_mode(name: str, args, model: Path, data: Path, folder: Path) -> dict:
    launches, nproc, binds, layout = MODES[name]
    slug = name.replace(" ", "_").replace(",", "")
    result = folder / f"{slug}.json"
    from cwgrpo_megatron.common.processes import free_port  # main put the repo on sys.path

    port = free_port()
    procs = []
    for node, bind in enumerate(binds):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": "1"}
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        cmd = ["torchrun", "--nnodes", str(launches), "--node-rank", str(node)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += ["--nproc-per-node", str(nproc), __file__, "--worker"]
        cmd += ["--model", str(model), "--data", str(data), "--out", str(folder / slug)]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("prompts", "group", "tokens")]
        cmd += [f"--steps={args.steps}", f"--warmup={args.warmup}"]
        cmd += ["--result", str(result)] if node == 0 else []
        cmd += [f"--layout={item}" for item in layout]
        log = open(folder / f"{slug}_{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    codes = [p.wait(timeout=1800) for p, _ in procs]
    for _, log in procs:
        log.close()
    if any(codes):
        tail = (folder / f"{slug}_0.log").read_text()[-3000:]
        raise RuntimeError(f"{name}: exit codes {codes}\n{tail}")
    return json.loads(result.read_text())


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="a tiny model, one timed step, the PP2 mode alone"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", action="append", default=[], help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(REPO))
    if args.worker:
        worker(args)
        return 0
    from bench_e2e import write_prompts  # this folder is on sys.path

    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    if args.quick:
        args.steps, args.warmup, args.prompts, args.group, args.tokens = 1, 0, 2, 2, 8
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shape = {} if args.quick else MODEL
        model = save_tiny_qwen2(folder / "model", end_tokens=0, **shape)
        data = write_prompts(folder / "prompts.jsonl", 64)
        # --quick (the suite's smoke run) launches the one mode that uses every part: two
        # nodes, and shards sent between them
        modes = ["2, PP2"] if args.quick else list(MODES)
        results = {name: run_mode(name, args, model, data, folder) for name in modes}
    print(
        f"{'tiny' if args.quick else 'random Qwen2, hidden 512, 8 layers'}: 2 trainer ranks, "
        f"{args.prompts} prompts x {args.group} x {args.tokens} tokens a step, "
        f"median of {args.steps} steps after {args.warmup}, 2 CPU cores in every mode"
    )
    header = f"{'mode':<11} {'rollout s':>9} {'(min-max)':>11} {'tokens/s':>9} {'sync s':>7} "
    print(header + f"{'MiB/node':>8} {'collectives ms':>14}")
    for name, r in results.items():
        low, high = r["rollout_range"]
        print(
            f"{name:<11} {r['rollout']:>9.3f} {low:>5.2f}-{high:<5.2f} "
            f"{r['tokens_per_s']:>9.1f} {r['sync']:>7.3f} "
            f"{r['received_mb']:>8.1f} {r['collectives_ms']:>14.2f}"
        )
    pp = results["2, PP2"]
    if "1 replica" in results:
        one, two = results["1 replica"], results["2 replicas"]
        speed, sync = two["tokens_per_s"] / one["tokens_per_s"], two["sync"] / one["sync"]
        print(f"2 replicas / 1 replica: tokens/s {speed:.2f}x, sync seconds {sync:.2f}x")
        print(f"PP2 across the nodes: {pp['sync'] - two['sync']:+.3f} s a sync against DP2")
    print(
        f"PP2 across the nodes: {pp['received_mb']:.1f} MiB into each node per sync, "
        f"{pp['sync']:.3f} s a sync, {pp['received_mb'] / max(pp['sync'], 1e-9):.0f} MiB/s"
    )
    print(
        "target: none set by the issue. On these 2 cores the two engines share the cores one "
        "engine had, so the tokens/s ratio measures the overhead of replication, not its gain."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
