"""Does the rollout engine score like the trainer after a weight sync? (check_weight_sync.py)

Per round: one seeded optimizer step changes the Megatron weights; the engine's log-probs of a
fixed batch are taken BEFORE the sync (they must be stale, i.e. differ) and AFTER it (they must
match the trainer's vocab-parallel log-probs). Needs torch.distributed; rank 0 owns the engine.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
from cwgrpo_megatron.comm import (
    all_gather,
    broadcast_from,
    broadcast_object,
    global_rank,
    job_rank,
    world_group,
)
from cwgrpo_megatron.comm.collectives import barrier
from cwgrpo_megatron.data.batching import synthetic_batch
from cwgrpo_megatron.megatron import parallel
from cwgrpo_megatron.megatron.model import unwrap
from cwgrpo_megatron.megatron.publish import (
    ENGINE_RANK,
    hf_weights,
    in_engine_group,
    score,
    sync_weights,
)
from cwgrpo_megatron.megatron.train_step import train_step


def process_tree_rss_mb() -> float:
    """Resident memory of this process and its children (engine processes), MiB."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # an engine process may just have exited
            total += p.memory_info().rss
    return total / 2**20


@contextlib.contextmanager
def first_layers(hf_dir: str, num_layers: int | None) -> Iterator[str]:
    """`hf_dir`, or with `num_layers` a node-local copy of its first layers
    (`checks.truncate`), written by each node's first rank and removed at the end."""
    if num_layers is None:
        yield hf_dir
        return
    from cwgrpo_megatron.checks.truncate import truncate_checkpoint

    world = dist.group.WORLD
    mine = tempfile.mkdtemp(prefix="cwgrpo-layers-") if job_rank() == 0 else None
    folder = broadcast_object(mine, 0, world)
    out = os.path.join(folder, f"first{num_layers}")
    local_first = os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        if local_first:
            os.makedirs(folder, exist_ok=True)
            truncate_checkpoint(hf_dir, num_layers, out)
        barrier(world)
        yield out
    finally:
        if dist.is_initialized():  # an in-process vLLM engine ends torch.distributed on exit
            barrier(world)  # no rank still reads the copy
        if local_first:
            shutil.rmtree(folder, ignore_errors=True)


def start_engine(
    backend: str, hf_dir: str, *, dtype: str, max_model_len: int, seed: int, **engine_args
):
    from cwgrpo_megatron.rollout import get_engine

    return get_engine(backend)(
        hf_dir, dtype=dtype, max_model_len=max_model_len, seed=seed, **engine_args
    )


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


@dataclass(frozen=True)
class Gap:
    """|engine - trainer| log p(x_t | x_<t) over the tokens of the fixed sequences: the worst
    token and the mean, of the worst engine (each the largest over the replicas). Engine
    numerics put a few tokens far above the mean; a sync error (a stale or misplaced tensor)
    moves every token."""

    max: float
    mean: float
    rank: int = ENGINE_RANK
    """The owner of the engine with the largest worst-token gap."""


def sync_gap(model, arch, engine, *, batch: int = 4, seq_len: int = 32, seed: int = 0) -> Gap:
    """The gap on fixed random sequences (a function of the seed and the vocabulary only) of
    every replica's engine (`engine` on its owner, None elsewhere), on every rank: the
    trainer's log-probs are broadcast from rank 0 over the world, each owner compares its
    engine's, and one all-gather of the (max, mean) pairs gives every rank the worst."""
    tokens = fixed_sequences(arch.vocab_size, batch=batch, seq_len=seq_len, seed=seed)
    ours = score(model, arch, tokens)
    device = next(unwrap(model).parameters()).device
    world = world_group()
    if ours is None:
        ours = torch.zeros(batch, seq_len - 1)
    ours = broadcast_from(ours.to(device), ENGINE_RANK, world).cpu()
    both = torch.zeros(2)
    if engine is not None:
        delta = (torch.tensor(engine.prompt_logprobs(tokens.tolist())) - ours).abs()
        both = torch.stack([delta.max(), delta.mean()]).float()
    pairs = torch.stack(all_gather(both.to(device), world)).cpu()
    worst = int(pairs[:, 0].argmax())
    return Gap(
        max=float(pairs[worst, 0]), mean=float(pairs[:, 1].max()), rank=global_rank(world, worst)
    )


def verify_sync(
    model, arch, engine, *, tol: Gap | float, batch: int = 4, seq_len: int = 32, seed: int = 0
) -> Gap:
    """After a sync: the gap of `sync_gap`. Raises SyncMismatchError on every rank when its
    max or its mean exceeds `tol`'s (a float bounds the max only); every rank holds the same
    gap, so no rank trains on while the rollouts come from other weights."""
    tol = tol if isinstance(tol, Gap) else Gap(max=tol, mean=math.inf)
    gap = sync_gap(model, arch, engine, batch=batch, seq_len=seq_len, seed=seed)
    if not gap.max <= tol.max:  # NaN fails too
        what = f"by up to {gap.max:.3e} > tol {tol.max:g}"
    elif not gap.mean <= tol.mean:
        what = f"by {gap.mean:.3e} on average > tol {tol.mean:g}"
    else:
        return gap
    raise SyncMismatchError(
        f"after the weight sync the log-probs of the engine on rank {gap.rank} differ from the "
        f"trainer's {what}: the engine samples from other weights than the trainer's (check "
        "the engine dtype against "
        "train.params_dtype, and run tools/check_weight_sync.py on this layout)"
    )


class SyncVerifier:
    """The training loop's verdict on a weight sync, calibrated on the start checkpoint.

        tol.max  = max(min_tol, FACTOR x gap_start.max)
        tol.mean = max(min_tol, FACTOR x gap_start.mean)

    gap_start is the engine-vs-trainer gap (`sync_gap`) while both hold the start checkpoint,
    before any training or sync: the engines' own numerical gap (their kernels, reduction
    orders and dtypes). Measured on vLLM's CPU kernels in fp32: a max of 4.8e-7 for the tiny
    test Qwen2; for SmolLM2-135M 6.5e-5 on these sequences and 6.8e-4 on check_weight_sync's,
    so that a fixed 1e-4 fails a correct sync of a real model on some sequences. Training moves
    the numerical gap by a small factor (SmolLM2-135M: 1.0x over two training steps, 1.9x
    after check_weight_sync's Adam step), while a sync error moves log-probs by more than an
    order of magnitude above gap_start. The mean matters for small errors: one layer left
    stale after that Adam step moves SmolLM2's worst token by 1.3e-2 (1.9x the max tolerance)
    but the mean by 1.9e-3 (docs/rollouts.md).
    """

    FACTOR = 10.0

    def __init__(self, *, min_tol: float) -> None:
        self.min_tol = min_tol
        self.start_gap: Gap | None = None

    @classmethod
    def tolerance(cls, start: Gap, min_tol: float) -> Gap:
        return Gap(
            max=max(min_tol, cls.FACTOR * start.max), mean=max(min_tol, cls.FACTOR * start.mean)
        )

    def calibrate(self, model, arch, engine) -> Gap:
        """Measure gap_start; call while engine and trainer hold the same start weights."""
        self.start_gap = sync_gap(model, arch, engine)
        return self.start_gap

    @property
    def tol(self) -> Gap:
        if self.start_gap is None:
            raise RuntimeError("SyncVerifier.calibrate must run on the start checkpoint first")
        return self.tolerance(self.start_gap, self.min_tol)

    def check(self, model, arch, engine) -> Gap:
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
    ep: int = 1,
    backend: str = "vllm",
    rounds: int = 1,
    batch: int = 4,
    seq_len: int = 24,
    seed: int = 0,
    dtype: str = "float32",
    step: Sequence[str] = (),
    engine=None,
    plant: str | None = None,
    engine_args: dict | None = None,
) -> dict | None:
    """Summary on rank 0, None on other ranks: `start_max_abs` and `start_mean_abs` (the
    engine-vs-trainer gap while both hold the checkpoint, before any step) and per round {max_abs,
    mean_abs, stale_max_abs, versions, paths, loads, rss_mb}. `step` overrides the optimizer
    settings of each round's update (default: layout_config's SGD; the CLI passes
    REALISTIC_STEP). `engine` may be given (rank 0) to reuse one across calls. `plant` (one of
    SYNC_PLANTS) corrupts what the engine holds after each sync, a negative control.
    `engine_args` go to the engine rank 0 starts (e.g. in_process=False)."""
    if plant is not None and plant not in SYNC_PLANTS:
        raise ValueError(f"unknown plant {plant!r}; choose from {', '.join(SYNC_PLANTS)}")
    world = dist.get_world_size()
    cfg = layout_config(
        tp=tp,
        pp=pp,
        micro_batches=1,
        global_batch=8,
        group_size=4,
        steps=rounds,
        world_size=world,
        overrides=[f"parallel.ep={ep}", f"train.params_dtype={dtype}", f"train.seed={seed}", *step],
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    owns_engine = False
    try:
        own = job_rank() == ENGINE_RANK
        owns_engine = own and engine is None
        if owns_engine:
            engine = start_engine(
                backend, hf_dir, dtype=dtype, max_model_len=128, seed=seed, **(engine_args or {})
            )
        tokens = fixed_sequences(arch.vocab_size, batch=batch, seq_len=seq_len, seed=seed + 7)
        rows = tokens.tolist()
        report: dict = {k: [] for k in ("max_abs", "mean_abs", "stale_max_abs")}
        report.update(versions=[], paths=[], loads=[], rss_mb=[])
        start = both_logprobs(actor.model, arch, engine, tokens)
        if own:
            report["start_max_abs"] = float((start[0] - start[1]).abs().max())
            report["start_mean_abs"] = float((start[0] - start[1]).abs().mean())
        for r in range(rounds):
            step_batch = synthetic_batch(
                prompts=2, group_size=4, seq_len=24, vocab_size=arch.vocab_size, seed=seed + r
            )
            before = _layer_tensors(actor.model, arch) if plant == "stale_layer" else None
            train_step(actor, step_batch)
            stale = torch.tensor(engine.prompt_logprobs(rows)) if own else None
            synced = sync_weights(actor.model, arch, engine, dtype=dtype)
            if plant is not None:
                _push_planted(actor.model, arch, engine, plant, before, dtype=dtype)
            pair = both_logprobs(actor.model, arch, engine, tokens)
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


SYNC_PLANTS = ("stale_layer", "swapped_q_shards")
"""Sync errors `run_check(plant=...)` builds in on purpose, in the middle layer L = layers // 2:

- stale_layer: the engine keeps layer L's weights from before the step;
- swapped_q_shards: in layer L, the q rows of KV groups 0 and 1 trade places (at tp = n_kv, the
  q shards of TP ranks 0 and 1), as an export that mixes up two ranks' shards would."""


def _planted_layer(arch) -> str:
    return f"model.layers.{arch.num_layers // 2}."


def _layer_tensors(model, arch) -> dict | None:
    """Rank 0's copy of the planted layer's HF tensors; a collective over the engine group."""
    if not in_engine_group():
        return None
    keep, prefix = job_rank() == ENGINE_RANK, _planted_layer(arch)
    out = {}
    for name, tensor in hf_weights(model, arch, dtype="float32"):
        if keep and name.startswith(prefix):
            out[name] = tensor.clone()
    return out


def _push_planted(model, arch, engine, plant: str, before, *, dtype: str) -> None:
    """Re-send the whole model to the engine with the planted error in layer L (the full update
    an engine accepts); a collective over the engine group, like `sync_weights`' stream."""
    if not in_engine_group():
        return
    if plant == "swapped_q_shards" and arch.num_kv_heads < 2:
        raise ValueError("plant swapped_q_shards needs at least 2 KV groups")
    prefix, block = _planted_layer(arch), arch.heads_per_group * arch.head_dim

    def corrupt(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.startswith(prefix):
            return tensor
        if plant == "stale_layer":
            return before[name].to(tensor.dtype)
        if ".self_attn.q_proj." in name:
            swapped = tensor.clone()
            swapped[:block], swapped[block : 2 * block] = tensor[block : 2 * block], tensor[:block]
            return swapped
        return tensor

    stream = hf_weights(model, arch, dtype=dtype)
    if engine is None:
        for _ in stream:  # the collectives need every peer
            pass
    else:
        engine.load_stream((n, corrupt(n, t)) for n, t in stream)
