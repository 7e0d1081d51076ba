"""Run megatron-core on CPU with gloo: a scoped redirection of its CUDA-only calls.

megatron-core 0.16-0.19 assumes CUDA in a handful of places. Inside `on_cpu()` (a no-op when
CUDA is available) each is redirected, and nothing outside the context is touched, so code that
shares the process (the vLLM engine, tests) keeps plain torch:

- `torch.cuda.current_device()` (rotary embedding, p2p communication, param/grad buffers,
  checkpoint saver) returns 0, an ordinal that the device rewrite below turns into the CPU.
- Tensors made with `device="cuda"`, `.cuda()` or `.to("cuda")` (the schedules'
  `total_num_tokens`, the optimizer, grad clipping) land on the CPU: a TorchFunctionMode
  rewrites CUDA device arguments.
- `param.grad.type() == 'torch.cuda.FloatTensor'` checks (grad clipping, distributed
  optimizer): CPU tensors report the CUDA type name of their dtype.
- The CUDA RNG state of the model-parallel RNG tracker (`tensor_parallel/random.py`:
  `_get/_set_cuda_rng_state`, `torch.cuda.get_rng_state/set_rng_state/manual_seed`) is the CPU
  generator's state.
- `torch.cuda.synchronize()` (p2p communication, async checkpoint writer) does nothing.
- `torch.cuda.current_stream()` (0.19) and `torch.cuda.Stream()` (the MoE all-to-all token
  dispatcher's side stream for its device-to-host copies) return a stub whose methods do
  nothing, and `torch.cuda.stream(...)` is an empty context.
- The MoE all-to-all dispatcher's split sizes, which it moves to the host as numpy arrays,
  become numpy arrays on CPU too (they would stay tensors, which `all_to_all_single` refuses).
- The MoE router's `te_general_gemm`, undefined without Transformer Engine, is defined as
  None, which selects its torch path.
- Activation recompute reruns layers inside autograd's backward, where torch function modes
  are not active: `CheckpointFunction.backward` re-enters the device rewrite, and so do the
  backward passes of the tensor-parallel collectives (`tensor_parallel.mappings`: the MoE
  dispatcher's all-to-all, sequence parallelism's gathers and reduce-scatters) and of the TP
  linear layers, which make their buffers on `torch.cuda.current_device()`.
- The gathers and reduce-scatters of uneven row counts (the MoE dispatcher's at expert_tp > 1
  under sequence parallelism), which gloo does not have: padded to the largest count, and
  all-reduced then sliced.

Known limits (rejected by `check_cpu_config` with the fix in the message): `apply_rope_fusion`
and `gradient_accumulation_fusion` need Transformer Engine or apex. Sequence parallelism runs
on the local spec with `model.SequenceParallelRMSNorm`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_state = threading.local()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # an ordinal from torch.cuda.current_device()
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_if_cuda(value: Any) -> Any:
    return torch.device("cpu") if _is_cuda(value) else value


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
}


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU and makes `.cuda()` the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu_if_cuda(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _StreamStub:
    """Stands in for a CUDA stream or event: every method is a no-op that returns another stub
    (`stream.record_event().synchronize()`), and `with torch.cuda.stream(stub)` does nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: _StreamStub()


def _define_missing_te_names() -> None:
    """megatron-core 0.16's MoE router tests `te_general_gemm is not None`, a name it only
    defines when Transformer Engine imports: without TE the test is a NameError. None is the
    value it means (the torch matmul path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patches() -> list[tuple[Any, str, Any]]:
    from megatron.core.tensor_parallel import random as mp_random

    def set_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    def get_state(*args, **kwargs):
        return torch.get_rng_state()

    from megatron.core.transformer.moe import token_dispatcher

    recompute = mp_random.CheckpointFunction.backward
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_on_cpu(tensor, as_numpy=False, record_stream=False):
        # On a GPU the split sizes come back as numpy arrays, the form all_to_all_single takes;
        # a CPU tensor is passed through as it is, and gloo's all_to_all_single refuses it
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    def recompute_on_cpu(ctx, *grads):
        with _CudaToCpu():
            return recompute(ctx, *grads)

    from megatron.core.tensor_parallel import layers, mappings

    def backward_on_cpu(function):
        backward = function.backward

        def run(ctx, *grads):
            with _CudaToCpu():
                return backward(ctx, *grads)

        return (function, "backward", staticmethod(run))

    # the collectives' autograd functions (all-to-all, and sequence parallelism's gathers and
    # reduce-scatters) and the TP linear's backward make their buffers on
    # torch.cuda.current_device(), in the autograd engine, where the device rewrite is off
    functions = [
        f
        for f in vars(mappings).values()
        if isinstance(f, type) and issubclass(f, torch.autograd.Function)
    ]
    functions.append(layers.LinearWithGradAccumulationAndAsyncCommunication)
    gather, reduce_scatter = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        # gloo's all_gather takes equal sizes only: pad each rank's rows to the largest count
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * group.size(), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most : i * most + n] for i, n in enumerate(output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        # gloo has no reduce_scatter of a list: the sum of the whole tensor, then this rank's rows
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].contiguous()

    return [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_stream", lambda *a, **k: _StreamStub()),
        (torch.cuda, "Stream", lambda *a, **k: _StreamStub()),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "get_rng_state", get_state),
        (torch.cuda, "set_rng_state", set_state),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (mp_random, "_get_cuda_rng_state", get_state),
        (mp_random, "_set_cuda_rng_state", set_state),
        (mp_random.CheckpointFunction, "backward", staticmethod(recompute_on_cpu)),
        (token_dispatcher, "maybe_move_tensor_to_cpu", to_host_on_cpu),
        *(backward_on_cpu(f) for f in functions),
        (mappings, "_gather_along_first_dim", gather_uneven),
        (mappings, "_reduce_scatter_along_first_dim", reduce_scatter_uneven),
    ]


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Redirect megatron-core's CUDA-only calls to the CPU while the context is open.

    A no-op when CUDA is available. Re-entrant; thread-local in its device rewriting (the
    `torch.cuda` attribute patches are process-wide while any context is open, so only enter it
    around Megatron calls).
    """
    if cuda_available() or getattr(_state, "depth", 0) > 0:
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    _define_missing_te_names()
    patches = _patches()
    # getattr_static keeps a class's staticmethod wrapper, so restoring leaves it as it was
    saved = [(obj, name, inspect.getattr_static(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    _state.depth = 1
    try:
        with _CudaToCpu():
            yield
    finally:
        _state.depth = 0
        for obj, name, value in saved:
            setattr(obj, name, value)


def check_cpu_config(config: Any) -> None:
    """Reject TransformerConfig settings that cannot run on CPU, saying what to change."""
    if cuda_available():
        return
    for flag in ("apply_rope_fusion", "gradient_accumulation_fusion"):
        if getattr(config, flag, False):
            raise ValueError(f"{flag} needs Transformer Engine or apex on a GPU; set {flag}=False")
