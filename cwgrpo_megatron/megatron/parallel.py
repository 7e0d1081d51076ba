"""Set up Megatron's tensor / pipeline / data parallel groups on an initialised process group."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from cwgrpo_megatron.megatron.cpu import on_cpu


def initialize(
    *, tp: int = 1, pp: int = 1, ep: int = 1, expert_tp: int = 1, seed: int = 1234
) -> None:
    """Create Megatron's groups for tp x pp (dp = world / (tp pp)) and seed its RNG tracker.

    A MoE model's experts have groups of their own over the same ranks: ep expert-parallel
    ranks (each holds E / ep experts) x expert_tp ranks that split each expert, with
    world / (expert_tp ep pp) expert-data-parallel replicas. torch.distributed must already
    be initialised (torchrun, or `init_process_group`).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: launch with torchrun or call "
            "torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp x pp = {tp} x {pp}")
    if world % (expert_tp * ep * pp):
        raise ValueError(
            f"world size {world} is not a multiple of expert_tp x ep x pp = "
            f"{expert_tp} x {ep} x {pp}"
        )
    with on_cpu():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tp,
        )
        model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    parallel_state.destroy_model_parallel()


def layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tp": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def data_parallel() -> tuple[int, int]:
    """(rank, size) of this rank in its data-parallel group."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
