"""Forward-only passes through Megatron's pipeline schedule."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func

from cwgrpo_megatron.megatron.cpu import on_cpu


def forward_logits(model: GPTModel, tokens: torch.Tensor, *, micro_batch_size: int | None = None):
    """Logits `[b, s, V/tp]` of `tokens [b, s]` on the last pipeline stage, None elsewhere.

    Runs Megatron's forward-only schedule (1F1B warm-up sends with pp > 1) over micro-batches of
    `micro_batch_size` rows (default: the whole batch). Every rank of the model-parallel group
    must call it with the same tokens.
    """
    b, s = tokens.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch of {b} rows does not split into micro-batches of {mbs}")
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(mbs, s)
    batches = iter(tokens.split(mbs))
    collected: list[torch.Tensor] = []

    def forward_step(data_iterator, model_chunk):
        output = model_chunk(next(data_iterator), positions, attention_mask=None)

        def keep(output_tensor):
            collected.append(output_tensor.detach())
            return output_tensor.new_zeros(()), {}

        return output, keep

    with on_cpu(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=b // mbs,
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(collected, dim=0)
