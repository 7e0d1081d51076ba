"""The shm fill and the transfer's source of a Megatron model, for the tests that check each
alone: the senders (`weight_sync.senders`) call these through `megatron.publish.MegatronExport`."""

import torch

from cwgrpo_megatron.comm import job_rank
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.megatron.model import unwrap, use_transformer_engine
from cwgrpo_megatron.megatron.publish import MegatronExport
from cwgrpo_megatron.weight_sync import senders
from cwgrpo_megatron.weight_sync.plan import SyncPlan
from cwgrpo_megatron.weight_sync.shm import SharedWeights


def fill_buffers(
    model, arch: ModelArch, plan: SyncPlan, buffers: list[SharedWeights], *, dtype: torch.dtype
) -> int:
    """This rank's part of the shm path of `plan` for `model` (`senders.fill_buffers`); the
    bytes it received."""
    return senders.fill_buffers(
        dict(unwrap(model).named_parameters()),
        arch,
        plan,
        buffers,
        dtype=dtype,
        rank=job_rank(),
        te_spec=use_transformer_engine(),
    )


def _transfer_source(model, arch: ModelArch, dtype: str):
    """The model as vLLM's weight transfer reads it (`senders._transfer_source`)."""
    return senders._transfer_source(model, MegatronExport.of(arch, dtype))
