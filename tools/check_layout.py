"""Prove a parallel layout against TP1: run real CW-GRPO train steps and compare them.

    # the reference, with its fp32 noise measured (one process):
    torchrun --nproc-per-node 1 tools/check_layout.py --hf-dir D --calibrate --out ref.json
    # a layout against it: PASS or FAIL, exit 1 on FAIL
    torchrun --nproc-per-node 3 tools/check_layout.py --hf-dir D --tp 3 --against ref.json \
        --out tp3.json
    # a MoE model's experts split over 2 ranks (expert parallelism)
    torchrun --nproc-per-node 2 tools/check_layout.py --hf-dir D --ep 2 --against ref.json \
        --out ep2.json

Runs --steps optimizer steps of the real train step (cw_grpo, global scope) on a fixed seeded
synthetic batch of prompts, responses and rewards that does not depend on the layout. Each step
is a normalised SGD step that moves the parameters by --rel-step of their norm (1e-5 by default:
the size of an RL update at Adam lr 1e-6 on a 7B model), however large the gradient: a real
model then stays where layouts must agree, while SGD at lr 0.05 moved SmolLM2-135M's log-probs
by nats and amplified fp32 noise into a 6.5e-3 difference between TP1 and TP3.

The JSON holds `loss` and `grad_norm` per step, `update` (per HF tensor, a random projection
and the norm of its change), `param_checksum` and `layout`. --calibrate reruns this layout on
channel-permuted copies of the model (the same function, other fp32 reduction orders) and
stores their worst differences as `noise`; --against judges each quantity against
10 x that noise (`cwgrpo_megatron/checks/layout_verdict.py` gives the rule). --plant builds in a
known error (a negative control: the verdict must be FAIL). --num-layers keeps the model's
first layers, for a quick check. Without --hf-dir a built-in tiny random Qwen2 is used.
"""

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (a MoE model)")
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per data-parallel rank and step"
    )
    parser.add_argument("--global-batch", type=int, default=24, help="sequences per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=2, help="rollout batches")
    parser.add_argument(
        "--mini-batches", type=int, default=1, help="PPO mini-batches (optimizer steps) per batch"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-dir", default=None)
    parser.add_argument("--num-layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument(
        "--rel-step",
        type=float,
        default=1e-5,
        help="each step moves the parameters by this fraction of their norm (normalised SGD); "
        "0: plain SGD at layout_config's lr 0.05, or the optim.lr override",
    )
    parser.add_argument("--calibrate", action="store_true", help="measure the fp32 noise")
    parser.add_argument("--against", default=None, help="reference JSON made with --calibrate")
    parser.add_argument("--plant", default=None, help="negative control: kv_heads_misplaced, "
                        "dp_grad_unreduced, experts_swapped")  # fmt: skip
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. algo.policy_loss=grpo")
    args = parser.parse_args(argv)

    from cwgrpo_megatron.checks import layout_check, layout_verdict
    from cwgrpo_megatron.common.files import write_atomic
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    setup = {
        "model": Path(args.hf_dir).resolve().name if args.hf_dir else "tiny-qwen2",
        **{k: getattr(args, k) for k in SETUP_KEYS},
        "overrides": list(args.overrides),
    }
    if args.calibrate and args.plant:
        print("error: --calibrate measures a correct run's noise: drop --plant", file=sys.stderr)
        return 2
    ref = None
    if args.against:
        ref = _read_reference(Path(args.against), setup)
        if isinstance(ref, str):
            print(f"error: {ref}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    init_distributed()
    kwargs = dict(
        pp=args.pp,
        micro_batches=args.micro_batches,
        global_batch=args.global_batch,
        group_size=args.group_size,
        seq_len=args.seq_len,
        steps=args.steps,
        mini_batches=args.mini_batches,
        seed=args.seed,
        hf_dir=args.hf_dir,
        num_layers=args.num_layers,
        rel_step=args.rel_step or None,
        overrides=[*args.overrides, f"parallel.ep={args.ep}"],
    )
    try:
        result = layout_check.run(tp=args.tp, plant=args.plant, **kwargs)
        calibration = [
            layout_check.run(tp=args.tp, permute_seed=k + 1, **kwargs)
            for k in range(layout_verdict.CALIBRATION_RUNS if args.calibrate else 0)
        ]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        shutdown()
        return 2
    code = 0
    if torch.distributed.get_rank() == 0:
        keys = ("loss", "grad_norm", "param_checksum", "layout", "update", "routing")
        payload = {"setup": setup, **{k: result[k] for k in keys if k in result}}
        if calibration:
            payload["noise"] = layout_verdict.noise(result, calibration)
        write_atomic(args.out, json.dumps(payload, indent=2) + "\n")
        summary = {k: payload[k] for k in ("loss", "grad_norm", "param_checksum", "layout")}
        print(json.dumps({**summary, **({"noise": payload["noise"]} if calibration else {})}))
        if ref is not None:
            passed, rows = layout_verdict.verdict(payload, ref)
            print("\n".join(layout_verdict.format_rows(rows)))
            routing = _routing_differ(payload, ref)
            if routing:
                print(routing)
            worst = max(rows, key=lambda r: r["ratio"])
            print(
                f"{'PASS' if passed else 'FAIL'}: {_layout_name(payload['layout'])} against "
                f"{_layout_name(ref['layout'])}, worst {worst['quantity']} at "
                f"{worst['ratio']:.2f}x the fp32 noise (tol {layout_verdict.FACTOR:g}x)"
            )
            code = 0 if passed else 1
    code = _share(code)
    shutdown()
    return code


SETUP_KEYS = ("num_layers", "global_batch", "group_size", "seq_len", "steps", "mini_batches",
              "seed", "rel_step")  # fmt: skip
"""What a reference must share with a run to be compared (the layout may differ)."""


def _read_reference(path: Path, setup: dict) -> dict | str:
    """The reference JSON, or why it cannot be used."""
    try:
        ref = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"--against {path}: cannot read it ({err})"
    if "noise" not in ref or "update" not in ref:
        return (f"--against {path}: no noise calibration in it; make the reference with "
                "tools/check_layout.py --calibrate")  # fmt: skip
    theirs = ref.get("setup", {})
    changed = [k for k in setup if theirs.get(k) != setup[k]]
    if changed:
        detail = ", ".join(f"{k}: {theirs.get(k)!r} there, {setup[k]!r} here" for k in changed)
        return f"--against {path} was made with other settings ({detail}): use the same ones"
    return ref


def _routing_differ(run: dict, ref: dict) -> str | None:
    """For a MoE model, the share of (router call, token) pairs on rank 0 whose top-k experts
    differ from the reference's: a measurement, not part of the verdict (a rounding may flip a
    near tie). Comparable where rank 0 holds the same rows and layers: equal dp and pp."""
    if "routing" not in run or "routing" not in ref:
        return None
    same = all(run["layout"][k] == ref["layout"][k] for k in ("dp", "pp"))
    if not same:
        return (
            "moe/topk_differ: not comparable (rank 0 holds other rows or layers: dp or pp differ)"
        )
    import torch

    from cwgrpo_megatron.megatron.routing import topk_differ

    share = topk_differ(*([torch.tensor(c) for c in r["routing"]] for r in (run, ref)))
    calls = len(run["routing"])
    return f"moe/topk_differ: {share:.4%} of rank 0's tokens x {calls} router calls"


def _layout_name(layout: dict) -> str:
    keys = ("tp", "pp", "dp", *(("ep",) if layout.get("ep", 1) > 1 else ()))
    return "x".join(f"{k.upper()}{layout[k]}" for k in keys if k in layout)


def _share(code: int) -> int:
    """Rank 0's exit code on every rank, so that torchrun reports it."""
    import torch.distributed as dist

    from cwgrpo_megatron.comm import broadcast_from
    from cwgrpo_megatron.megatron.train_step import device

    code_t = torch.tensor([float(code)], device=device())  # NCCL broadcasts device tensors only
    return int(broadcast_from(code_t, 0, dist.group.WORLD).item())


if __name__ == "__main__":
    sys.exit(main())
