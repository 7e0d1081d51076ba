"""Does the rollout engine score like the trainer after a weight sync? (check_weight_sync.py)

Per round: one seeded optimizer step changes the Megatron weights; the engine's log-probs of a
fixed batch are taken BEFORE the sync (they must be stale, i.e. differ) and AFTER it (they must
match the trainer's vocab-parallel log-probs). Needs torch.distributed; rank 0 owns the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import psutil
import torch
import torch.distributed as dist

from cwgrpo_megatron.data.batching import synthetic_batch
from cwgrpo_megatron.dist import broadcast_from
from cwgrpo_megatron.megatron import parallel
from cwgrpo_megatron.megatron.layout_check import layout_config, tiny_trainer
from cwgrpo_megatron.megatron.train_step import train_step
from cwgrpo_megatron.megatron.weight_sync import ENGINE_RANK, score, sync_weights, unwrap


def process_tree_rss_mb() -> float:
    """Resident memory of this process and its children (engine processes), MiB."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # an engine process may just have exited
            total += p.memory_info().rss
    return total / 2**20


def start_engine(backend: str, hf_dir: str, *, dtype: str, max_model_len: int, seed: int):
    from cwgrpo_megatron.rollout import get_engine

    return get_engine(backend)(hf_dir, dtype=dtype, max_model_len=max_model_len, seed=seed)


def fixed_sequences(vocab_size: int, *, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def both_logprobs(model, arch, engine, tokens: torch.Tensor):
    """(engine, trainer) log p(x_t | x_<t) `[b, s-1]` of `tokens` `[b, s]` at temperature 1, on
    rank 0 (None elsewhere). Every rank calls it: the trainer's side is a forward pass."""
    ours = score(model, arch, tokens)
    if engine is None:
        return None
    return torch.tensor(engine.prompt_logprobs(tokens.tolist())), ours


class SyncMismatchError(RuntimeError):
    """The engine does not score like the trainer after a weight sync."""


def sync_gap(model, arch, engine, *, batch: int = 4, seq_len: int = 32, seed: int = 0) -> float:
    """max |engine - trainer| log p(x_t | x_<t) on fixed random sequences (a function of the
    seed and the vocabulary only), on every rank: broadcast from rank 0 over the world."""
    tokens = fixed_sequences(arch.vocab_size, batch=batch, seq_len=seq_len, seed=seed)
    pair = both_logprobs(model, arch, engine, tokens)
    worst = torch.tensor([float((pair[0] - pair[1]).abs().max()) if pair is not None else 0.0])
    device = next(unwrap(model).parameters()).device
    return float(broadcast_from(worst.to(device), ENGINE_RANK, dist.group.WORLD).item())


def verify_sync(
    model, arch, engine, *, tol: float, batch: int = 4, seq_len: int = 32, seed: int = 0
) -> float:
    """After a sync: the gap of `sync_gap`. Raises SyncMismatchError on every rank above `tol`
    (every rank holds the same gap), so no rank trains on while the rollouts come from other
    weights."""
    worst = sync_gap(model, arch, engine, batch=batch, seq_len=seq_len, seed=seed)
    if not worst <= tol:  # NaN fails too
        raise SyncMismatchError(
            f"after the weight sync the engine's log-probs differ from the trainer's by up to "
            f"{worst:.3e} > tol {tol:g}: the engine samples from other "
            "weights than the trainer's (check the engine dtype against train.params_dtype, "
            "and run tools/check_weight_sync.py on this layout)"
        )
    return worst


class SyncVerifier:
    """The training loop's verdict on a weight sync, calibrated on the start checkpoint.

        tol = max(min_tol, FACTOR x gap_start)

    gap_start is the engine-vs-trainer gap (`sync_gap`) while both hold the start checkpoint,
    before any training or sync: the engines' own numerical gap (their kernels, reduction
    orders and dtypes). Measured on vLLM's CPU kernels in fp32: 4.8e-7 for the tiny test
    Qwen2; for SmolLM2-135M 6.5e-5 on these sequences and 5.4e-4 on check_weight_sync's, so
    that a fixed 1e-4 fails a correct sync of a real model on some sequences. A sync error (a
    stale, missing or misplaced tensor) moves log-probs by a sizeable fraction of a nat or
    more, while training moves the numerical gap by a small factor (SmolLM2-135M: 1.0x over two
    training steps, 3.6x after check_weight_sync's Adam step, 4.8x after an SGD step that moved
    log-probs by 8.3 nats): an order of magnitude above gap_start separates the two.
    """

    FACTOR = 10.0

    def __init__(self, *, min_tol: float) -> None:
        self.min_tol = min_tol
        self.start_gap: float | None = None

    def calibrate(self, model, arch, engine) -> float:
        """Measure gap_start; call while engine and trainer hold the same start weights."""
        self.start_gap = sync_gap(model, arch, engine)
        return self.start_gap

    @property
    def tol(self) -> float:
        if self.start_gap is None:
            raise RuntimeError("SyncVerifier.calibrate must run on the start checkpoint first")
        return max(self.min_tol, self.FACTOR * self.start_gap)

    def check(self, model, arch, engine) -> float:
        """The gap after a sync; SyncMismatchError on every rank above `tol`."""
        return verify_sync(model, arch, engine, tol=self.tol)


REALISTIC_STEP = ("optim.optimizer=adam", "optim.lr=1e-5", "optim.clip_grad=1.0")
"""An RL step: Adam at the top of the usual learning rates (1e-6 to 1e-5), clipped. Its first
update moves every parameter by about lr: up to 0.56 nats on SmolLM2-135M's log-probs (1.2e-2
on the tiny Qwen2), enough to see a stale engine, and far from layout_config's default SGD step
(lr 0.05), which moved SmolLM2-135M's log-probs by 8.3 nats."""


def run_check(
    *,
    hf_dir: str,
    tp: int = 1,
    pp: int = 1,
    backend: str = "vllm",
    rounds: int = 1,
    batch: int = 4,
    seq_len: int = 24,
    seed: int = 0,
    dtype: str = "float32",
    step: Sequence[str] = (),
    engine=None,
) -> dict | None:
    """Summary on rank 0, None on other ranks: `start_max_abs` (the engine-vs-trainer gap while
    both hold the checkpoint, before any step) and per round {max_abs, mean_abs, stale_max_abs,
    versions, paths, loads, rss_mb}. `step` overrides the optimizer settings of each round's
    update (default: layout_config's SGD; the CLI passes REALISTIC_STEP). `engine` may be given
    (rank 0) to reuse one across calls."""
    world = dist.get_world_size()
    cfg = layout_config(
        tp=tp,
        pp=pp,
        micro_batches=1,
        global_batch=8,
        group_size=4,
        steps=rounds,
        world_size=world,
        overrides=[f"train.params_dtype={dtype}", f"train.seed={seed}", *step],
    )
    trainer, arch = tiny_trainer(cfg, hf_dir=hf_dir)
    owns_engine = False
    try:
        own = dist.get_rank() == ENGINE_RANK
        owns_engine = own and engine is None
        if owns_engine:
            engine = start_engine(backend, hf_dir, dtype=dtype, max_model_len=128, seed=seed)
        tokens = fixed_sequences(arch.vocab_size, batch=batch, seq_len=seq_len, seed=seed + 7)
        rows = tokens.tolist()
        report: dict = {k: [] for k in ("max_abs", "mean_abs", "stale_max_abs")}
        report.update(versions=[], paths=[], loads=[], rss_mb=[])
        start = both_logprobs(trainer.model, arch, engine, tokens)
        if own:
            report["start_max_abs"] = float((start[0] - start[1]).abs().max())
        for r in range(rounds):
            step_batch = synthetic_batch(
                prompts=2, group_size=4, seq_len=24, vocab_size=arch.vocab_size, seed=seed + r
            )
            train_step(trainer, step_batch)
            stale = torch.tensor(engine.prompt_logprobs(rows)) if own else None
            synced = sync_weights(trainer.model, arch, engine, dtype=dtype)
            pair = both_logprobs(trainer.model, arch, engine, tokens)
            if own:
                theirs, ours = pair
                delta = (theirs - ours).abs()
                report["max_abs"].append(float(delta.max()))
                report["mean_abs"].append(float(delta.mean()))
                report["stale_max_abs"].append(float((stale - ours).abs().max()))
                report["versions"].append(synced.version)
                report["paths"].append(synced.path)
                report["loads"].append(getattr(engine, "last_load", None))
                report["rss_mb"].append(process_tree_rss_mb())
        return report if own else None
    finally:
        parallel.destroy()
        if owns_engine:
            engine.shutdown()  # after Megatron's groups: in-process it ends torch.distributed
