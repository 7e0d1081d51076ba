"""The Megatron side of the weight sync: what the senders read of a Megatron model
(`MegatronExport`: this rank's shards, and the whole model as HF tensors through Megatron's
groups), the sender of a run (`weight_sender`), and the log-prob check (`score`). The senders,
the plan, the buffers and the receiver protocol are `weight_sync`'s (`weight_sync.senders`
says how each path goes).

One engine per replica (`rollout.replicas.Replicas`), owned by the first rank of its group;
with one replica that is global rank 0 (`ENGINE_RANK`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from cwgrpo_megatron.comm import (
    all_gather_objects,
    broadcast_from,
    size_of,
    vocab_parallel_logprob_entropy,
    world_group,
)
from cwgrpo_megatron.comm.collectives import Group
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.megatron.forward import forward_logits
from cwgrpo_megatron.megatron.model import (
    DTYPES,
    expert_layout,
    expert_ranks,
    unwrap,
    use_transformer_engine,
)
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors
from cwgrpo_megatron.weight_sync.plan import Place, SyncPlan
from cwgrpo_megatron.weight_sync.receiver import WeightReceiver
from cwgrpo_megatron.weight_sync.senders import Sender, SyncResult, build_sender

ENGINE_RANK = 0


def export_groups() -> ExportGroups:
    tp, pp = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    ep, expert_tp = expert_layout()
    return ExportGroups(
        tp=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        pp=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
        ep=parallel_state.get_expert_model_parallel_group() if ep > 1 else None,
        expert_tp=parallel_state.get_expert_tensor_parallel_group() if expert_tp > 1 else None,
        te_spec=use_transformer_engine(),
    )


def hf_weights(model, arch: ModelArch, *, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as HF-named full tensors in `dtype`; a collective over TP x PP (x EP)
    of the ranks `in_engine_group`."""
    return _hf_tensors(model, arch, DTYPES[dtype])


def _hf_tensors(model, arch: ModelArch, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    params = dict(unwrap(model).named_parameters())
    device = next(iter(params.values())).device
    return hf_tensors(params, arch, groups=export_groups(), dtype=dtype, device=device)


def in_engine_group() -> bool:
    """This rank takes part in the export to the engine: it shares rank 0's model copy
    (data-parallel rank 0), or, with experts split over ep > 1 ranks, it holds experts of that
    copy (expert-data-parallel rank 0)."""
    if parallel_state.get_data_parallel_rank() == 0:
        return True
    ep, _ = expert_layout()
    return ep > 1 and parallel_state.get_expert_data_parallel_rank() == 0


@dataclass(frozen=True)
class MegatronExport:
    """What the weight senders read of a Megatron model (`weight_sync.senders.ModelExport`):
    this rank's shards, and the whole model as HF tensors through Megatron's groups."""

    arch: ModelArch
    dtype: torch.dtype
    te_spec: bool
    pp: int
    ep: int
    in_engine_group: bool

    @classmethod
    def of(cls, arch: ModelArch, dtype: str) -> MegatronExport:
        """The export of this rank's model in Megatron's current groups, cast to `dtype`."""
        return cls(
            arch=arch,
            dtype=DTYPES[dtype],
            te_spec=use_transformer_engine(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            ep=expert_layout()[0],
            in_engine_group=in_engine_group(),
        )

    def shards(self, model) -> dict[str, torch.Tensor]:
        return dict(unwrap(model).named_parameters())

    def full_tensors(self, model) -> Iterator[tuple[str, torch.Tensor]]:
        return _hf_tensors(model, self.arch, self.dtype)


def sync_plan(replicas: Replicas, arch: ModelArch, *, control: Group = None) -> SyncPlan:
    """The sync plan of this job's layout for `arch`; one all_gather_object of what every rank
    holds (its stage and TP rank, and a MoE model's EP and expert-TP ranks) over `control`
    (the job's control group; None: the world)."""
    ep_rank, expert_tp_rank = expert_ranks()
    here = Place(
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        ep_rank=ep_rank if arch.is_moe else None,
        expert_tp_rank=expert_tp_rank if arch.is_moe else 0,
    )
    group = world_group() if control is None else control
    return SyncPlan.build(replicas, all_gather_objects(here, group))


def weight_sender(
    plan: SyncPlan,
    engine: WeightReceiver | None,
    arch: ModelArch,
    *,
    dtype: str,
    control: Group = None,
) -> Sender:
    """The sender of this job's weight path (`weight_sync.senders.build_sender`) for a model
    of `arch` synced in `dtype`; every rank calls it, the replica owners with their engine.
    Its agreements go over `control` (the job's control group; None: the world)."""
    export, world = MegatronExport.of(arch, dtype), world_group()
    control = world if control is None else control
    return build_sender(plan, engine, export, group=world, control=control)


def sync_weights(
    model,
    arch: ModelArch,
    engine: WeightReceiver | None,
    *,
    dtype: str,
    plan: SyncPlan | None = None,
) -> SyncResult:
    """One sync with a sender built for it: for checks and tools (a run builds its sender once,
    `components.sync.WeightSync`). Every rank calls this; `plan` None means one engine on rank
    0 (built here with one all-gather)."""
    plan = plan or sync_plan(Replicas.single(size_of(world_group())), arch)
    return weight_sender(plan, engine, arch, dtype=dtype).send(model, engine)


def score(model, arch: ModelArch, tokens: torch.Tensor) -> torch.Tensor | None:
    """log p(x_t | x_<t) `[b, s-1]` at temperature 1 from the vocab-parallel logits, on rank 0
    of the engine group (sent from the last stage over PP); None on ranks outside that group."""
    if not in_engine_group():
        return None
    # on the model's device: the zeros of the other stages are broadcast over NCCL on a GPU
    tokens = tokens.to(next(unwrap(model).parameters()).device)
    logits = forward_logits(model, tokens)
    last = parallel_state.is_pipeline_last_stage()
    logp = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    if last:
        target = tokens[:, 1:]
        logp, _ = vocab_parallel_logprob_entropy(
            logits[:, :-1].float().contiguous(),
            target,
            group=parallel_state.get_tensor_model_parallel_group(),
            vocab_size=arch.vocab_size,
        )
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    return broadcast_from(logp.float(), src, pp_group).cpu()
