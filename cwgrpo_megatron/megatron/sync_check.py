"""Does the rollout engine score like the trainer after a weight sync? (check_weight_sync.py)

Per round: one seeded optimizer step changes the Megatron weights; the engine's log-probs of a
fixed batch are taken BEFORE the sync (they must be stale, i.e. differ) and AFTER it (they must
match the trainer's vocab-parallel log-probs). Needs torch.distributed; rank 0 owns the engine.
"""

from __future__ import annotations

import contextlib

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


def verify_sync(
    model, arch, engine, *, tol: float, batch: int = 4, seq_len: int = 32, seed: int = 0
) -> float:
    """After a sync: the max |delta log-prob| between engine and trainer on fixed random
    sequences (what a training loop's `--verify-sync` runs). Raises SyncMismatchError on every rank
    above `tol` (the verdict is broadcast from rank 0 over the world), so no rank trains on
    while the rollouts come from other weights."""
    tokens = fixed_sequences(arch.vocab_size, batch=batch, seq_len=seq_len, seed=seed)
    pair = both_logprobs(model, arch, engine, tokens)
    worst = torch.tensor([float((pair[0] - pair[1]).abs().max()) if pair is not None else 0.0])
    device = next(unwrap(model).parameters()).device
    worst = float(broadcast_from(worst.to(device), ENGINE_RANK, dist.group.WORLD).item())
    if not worst <= tol:  # NaN fails too
        raise SyncMismatchError(
            f"after the weight sync the engine's log-probs differ from the trainer's by up to "
            f"{worst:.3e} > tol {tol:g}: the engine samples from other "
            "weights than the trainer's (check the engine dtype against train.params_dtype, "
            "and run tools/check_weight_sync.py on this layout)"
        )
    return worst


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
    engine=None,
) -> dict | None:
    """Summary on rank 0 ({max_abs, mean_abs, stale_max_abs, versions, paths, loads, rss_mb} per
    round), None on other ranks. `engine` may be given (rank 0) to reuse one across calls."""
    world = dist.get_world_size()
    cfg = layout_config(
        tp=tp,
        pp=pp,
        micro_batches=1,
        global_batch=8,
        group_size=4,
        steps=rounds,
        world_size=world,
        overrides=[f"train.params_dtype={dtype}", f"train.seed={seed}"],
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
        report: dict[str, list] = {k: [] for k in ("max_abs", "mean_abs", "stale_max_abs")}
        report.update(versions=[], paths=[], loads=[], rss_mb=[])
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
