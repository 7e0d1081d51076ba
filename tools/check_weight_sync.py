"""Check that weights synced from Megatron into the rollout engine score like the trainer.

    torchrun --nproc-per-node 4 tools/check_weight_sync.py --hf-dir D --tp 2 --pp 2
    python tools/check_weight_sync.py --hf-dir D --engine torch     # one process

Each round makes one seeded optimizer step (an RL-sized one: Adam, --lr 1e-5, clipped), syncs, and
compares the engine's prompt log-probs of a fixed batch with the trainer's vocab-parallel log-probs.
The verdict is the training loop's (`SyncVerifier`): the gap, at its worst token and on average, may
not exceed tol = max(--tol, 10 x the same gap measured before any step, while engine and trainer
both hold the checkpoint), which separates a sync error (a stale, missing or misplaced tensor: a
sizeable fraction of a nat or more) from the engines' own numerics. Exits 1 above tol, or when the
step moved the engine's stale log-probs by no more than tol (the check could not tell a sync from
none: raise --lr). --num-layers N checks the model's first N layers only (a quick run); --plant
builds in a sync error (a negative control, whose verdict must be FAIL).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF Qwen2 / Llama checkpoint folder")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--engine", default="vllm", help="rollout backend: vllm or torch")
    parser.add_argument("--rounds", type=int, default=1, help="optimizer step + sync rounds")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--tol", type=float, default=1e-4, help="floor of the tolerance on max |delta log-prob|"
    )
    parser.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate of each step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--plant", default=None, help="negative control, the verdict must be "
                        "FAIL: stale_layer or swapped_q_shards")  # fmt: skip
    args = parser.parse_args(argv)

    from cwgrpo_megatron.checks.sync_check import (
        REALISTIC_STEP,
        Gap,
        SyncVerifier,
        first_layers,
        run_check,
    )
    from cwgrpo_megatron.comm import job_rank
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    init_distributed()
    rank = job_rank()  # an in-process vLLM engine ends torch.distributed when it stops
    try:
        with first_layers(args.hf_dir, args.num_layers) as hf_dir:
            report = run_check(
                hf_dir=hf_dir,
                tp=args.tp,
                pp=args.pp,
                backend=args.engine,
                rounds=args.rounds,
                dtype=args.dtype,
                seed=args.seed,
                step=[*REALISTIC_STEP, f"optim.lr={args.lr}"],
                plant=args.plant,
            )
        failed = 0
        if rank == 0:
            start = Gap(max=report.pop("start_max_abs"), mean=report.pop("start_mean_abs"))
            tol = SyncVerifier.tolerance(start, args.tol)
            print(
                f"before any step: max |dlogp| {start.max:.3e}  mean {start.mean:.3e} (the "
                f"engines' own gap); tol {tol.max:.3e}  mean {tol.mean:.3e}"
            )
            for r in range(args.rounds):
                row = {k: v[r] for k, v in report.items()}
                print(
                    f"round {r}: max |dlogp| {row['max_abs']:.3e}  mean {row['mean_abs']:.3e}  "
                    f"before sync {row['stale_max_abs']:.3e}  version {row['versions']}  "
                    f"via {row['paths']}{' (' + row['loads'] + ')' if row['loads'] else ''}  "
                    f"rss {row['rss_mb']:.0f} MiB"
                )
            worst = Gap(max=max(report["max_abs"]), mean=max(report["mean_abs"]))
            stale = min(report["stale_max_abs"])
            over = not (worst.max <= tol.max and worst.mean <= tol.mean)
            failed = int(over or stale <= tol.max)
            print(
                f"{'FAIL' if failed else 'OK'}: max |dlogp| {worst.max:.3e} (tol {tol.max:.3e}), "
                f"mean {worst.mean:.3e} (tol {tol.mean:.3e})"
            )
            if stale <= tol.max:
                print("the step moved the engine's log-probs by no more than tol: raise --lr")
        return failed
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
