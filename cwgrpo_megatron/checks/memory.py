"""What a rank actually holds: the measured side of `cwgrpo_megatron.analysis.planner`.

Bytes are counted per storage, once: a view (a parameter inside DDP's buffer, an fp32 master
shard that is a slice of the parameter) costs nothing beyond the storage it views.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def trainer_state_bytes(ddp, optimizer) -> dict[str, int]:
    """{params, grads, optimizer} bytes this rank allocates: the model's parameters (DDP's
    parameter buffer with the distributed optimizer), DDP's gradient buffers, and the optimizer's
    fp32 master parameters and state tensors that are not one of the first two."""
    module = getattr(ddp, "module", ddp)
    params = _storages(p.data for p in module.parameters())
    grads = _storages(buffer.grad_data for buffer in ddp.buffers + ddp.expert_parallel_buffers)
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = {}
    for opt in inner:
        for group in opt.param_groups:
            state.update(_storages(group["params"]))
        for values in opt.state.values():
            state.update(_storages(values.values()))
    for ptr in list(state):
        if ptr in params or ptr in grads:
            del state[ptr]
    return {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(state.values()),
    }


@contextmanager
def saved_activations(model) -> Iterator[dict[str, int]]:
    """Count the bytes of tensors autograd saves for backward inside the block, once per
    storage and leaving out `model`'s parameters; `result["bytes"]` holds the sum on exit."""
    params = set(_storages(p.data for p in model.parameters()))
    seen: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(seen.values())


def micro_batch_saved_bytes(model, batch, cfg, arch) -> int:
    """Bytes saved for backward by one training micro-batch on this rank (pp = 1): the model's
    forward and the train step's loss (`train_step.micro_batch_loss`: vocabulary-parallel
    log-probs and the policy loss). The loss's other inputs are stand-ins (l_old = l_ref = 0,
    w~ = 1): the bytes do not depend on their values."""
    from cwgrpo_megatron.algo import build_policy_loss
    from cwgrpo_megatron.megatron.cpu import on_cpu
    from cwgrpo_megatron.megatron.train_step import MicroInputs, micro_batch_loss

    zeros = torch.zeros_like(batch.loss_mask)
    inputs = MicroInputs(
        batch=batch,
        old_logp=zeros,
        token_stat=torch.ones_like(zeros),
        ref_logp=zeros if cfg.algo.kl_beta > 0 else None,
    )
    with on_cpu(), saved_activations(model) as counted:
        logits = model(batch.tokens, batch.position_ids, attention_mask=None)
        out = micro_batch_loss(
            logits,
            inputs,
            build_policy_loss(cfg.algo),
            cfg.algo,
            temperature=cfg.train.temperature,
            arch=arch,
        )
        del out
    return counted["bytes"]
