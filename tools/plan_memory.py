"""Will this run fit? GPU memory per rank by phase for a run config, before the allocation.

    python tools/plan_memory.py --config configs/qwen2p5_math_7b.yaml
    python tools/plan_memory.py --config configs/qwen2p5_72b.yaml --nodes 8 --rollout-tp 4
    python tools/plan_memory.py --config configs/qwen2p5_32b.yaml --search --top 10
    python tools/plan_memory.py --config configs/qwen2p5_14b.yaml --json parallel.tp=4
    python tools/plan_memory.py --config configs/qwen2p5_math_7b.yaml --plot memory.png

Prints, for the most-loaded GPU: parameters, gradient buffer and optimizer state (exactly as
Megatron-Core allocates them), the reference model (kl_beta > 0), the activations of the
micro-batches 1F1B keeps in flight at the config's micro-batch and recompute, vLLM's share (of
the trainer's GPUs when colocated, of its own with rollout.placement=separate), the peak of
each phase of a step (rollout, old_logp, train, wake: the engine's weights back for the sync)
and the verdict against capacity. --gpu-gib is the GPU's total
memory, of which vLLM takes rollout.gpu_memory_utilization. --search lists every layout (tp,
pp, micro-batch size, recompute) that fits, fastest first by `planner.step_seconds` (an
ordering rule, not a prediction; ep too for a MoE model). --moe-imbalance is a MoE model's
tokens on its busiest expert-parallel rank over an even share. --json prints one JSON
object. --plot draws the phases stacked by kind.
The model is the config's model.arch (a name of configs/models, or an HF config.json), else
the config.json in model.path. The formulas are in cwgrpo_megatron/analysis/planner.py. Exit 2 on a
layout or config that cannot work, 1 when the plan does not fit.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cwgrpo_megatron.analysis import planner  # noqa: E402
from cwgrpo_megatron.common.files import save_figure  # noqa: E402
from cwgrpo_megatron.common.plugins import add_plugin_argument  # noqa: E402
from cwgrpo_megatron.config import load_config  # noqa: E402
from cwgrpo_megatron.convert.arch import ModelArch  # noqa: E402


def _gib(x: int) -> str:
    return f"{x / planner.GiB:8.2f}"


def _arch(cfg) -> ModelArch:
    if cfg.model.arch:
        return ModelArch.recipe(cfg.model.arch)
    if cfg.model.path:
        return ModelArch.from_hf_dir(cfg.model.path)
    raise ValueError(
        "the config names no model: set model.arch (a name of configs/models) or model.path"
    )


def report(arch: ModelArch, p: planner.Plan) -> str:
    s, c, v = p.setting, p.cluster, p.vllm
    sharded = ", sharded over dp" if s.distributed_optimizer else ""
    rows = [
        (f"parameters ({s.params_dtype})", p.state.params, ""),
        ("gradient buffer (fp32)", p.state.grads, ""),
        (f"optimizer ({s.optimizer}{sharded})", p.state.optimizer, ""),
        ("reference model", p.ref_model, "" if s.kl_beta > 0 else "kl_beta = 0"),
        (
            "activations (train)",
            p.activations,
            f"{min(s.pp, p.micro_batches)} micro-batch(es) in flight on stage 0 + backward",
        ),
        (
            "vLLM reservation" if s.colocated else "vLLM, on its own GPUs",
            v.reserved,
            f"weights {v.weights / planner.GiB:.2f} at rollout tp={s.rollout_tp}, "
            f"{p.engines} engine(s); KV cache "
            f"{v.kv_needed / planner.GiB:.2f} needed, {v.kv_available / planner.GiB:.2f} there "
            f"({v.concurrency:.0%} of its sequences at once); asleep (level {s.sleep_level}) "
            f"{v.sleeping / planner.GiB:.2f}",
        ),
        ("reserve (CUDA context, NCCL)", planner.RESERVE, ""),
    ]
    engines = "" if s.colocated else f" (+ {s.engine_gpus_per_node} engine GPUs a node)"
    experts = ""
    if arch.is_moe:
        experts = (
            f" ({planner.params_active(arch):,} active); ep={s.ep} expert_tp={s.expert_tp}, "
            f"routing imbalance {s.moe_imbalance:g};"
        )
    lines = [
        f"{planner.params_total(arch):,} parameters{experts or ';'} tp={s.tp} pp={s.pp} "
        f"dp={p.dp} on "
        f"{c.nodes} x {c.gpus_per_node} GPUs{engines} of {c.gpu_gib:g} GiB ({s.spec} layer "
        "spec)",
        f"micro-batch {s.micro_batch_size} x {s.seq_len} tokens, recompute {s.recompute}, "
        f"{p.micro_batches} micro-batches per DP rank; each figure on its most-loaded of "
        f"{s.pp} stage(s)",
        f"{'per GPU':<36}{'GiB':>8}",
    ]
    lines += [f"  {label:<34}{_gib(value)}   {note}".rstrip() for label, value, note in rows]
    lines.append("peak by phase (on its most-loaded stage)")
    lines += [
        f"  {name:<34}{_gib(value)}   stage {p.phase_stage[name]}"
        for name, value in p.phases.items()
    ]
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines.append(f"verdict: {verdict} (peak {p.peak / planner.GiB:.2f} of {c.gpu_gib:g} GiB)")
    if not p.vllm_fits:
        lines.append(
            f"  vLLM's weights ({v.weights / planner.GiB:.2f} GiB) do not fit its reservation "
            f"({v.reserved / planner.GiB:.2f} GiB): raise rollout.gpu_memory_utilization or "
            "the rollout tp"
        )
    return "\n".join(lines)


KIND_COLOURS = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer": "#8172b2",
    "reference model": "#64b5cd",
    "activations": "#c44e52",
    "engine weights": "#dd8452",
    "KV cache": "#ccb974",
    "engine other": "#937860",
    "sync buffers": "#da8bc3",
    "reserve": "#8c8c8c",
}


def plot(p: planner.Plan, out: Path, title: str) -> Path:
    """A step's memory on the most-loaded GPU, phase by phase, stacked by kind; the GPU's
    capacity as a line. Written to a temporary file, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    phases = list(p.parts)
    bottoms = [0.0] * len(phases)
    for kind, colour in KIND_COLOURS.items():
        heights = [p.parts[phase].get(kind, 0) / planner.GiB for phase in phases]
        if any(heights):
            ax.bar(phases, heights, bottom=bottoms, color=colour, label=kind, width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        ax.text(x, total + 0.5, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    capacity = p.cluster.gpu_gib
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(-0.45, capacity, f"{capacity:g} GiB", va="bottom", ha="left")
    ax.set_ylabel("GiB on the most-loaded GPU")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return save_figure(fig, out)


def search_table(arch: ModelArch, found, top: int) -> str:
    lines = [
        f"{len(found)} layouts fit; fastest first by planner.step_seconds "
        "(compute at MFU, 1F1B bubble, TP and DP communication)",
        "  tp  pp  ep  dp  mbs  tokens/mb  recompute  peak GiB  est. s/step",
    ]
    for seconds, p in found[:top]:
        s = p.setting
        lines.append(
            f"  {s.tp:>2}  {s.pp:>2}  {s.ep:>2}  {p.dp:>2}  {s.micro_batch_size:>3}  "
            f"{s.micro_batch_size * s.seq_len:>9}  {s.recompute:<9}  {_gib(p.peak)}  "
            f"{seconds:11.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, action="append", help="run config YAML")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--rollout-tp", type=int, default=None,
                        help="plan one vLLM engine per N GPUs at tp N (rollout.tp=N, "
                        "rollout.replicas=GPUs/N); default: the config's rollout.tp")  # fmt: skip
    parser.add_argument("--spec", choices=planner.SPECS, default="te",
                        help="te: Transformer Engine on GPU (default); local: Megatron's local "
                        "spec, as on CPU")  # fmt: skip
    parser.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                        help="a MoE model's tokens on the busiest expert-parallel rank over an "
                        "even share (default 1: even routing)")  # fmt: skip
    parser.add_argument("--search", action="store_true", help="list the layouts that fit")
    parser.add_argument("--top", type=int, default=15, help="rows of --search")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="draw the phases' memory, stacked by kind, to FILE.png")  # fmt: skip
    add_plugin_argument(parser)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.tp=4")
    args = parser.parse_intermixed_args(argv)
    try:
        for name in ("nodes", "gpus_per_node", "top"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.gpu_gib <= 0:
            raise ValueError("--gpu-gib must be > 0")
        cfg = load_config(args.config, args.overrides, plugins=args.plugin)
        arch = _arch(cfg)
        cluster = planner.Cluster(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_gib
        )
        changes = dict(spec=args.spec, moe_imbalance=args.moe_imbalance)
        if args.rollout_tp is not None:  # else the config's rollout.tp
            changes["rollout_tp"] = args.rollout_tp
        setting = planner.Setting.from_config(cfg, **changes)
        if args.search:
            found = planner.search(arch, setting, cluster)
            if args.json:
                rows = [dict(p.to_json(arch), step_seconds=t) for t, p in found[: args.top]]
                print(json.dumps({"params_total": planner.params_total(arch), "fits": rows}))
            else:
                print(search_table(arch, found, args.top))
            return 0 if found else 1
        p = planner.plan(arch, setting, cluster)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_json(arch)) if args.json else report(arch, p))
    if args.plot is not None:
        s = p.setting
        title = (
            f"{' + '.join(Path(c).stem for c in args.config)}: tp={s.tp} pp={s.pp} dp={p.dp}, "
            f"rollout tp={s.rollout_tp}, sleep level {s.sleep_level}"
        )
        plot(p, args.plot, title)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
