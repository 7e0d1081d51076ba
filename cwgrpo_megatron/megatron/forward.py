"""Forward-only passes through Megatron's pipeline schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from cwgrpo_megatron.megatron.cpu import on_cpu
from cwgrpo_megatron.megatron.model import sequence_multiple


def forward_only(
    model, token_batches: Sequence[torch.Tensor], on_logits: Callable[[torch.Tensor, int], object]
) -> list | None:
    """Run `token_batches` (`[mbs, s]` micro-batches) forward with no gradient.

    On the last pipeline stage returns `[on_logits(logits, i) for each micro-batch i]`, with
    logits `[mbs, s, V/tp]`; None on other stages. Every rank of the model-parallel group
    calls it with the same micro-batches (pipeline stages exchange activations via p2p). With
    pp > 1, micro-batches of different shapes need the model's config.variable_seq_lengths.
    """
    mbs = max(t.shape[0] for t in token_batches)
    s = max(t.shape[1] for t in token_batches)
    batches = iter(enumerate(token_batches))
    results: list = []

    def forward_step(data_iterator, model_chunk):
        index, tokens = next(data_iterator)
        # token ids made on the host (a check's fixed sequences) go to the model's device
        tokens = tokens.to(next(model_chunk.parameters()).device)
        b, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).unsqueeze(0).expand(b, length)
        output = model_chunk(tokens, positions, attention_mask=None)

        def keep(output_tensor):
            results.append(on_logits(output_tensor.detach(), index))
            return output_tensor.new_zeros(()), {}

        return output, keep

    with on_cpu(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(token_batches),
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=True,
        )
    return results if parallel_state.is_pipeline_last_stage() else None


def forward_logits(model, tokens: torch.Tensor, *, micro_batch_size: int | None = None):
    """Logits `[b, s, V/tp]` of `tokens [b, s]` on the last pipeline stage, None elsewhere."""
    mbs = micro_batch_size or tokens.shape[0]
    if tokens.shape[0] % mbs:
        raise ValueError(f"batch of {tokens.shape[0]} rows does not split into {mbs}-row parts")
    # sequence parallelism splits the sequence over the TP ranks: pad it, then cut the logits
    length = tokens.shape[1]
    padded = F.pad(tokens, (0, -length % sequence_multiple(model)))
    out = forward_only(model, list(padded.split(mbs)), lambda logits, _: logits[:, :length])
    return None if out is None else torch.cat(out, dim=0)
