"""GPU memory per rank for a run config at a layout: pure arithmetic, no megatron import.

Everything is bytes on the most-loaded GPU. Notation: tp / pp / dp the layout, h hidden, f the
FFN width, a = heads/tp, q = a * head_dim, k = kv_heads * head_dim / tp, V the padded
vocabulary, L the layers of a stage, b x s the rows x length of one micro-batch, n = b * s its
tokens, e the bytes of an activation element (params_dtype).

**Trainer state** (`trainer_state`), exactly what Megatron-Core allocates (tested to the byte
on every rank of DP4, TP2 x DP2, PP2 x DP2 and TP2 x PP2): the stage's parameters in
params_dtype; DDP's fp32 gradient buffer; the optimizer's fp32 master copy (bf16 params only)
and Adam's two fp32 moments plus a 4-byte step counter per tensor. With the distributed
optimizer DDP also holds the parameters in one buffer; the buffer pads every parameter's start
to 64 elements and every bucket to a multiple of lcm(dp, 128), and each DP rank keeps the
optimizer state of its 1/dp of each bucket. For bf16 + Adam this is Megatron-LM's 18
bytes/param, or 6 + 12/dp with the distributed optimizer. A MoE model's experts (E / ep per
rank, each of width moe_ffn_hidden_size / expert_tp) have a DDP buffer of their own, sharded
over the expert-data-parallel ranks (exact on every rank at EP2, EP4 and PP2 x EP2).

**Activations** (`activation_bytes`): the bytes saved for backward by one micro-batch, per
layer and for the embedding / head, from the tensors each op keeps. spec "local" is Megatron's
local layer spec (the CPU path: scores and probabilities of [b, a, s, s] are kept; GQA's keys
and values are expanded to every head); it equals the sum of `saved_tensors_hooks` to the byte
at recompute none, selective and full (with the cw_grpo loss). spec "te" is the Transformer
Engine spec on GPU (fused attention keeps q, k, v, the output and the log-sum-exp, no s^2
term, and at tp > 1 sequence parallelism keeps the norms' tensors over s / tp of the
sequence); it is derived, not measured here. Qwen3's per-head q / k norms and a MoE layer's
routing, routed hidden states and experts' SwiGLU (`_qk_norm_bytes`, `_moe_bytes`) are exact on
the local spec too, at EP1 and, with each layer's received tokens, EP2; the routed tokens on a
rank at EP > 1 are an input (`Experts.imbalance`). Recompute: selective keeps the inputs of core
attention instead of its internals; full keeps each chunk's input hidden state [s, b, h] and
rebuilds one chunk at a time in backward. 1F1B keeps min(pp - stage, micro-batches)
micro-batches in flight on a stage.

**Placement.** Colocated (rollout.placement=colocated), the engines share the trainer's GPUs and
the phases below add vLLM's bytes. Separate (`Setting.engine_gpus_per_node` > 0), each node's
last engine_gpus_per_node GPUs hold only engines, one per rollout_tp of them: the trainer's
layout is planned on the other GPUs (`Setting.trainer_cluster`), its phases hold no vLLM
bytes, and `Plan.vllm` is an engine's share of its own GPU, which must hold its weights.

**vLLM** (`vllm_bytes`): vLLM reserves gpu_memory_utilization x the GPU's
total memory at start (`Cluster.gpu_gib` is that total); its weights (HF count, engine dtype, /
rollout TP) must fit in it, and what is left is KV cache (2 L kv_heads head_dim bytes per
token, / rollout TP). A KV cache smaller than the engine's sequences at max_model_len does not
fail: vLLM runs fewer at once (`VllmShare.concurrency`). The engines are placed as
rollout.replicas says (`Setting.engines`; auto: one per rollout.tp GPUs), each generating its
share of the step's sequences; an engine's GPU is the most-loaded one.

**Phases**, the step's timeline on an engine's GPU (docs/design.md, section 4), each with
RESERVE (CUDA context, NCCL, allocator fragmentation):

    rollout   state + reference + vLLM's whole reservation (weights, KV cache, workspace)
    old_logp  state + reference + vLLM asleep + one forward's working set (only where the step
              runs a forward-only pass: `algo.needs_policy_pass`, or a reference model)
    train     state + reference + vLLM asleep + activations in flight + backward working set
    wake      state + reference + vLLM asleep + its weights (woken for the sync; the KV
              cache wakes after it, when the trainer's activations are gone) + what the
              sync itself holds (`sync_bytes`)

vLLM asleep is SLEEP_RESIDUAL at rollout.sleep_level 1 or 2 (level 1 moves the weights to host
memory, level 2 drops them), its whole reservation at level 0. The run fits when the largest
phase is within capacity and vLLM's weights fit its reservation. `Plan.parts` holds each
phase's bytes by kind.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cwgrpo_megatron.algo import needs_policy_pass
from cwgrpo_megatron.comm.vocab_parallel import GPU_CHUNK_ELEMENTS
from cwgrpo_megatron.config import (
    OPTIMIZERS,
    PARAM_DTYPES,
    RECOMPUTE_GRANULARITIES,
    split_problem,
)
from cwgrpo_megatron.convert.arch import ModelArch, divisors, padded_vocab_size
from cwgrpo_megatron.rollout import engine_sleep_level
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync.senders import BUFFER_BYTES, TRANSFER_BUCKET_BYTES

GiB = 1 << 30
RECOMPUTE = RECOMPUTE_GRANULARITIES
SPECS = ("te", "local")
"""The layer spec a plan assumes (the config does not choose it: Transformer Engine's where it
is installed, Megatron's local one elsewhere); a planner input (`--spec`)."""
PHASES = ("rollout", "old_logp", "train", "wake")
"""A step's phases on an engine's GPU, in the order they come."""
DTYPE_BYTES = {name: getattr(torch, name).itemsize for name in PARAM_DTYPES}
"""Bytes per element of each train.params_dtype (and engine dtype)."""
RESERVE = 2 * GiB
"""Per GPU: CUDA context, NCCL buffers and allocator fragmentation (an estimate)."""
SLEEP_RESIDUAL = 1 * GiB
"""What a sleeping vLLM keeps per GPU (its CUDA graphs and context; an estimate)."""
VLLM_WORKSPACE = 1 * GiB
"""vLLM's activation workspace inside its reservation (it profiles one max-size batch)."""
IPC_BUFFER_BYTES = BUFFER_BYTES
"""The least size of each of vLLM's packed transfer buffers."""
NCCL_BUFFERS = 2
"""vLLM's packed NCCL broadcast alternates between two buffers (one filling, one in flight)."""
SYNC_BUCKET_BYTES = TRANSFER_BUCKET_BYTES
"""Shards in flight between nodes during a sync."""
LOSS_BYTES_PER_TOKEN = 36
"""What the policy loss keeps for backward per token (its [b, s] ratios, masks and KL terms):
measured for cw_grpo with the KL term; the other losses keep about as much."""
LOGPROB_CHUNK_ELEMENTS = GPU_CHUNK_ELEMENTS
"""comm.vocab_parallel's chunk on a GPU: two fp32 [chunk, V/tp] temporaries of this many
elements."""


# ---- parameters and Megatron's buffers -------------------------------------------------------


def stage_tensors(
    arch: ModelArch, *, tp: int, pp: int, stage: int, ep: int = 1, expert_tp: int = 1
) -> list[tuple[str, int]]:
    """(name, elements) of stage `stage`'s parameters on one TP rank (and, for a MoE model,
    one expert-parallel rank of ep, one expert-TP rank of expert_tp), in Megatron's
    named_parameters order (local spec; TE's fused norms hold the same elements). A MoE layer
    holds the router [E, h] and E / ep local experts, each a SwiGLU of width
    moe_ffn_hidden_size / expert_tp."""
    h, hd = arch.hidden_size, arch.head_dim
    if arch.is_moe:
        f = arch.moe_ffn_hidden_size // expert_tp
        mlp = [("mlp.router.weight", arch.num_experts * h)]
        for e in range(arch.num_experts // ep):
            expert = f"mlp.experts.local_experts.{e}"
            mlp += [
                (f"{expert}.linear_fc1.weight", 2 * f * h),
                (f"{expert}.linear_fc2.weight", h * f),
            ]
    else:
        mlp = [
            ("mlp.linear_fc1.weight", 2 * arch.ffn_hidden_size // tp * h),
            ("mlp.linear_fc2.weight", h * arch.ffn_hidden_size // tp),
        ]
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * hd // tp
    vocab = padded_vocab_size(arch.vocab_size, tp=tp) // tp
    out = []
    if stage == 0:
        out.append(("embedding.word_embeddings.weight", vocab * h))
    layer = [
        ("input_layernorm.weight", h),
        ("self_attention.linear_proj.weight", h * arch.num_heads * hd // tp),
        ("self_attention.linear_qkv.weight", qkv * h),
        *([("self_attention.linear_qkv.bias", qkv)] if arch.qkv_bias else []),
        *(
            [("self_attention.q_layernorm.weight", hd), ("self_attention.k_layernorm.weight", hd)]
            if arch.qk_layernorm
            else []
        ),
        ("pre_mlp_layernorm.weight", h),
        *mlp,
    ]
    for i in range(arch.num_layers // pp):
        out += [(f"decoder.layers.{i}.{name}", numel) for name, numel in layer]
    if stage == pp - 1:
        out.append(("decoder.final_layernorm.weight", h))
        if not (arch.tie_embeddings and pp == 1):
            out.append(("output_layer.weight", vocab * h))
    return out


def _shared_embedding(name: str, arch: ModelArch, pp: int) -> bool:
    """Megatron marks the tied embedding and its last-stage copy when they live apart."""
    tied_apart = arch.tie_embeddings and pp > 1
    return tied_apart and name in ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class GradBuffer:
    """DDP's flat buffer: total elements (padding included), buckets [start, end) and each
    parameter's [start, end)."""

    numel: int
    buckets: list[tuple[int, int]]
    params: list[tuple[int, int]]


def grad_buffer(
    tensors: list[tuple[str, int]], *, arch: ModelArch, pp: int, dp: int, distributed: bool
) -> GradBuffer:
    """Megatron-Core's `_ParamAndGradBuffer` layout with overlap_grad_reduce off (no size-based
    buckets): parameters in reverse order; with the distributed optimizer each parameter starts
    at a multiple of 64, a shared embedding gets a bucket of its own, and each bucket ends at a
    multiple of lcm(dp, 128)."""

    def pad(x: int, divisor: int) -> int:
        return -(-x // divisor) * divisor

    end_pad = math.lcm(dp, 128) if distributed else 1
    start_pad = 64 if distributed else 1
    buckets, params = [], []
    bucket_start = index = 0
    open_bucket = False
    for name, numel in reversed(tensors):
        index = pad(index, start_pad)
        shared = distributed and _shared_embedding(name, arch, pp)
        if shared and open_bucket:
            buckets.append((bucket_start, pad(index, end_pad)))
            bucket_start = index = buckets[-1][1]
        params.append((index, index + numel))
        index += numel
        open_bucket = True
        if shared:
            buckets.append((bucket_start, pad(index, end_pad)))
            bucket_start = index = buckets[-1][1]
            open_bucket = False
    if open_bucket:
        buckets.append((bucket_start, pad(index, end_pad)))
    return GradBuffer(numel=buckets[-1][1] if buckets else 0, buckets=buckets, params=params)


def _shard_pieces(buffer: GradBuffer, dp: int, rank: int) -> list[int]:
    """Elements of each parameter inside DP rank `rank`'s 1/dp of every bucket (non-empty)."""
    pieces = []
    for start, end in buffer.buckets:
        size = (end - start) // dp
        lo, hi = start + rank * size, start + (rank + 1) * size
        for p_start, p_end in buffer.params:
            overlap = min(hi, p_end) - max(lo, p_start)
            if overlap > 0:
                pieces.append(overlap)
    return pieces


@dataclass(frozen=True)
class TrainerState:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def trainer_state(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    dp: int,
    stage: int,
    params_dtype: str,
    optimizer: str = "adam",
    distributed: bool = False,
    dp_rank: int | None = None,
    ep: int = 1,
    expert_tp: int = 1,
    expert_dp_rank: int | None = None,
) -> TrainerState:
    """Bytes of parameters, gradient buffers and optimizer state on one rank of `stage`; with
    the distributed optimizer, on DP rank `dp_rank` (None: the most-loaded one). Every
    parameter is in `params_dtype` (`megatron.model.build_model` casts the local spec's norms),
    so DDP keeps one buffer for the dense parameters. A MoE model's experts have a buffer of
    their own, sharded over the expert-data-parallel size tp dp / (ep expert_tp) on expert-DP
    rank `expert_dp_rank`; with a rank left None each buffer's most-loaded rank is counted
    (for a MoE model an upper bound: the two may be different ranks)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
    tensors = stage_tensors(arch, tp=tp, pp=pp, stage=stage, ep=ep, expert_tp=expert_tp)
    groups = [([t for t in tensors if not _is_expert(t[0])], dp, dp_rank)]
    if arch.is_moe:
        groups.append(
            ([t for t in tensors if _is_expert(t[0])], tp * dp // (ep * expert_tp), expert_dp_rank)
        )
    moments = 8 if optimizer == "adam" else 0
    step_counter = 4 if optimizer == "adam" else 0
    master = 4 if params_dtype != "float32" else 0
    params = grads = optimizer_bytes = 0
    for group, size, rank in groups:
        buffer = grad_buffer(group, arch=arch, pp=pp, dp=size, distributed=distributed)
        grads += buffer.numel * 4
        used = buffer.numel if distributed else sum(n for _, n in group)
        params += used * DTYPE_BYTES[params_dtype]
        ranks = range(size) if (distributed and rank is None) else [rank or 0]
        optimizer_bytes += max(
            sum(pieces) * (master + moments) + len(pieces) * step_counter
            for pieces in (
                _shard_pieces(buffer, size, r) if distributed else [n for _, n in group]
                for r in ranks
            )
        )
    return TrainerState(params=params, grads=grads, optimizer=optimizer_bytes)


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def params_total(arch: ModelArch) -> int:
    """Parameters of the HF model (no vocabulary padding; a tied output counts once)."""
    tensors = stage_tensors(arch, tp=1, pp=1, stage=0)
    pad_rows = padded_vocab_size(arch.vocab_size, tp=1) - arch.vocab_size
    vocab_tensors = 1 if arch.tie_embeddings else 2
    return sum(n for _, n in tensors) - vocab_tensors * pad_rows * arch.hidden_size


def params_active(arch: ModelArch) -> int:
    """Parameters a token passes through: all of a dense model's; a MoE model's without the
    E - k experts per layer that it is not routed to."""
    idle = (arch.num_experts - arch.moe_topk) * 3 * arch.hidden_size * arch.moe_ffn_hidden_size
    return params_total(arch) - arch.num_layers * idle


# ---- activations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch on one stage."""

    saved: int
    """Kept for backward after its forward (what `saved_tensors_hooks` sees)."""
    working: int
    """Transient on top of the saved bytes during backward: the head's logits gradient and
    chunk buffers, one layer's gradients and, with full recompute, one rebuilt chunk."""
    forward_working: int
    """Transient during a forward-only pass (old-logp, reference): one layer and the head."""


@dataclass(frozen=True)
class Experts:
    """Where a MoE layer's tokens go on one rank: `ep` expert-parallel ranks, each expert split
    over `expert_tp` ranks, and `imbalance` >= 1, the tokens that reach this rank's experts over
    the n k / tp x expert_tp of perfectly even routing (1 at ep = 1, where every routed token
    stays on the rank)."""

    ep: int = 1
    expert_tp: int = 1
    imbalance: float = 1.0

    def tokens(self, arch: ModelArch, *, n: int, tp: int) -> int:
        """Routed tokens this rank's experts compute: the layer's n / tp tokens (sequence
        parallelism at tp > 1) times top k, gathered over expert_tp ranks."""
        even = n // tp * arch.moe_topk * self.expert_tp
        # rounded first, so that imbalance = r / even gives r back exactly
        return even if self.ep == 1 else math.ceil(round(self.imbalance * even, 6))


def _qk_norm_bytes(arch: ModelArch, *, tp: int, n: int, dtype: str, recompute: str, spec: str):
    """Qwen3's RMSNorm over each head of q and k (a = heads / tp and kv heads / tp of width
    head_dim). Local spec: each keeps its input in fp32, its rstd and x * rstd in fp32; in
    fp32 k's input is a view of the qkv output, which the layer keeps then in whole unless
    selective recompute keeps it anyway. TE (derived): the input and fp32 rstd."""
    if not arch.qk_layernorm:
        return 0
    e = DTYPE_BYTES[dtype]
    a, kv_heads = arch.num_heads // tp, max(1, arch.num_kv_heads // tp)
    q, kv = a * arch.head_dim, kv_heads * arch.head_dim
    if spec == "te":
        return n * (q + kv) * e + 4 * n * (a + kv_heads)
    k_input = n * kv * 4
    if e == 4:
        k_input = 0 if recompute == "selective" else n * (q + 2 * kv) * 4
    return 8 * n * q + 4 * n * a + k_input + 4 * n * kv + 4 * n * kv_heads


def _moe_bytes(arch: ModelArch, experts: Experts, *, tp: int, n: int, dtype: str, spec: str):
    """A MoE layer's MLP: routing on the layer's n / tp tokens (fp32 top-k indices as int64 and
    probabilities, the dispatcher's [E, n] routing map and probabilities, its int64 sort order
    of the n k routed copies: 5 E + 20 k bytes a token), and for each of the r routed tokens
    that reach this rank's experts (`Experts.tokens`) its hidden state, its fp32 routing
    probability and the SwiGLU's tensors of width f = moe_ffn_hidden_size / expert_tp. Local
    spec (`SequentialMLP`, measured): r (h e + 6 f e + 4); TE's grouped GEMM (derived, as the
    dense MLP's fused SwiGLU): r (h e + 3 f e + 4)."""
    e = DTYPE_BYTES[dtype]
    source = n // tp
    routing = source * (5 * arch.num_experts + 20 * arch.moe_topk)
    r = experts.tokens(arch, n=n, tp=tp)
    f = arch.moe_ffn_hidden_size // experts.expert_tp
    swiglu = 3 if spec == "te" else 6
    return routing + r * (arch.hidden_size * e + swiglu * f * e + 4)


def layer_saved_bytes(
    arch: ModelArch,
    *,
    tp: int,
    b: int,
    s: int,
    dtype: str,
    recompute: str,
    spec: str,
    experts: Experts = Experts(),
) -> int:
    """Bytes one decoder layer keeps for backward (recompute none or selective)."""
    e, n = DTYPE_BYTES[dtype], b * s
    h, hd = arch.hidden_size, arch.head_dim
    a = arch.num_heads // tp
    q, kv = a * hd, max(1, arch.num_kv_heads // tp) * hd
    qk_norm = _qk_norm_bytes(arch, tp=tp, n=n, dtype=dtype, recompute=recompute, spec=spec)
    if arch.is_moe:
        mlp = _moe_bytes(arch, experts, tp=tp, n=n, dtype=dtype, spec=spec)
    elif spec == "te":
        mlp = 3 * n * arch.ffn_hidden_size // tp * e  # fc1 out (2f), swiglu out (f)
    else:
        mlp = 5 * n * arch.ffn_hidden_size // tp * e  # fc1 out (2f), silu in/out, gate product
    if spec == "te":
        # TE: LayerNormLinear keeps x, its normalised copy and fp32 rstd, for both norms (a MoE
        # layer's TENorm keeps x and rstd, its router the normalised copy); at tp > 1 the
        # trainer turns sequence parallelism on (`megatron.model.fusion_settings`), so each
        # holds s / tp of the sequence (TE gathers the normalised copy again in backward)
        norms = 2 * (2 * n * h * e + 4 * n) // tp
        attn = (2 * q + 2 * kv) * n * e + 4 * a * n  # q, out, k, v; fp32 log-sum-exp
        attn += q * n * e  # linear_proj's input
        return norms + attn + qk_norm + mlp
    # local spec: RMSNorm keeps x and x*rstd in fp32, rstd, and its output for the linear
    # (the dense fc1, or a MoE layer's router)
    norms = 2 * (2 * n * h * 4 + n * h * e + 4 * n)
    rope = 4 * s * hd * e  # cos and sin for q and for k
    if recompute == "selective":
        # core attention rebuilt: kept are q, k after RoPE and v, a view of the qkv output
        attn = (q + kv) * n * e + (q + 2 * kv) * n * e + 4
    else:
        probs = b * a * s * s * (4 + (e if e != 4 else 0))  # fp32 softmax, its cast
        attn = 3 * q * n * e + probs + s * s  # q, GQA-expanded k and v; causal mask
    context = q * n * e
    return norms + rope + attn + qk_norm + context + mlp


def activation_bytes(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    stage: int,
    b: int,
    s: int,
    dtype: str,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    spec: str = "te",
    loss: bool = True,
    experts: Experts = Experts(),
) -> Activations:
    """One micro-batch `[b, s]` on `stage`; full recompute in chunks of `recompute_num_layers`
    (uniform) or of the first `recompute_num_layers` layers (block). A MoE layer's token
    dispatcher adds, while the layer runs, its send and receive buffers of the r routed hidden
    states ([r, h] each, derived: the all-to-all's; at ep = 1 the permuted copy)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}; choose one of: {', '.join(SPECS)}")
    e, n = DTYPE_BYTES[dtype], b * s
    h, layers = arch.hidden_size, arch.num_layers // pp
    vocab = padded_vocab_size(arch.vocab_size, tp=tp) // tp
    one_layer = layer_saved_bytes(
        arch, tp=tp, b=b, s=s, dtype=dtype, recompute="none", spec=spec, experts=experts
    )
    dispatch = 2 * experts.tokens(arch, n=n, tp=tp) * h * e if arch.is_moe else 0
    if recompute == "full" and recompute_method == "uniform":
        chunks = -(-layers // recompute_num_layers)
        saved = chunks * n * h * e + s * arch.head_dim * 4  # chunk inputs, fp32 rotary freqs
    elif recompute == "full":  # block: the first recompute_num_layers layers keep their input
        kept = min(recompute_num_layers, layers)
        saved = kept * n * h * e + (layers - kept) * one_layer + s * arch.head_dim * 4
    else:
        saved = layers * layer_saved_bytes(
            arch, tp=tp, b=b, s=s, dtype=dtype, recompute=recompute, spec=spec, experts=experts
        )
    head_working = forward_head = 0
    if stage == 0:
        saved += 8 * n  # token ids
    if stage == pp - 1:
        # the final norm keeps what a layer's norm keeps (TE: its input and output, and rstd,
        # over s / tp of the sequence)
        if spec == "te":
            saved += (2 * n * h * e + 4 * n) // tp
        else:
            saved += 2 * n * h * 4 + n * h * e + 4 * n
        saved += n * vocab * e  # logits [b, s, V/tp], kept by the log-prob function
        saved += n * (8 + 1 + 4 + 4)  # target ids, in-shard mask, log-normaliser, entropy
        if loss:
            saved += LOSS_BYTES_PER_TOKEN * n
        chunk = 2 * min(LOGPROB_CHUNK_ELEMENTS, n * vocab) * 4
        forward_head = n * vocab * e + chunk  # the [s, b, V/tp] output before its transpose
        head_working = n * vocab * e + chunk  # the logits gradient
    rebuilt = 0
    if recompute == "full":
        rebuilt = one_layer * (recompute_num_layers if recompute_method == "uniform" else 1)
    working = max(head_working, one_layer + rebuilt + dispatch)
    forward_working = max(forward_head + n * vocab * e, one_layer + dispatch)
    return Activations(saved=saved, working=working, forward_working=forward_working)


# ---- vLLM ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmShare:
    reserved: int
    """gpu_memory_utilization x capacity, held from engine start."""
    weights: int
    kv_needed: int
    """The KV cache for this engine's rollout sequences at max_model_len."""
    kv_available: int
    sleeping: int
    """What stays allocated while it sleeps (all of `reserved` at sleep level 0)."""

    @property
    def concurrency(self) -> float:
        """Share of the engine's sequences that fit in its KV cache at once (<= 1)."""
        return 1.0 if self.kv_needed <= 0 else min(1.0, self.kv_available / self.kv_needed)

    def parts(self, phase: str) -> dict[str, int]:
        """Its bytes on the GPU in `phase`, by kind."""
        if self.reserved == 0:
            return {}
        weights = min(self.weights, self.reserved)
        awake = {
            "engine weights": weights,
            "KV cache": self.kv_available,
            "engine other": self.reserved - weights - self.kv_available,
        }
        if phase == "rollout" or self.sleeping == self.reserved:
            return awake
        if phase == "wake":
            return {"engine weights": weights, "engine other": self.sleeping}
        return {"engine other": self.sleeping}


def vllm_bytes(
    arch: ModelArch,
    *,
    capacity: int,
    utilization: float,
    rollout_tp: int,
    sequences: int,
    max_model_len: int,
    dtype: str,
    sleep_level: int,
) -> VllmShare:
    """vLLM's share of one GPU: `sequences` are those of this GPU's engine."""
    e = DTYPE_BYTES[dtype]
    reserved = int(utilization * capacity)
    weights = params_total(arch) * e // rollout_tp
    kv_heads = max(1, arch.num_kv_heads // rollout_tp)  # vLLM replicates heads past tp = kv
    per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * e
    kv_needed = sequences * max_model_len * per_token
    kv_available = max(0, reserved - weights - VLLM_WORKSPACE)
    return VllmShare(
        reserved=reserved,
        weights=weights,
        kv_needed=kv_needed,
        kv_available=kv_available,
        sleeping=min(SLEEP_RESIDUAL, reserved) if sleep_level else reserved,
    )


def sync_bytes(arch: ModelArch, *, dtype: str, pp: int, nodes: int, separate: bool = False) -> int:
    """What the weight sync itself holds on a trainer GPU at its peak. vLLM's transfer (when
    every node holds every pipeline stage: one node, or pp = 1) packs the model into its
    buffers, each at least IPC_BUFFER_BYTES and the largest HF tensor, while the export
    materialises one tensor: one buffer for CUDA IPC (colocated), NCCL_BUFFERS on an engine's
    owner for NCCL (separate placement; the engine's GPU holds as many to receive into, outside
    vLLM's reservation). The shared-memory path keeps at most a bucket of shards in flight
    between nodes."""
    if pp == 1 or nodes == 1:
        e = DTYPE_BYTES[dtype]
        largest = arch.hidden_size * max(arch.vocab_size, arch.ffn_hidden_size) * e
        buffers = NCCL_BUFFERS if separate else 1
        return buffers * max(IPC_BUFFER_BYTES, largest) + largest
    return SYNC_BUCKET_BYTES


# ---- the plan --------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_gib: float = 80.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity(self) -> int:
        return int(self.gpu_gib * GiB)


@dataclass(kw_only=True, frozen=True)
class Setting:
    """What the plan reads from a run config, made only by `from_config`: the config's values
    under their own names, or resolved as the trainer resolves them on GPUs (seq_len,
    sleep_level, micro_batch_size from a token budget); no field has a default of its own but
    the planner's inputs, `spec` and `moe_imbalance` (the config chooses neither the layer spec
    nor the routing). The search varies tp, pp, ep (MoE), recompute and micro_batch_size
    (`dataclasses.replace`)."""

    tp: int
    pp: int
    ep: int
    expert_tp: int
    params_dtype: str
    optimizer: str
    distributed_optimizer: bool
    kl_beta: float
    policy_pass: bool
    """The step runs a forward-only pass of the policy (`algo.needs_policy_pass`)."""
    micro_batch_size: int
    """Rows of a micro-batch; from a token budget, the rows of the longest length it holds."""
    seq_len: int
    """Tokens of a padded row: max prompt + max completion tokens."""
    sequences_per_step: int
    group_size: int
    token_budget: bool
    """train.max_tokens_per_micro_batch is set: micro-batches of any row count."""
    rollout_sequences: int
    """Sequences of one generation round (`TrainConfig.prompts_per_round` x G: more than a
    step's with dynamic sampling)."""
    mini_batches: int
    recompute: str
    recompute_method: str
    recompute_num_layers: int
    spec: str = "te"
    moe_imbalance: float = 1.0
    """A MoE model's tokens on the busiest expert-parallel rank over an even share
    (`Experts.imbalance`): a planner input, as routing is the data's."""
    rollout_tp: int
    """The engine's tensor-parallel size (rollout.tp)."""
    replicas: int | str
    """rollout.replicas: auto (one engine per rollout_tp GPUs), per_node, or how many."""
    max_model_len: int
    utilization: float
    sleep_level: int
    """rollout.sleep_level as it resolves on GPUs (None there is 2)."""
    engine_dtype: str
    engine_gpus_per_node: int
    """0: colocated; else rollout.gpus_per_node of separate placement."""

    @property
    def experts(self) -> Experts:
        return Experts(ep=self.ep, expert_tp=self.expert_tp, imbalance=self.moe_imbalance)

    @property
    def phases(self) -> tuple[str, ...]:
        """PHASES of this step: old_logp only where it runs a forward-only pass."""
        passes = self.policy_pass or self.kl_beta > 0
        return tuple(p for p in PHASES if p != "old_logp" or passes)

    @property
    def colocated(self) -> bool:
        return self.engine_gpus_per_node == 0

    def trainer_cluster(self, cluster: Cluster) -> Cluster:
        """The GPUs the trainer's layout spans: all of them when colocated, else each node's
        GPUs but its engines'."""
        if self.colocated:
            return cluster
        left = cluster.gpus_per_node - self.engine_gpus_per_node
        if left < 1:
            raise ValueError(
                f"rollout.gpus_per_node={self.engine_gpus_per_node} leaves the trainer none of "
                f"a node's {cluster.gpus_per_node} GPUs: lower it"
            )
        return dataclasses.replace(cluster, gpus_per_node=left)

    def engines(self, cluster: Cluster) -> int:
        """How many engines the job runs: the trainer's own placement (`Replicas.place`) on
        the cluster's GPUs, with its errors for a split that cannot work."""
        per_node = self.trainer_cluster(cluster).gpus_per_node
        nodes = [node for node in range(cluster.nodes) for _ in range(per_node)]
        placed = Replicas.place(
            nodes,
            self.replicas,
            engine_tp=self.rollout_tp,
            cuda=True,
            engine_gpus=self.engine_gpus_per_node,
        )
        return len(placed.groups)

    @classmethod
    def from_config(cls, cfg, **changes) -> Setting:
        t, r = cfg.train, cfg.rollout
        seq_len = cfg.data.max_prompt_tokens + r.max_tokens
        # a token budget holds at worst budget // seq_len rows of the longest length
        mbs = t.micro_batch_size
        if t.max_tokens_per_micro_batch is not None:
            mbs = max(1, t.max_tokens_per_micro_batch // seq_len)
        values = dict(
            tp=cfg.parallel.tp,
            pp=cfg.parallel.pp,
            ep=cfg.parallel.ep,
            expert_tp=cfg.parallel.expert_tp,
            params_dtype=t.params_dtype,
            optimizer=cfg.optim.optimizer,
            distributed_optimizer=cfg.optim.use_distributed_optimizer,
            kl_beta=cfg.algo.kl_beta,
            policy_pass=needs_policy_pass(cfg.algo, t.ppo_mini_batches),
            micro_batch_size=mbs,
            seq_len=seq_len,
            sequences_per_step=t.sequences_per_step,
            group_size=t.group_size,
            token_budget=t.max_tokens_per_micro_batch is not None,
            rollout_sequences=t.prompts_per_round * t.group_size,
            mini_batches=t.ppo_mini_batches,
            recompute=t.recompute_granularity,
            recompute_method=t.recompute_method,
            recompute_num_layers=t.recompute_num_layers,
            max_model_len=r.max_model_len,
            utilization=r.gpu_memory_utilization,
            sleep_level=engine_sleep_level(r, cuda=True),
            engine_dtype=cfg.engine_dtype,
            rollout_tp=r.tp,
            replicas=r.replicas,
            engine_gpus_per_node=r.gpus_per_node if r.separate else 0,
        )
        values.update(changes)
        return cls(**values)


@dataclass(frozen=True)
class Plan:
    setting: Setting
    cluster: Cluster
    """The trainer's GPUs (`Setting.trainer_cluster`: all of them when colocated)."""
    dp: int
    micro_batches: int
    """Micro-batches per DP rank and mini-batch."""
    stage: int
    """The stage of the highest phase peak. Each byte figure is the largest over stages."""
    state: TrainerState
    ref_model: int
    activations: int
    """Saved bytes of the micro-batches in flight on that stage, plus the backward working set."""
    forward_working: int
    vllm: VllmShare
    engines: int
    """Engines in the job."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak bytes of each phase on its most-loaded stage."""
    phase_stage: dict[str, int] = field(default_factory=dict)
    """That stage, per phase."""
    parts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each phase's bytes by kind (parameters, gradients, optimizer, reference model,
    activations, engine weights, KV cache, engine other, sync buffers, reserve); they add up to
    `phases`."""

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def vllm_fits(self) -> bool:
        """vLLM's weights and workspace fit in its reservation (else it cannot start)."""
        v = self.vllm
        return v.reserved == 0 or v.weights + VLLM_WORKSPACE <= v.reserved

    @property
    def fits(self) -> bool:
        return self.peak <= self.cluster.capacity and self.vllm_fits

    def to_json(self, arch: ModelArch) -> dict:
        return {
            "params_total": params_total(arch),
            "params_active": params_active(arch),
            "layout": {
                "tp": self.setting.tp,
                "pp": self.setting.pp,
                "dp": self.dp,
                "ep": self.setting.ep,
                "expert_tp": self.setting.expert_tp,
            },
            "moe_imbalance": self.setting.moe_imbalance,
            "micro_batch_tokens": self.setting.micro_batch_size * self.setting.seq_len,
            "recompute": self.setting.recompute,
            "stage": self.stage,
            "per_gpu": {
                "params": self.state.params,
                "grads": self.state.grads,
                "optimizer": self.state.optimizer,
                "ref_model": self.ref_model,
                "activations": self.activations,
                "vllm": self.vllm.reserved if self.setting.colocated else 0,
                "peak": self.peak,
                "capacity": self.cluster.capacity,
                "fits": self.fits,
            },
            "vllm_fits": self.vllm_fits,
            "phases": dict(self.phases),
            "phase_stage": dict(self.phase_stage),
            "parts": {phase: dict(parts) for phase, parts in self.parts.items()},
            "rollout": {
                "tp": self.setting.rollout_tp,
                "engines_per_node": max(1, self.engines // self.cluster.nodes),
                "sleep_level": self.setting.sleep_level,
                "placement": "colocated" if self.setting.colocated else "separate",
                "engine_gpus_per_node": self.setting.engine_gpus_per_node,
            },
            "vllm": dataclasses.asdict(self.vllm) | {"concurrency": self.vllm.concurrency},
        }


def check_layout(arch: ModelArch, setting: Setting, cluster: Cluster) -> int:
    """The data-parallel size; ValueError naming valid values when the layout cannot work."""
    if setting.moe_imbalance < 1:
        raise ValueError(
            f"moe_imbalance={setting.moe_imbalance}: the busiest rank's tokens over an even "
            "share is at least 1 (1: perfectly even routing)"
        )
    setting.engines(cluster)  # a placement that cannot work fails here, as the trainer's would
    cluster = setting.trainer_cluster(cluster)
    tp, pp, ep, expert_tp = setting.tp, setting.pp, setting.ep, setting.expert_tp
    arch.check_layout(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    if arch.is_moe and tp > 1 and setting.spec == "local":
        raise ValueError(
            f"tp={tp} with a MoE model runs sequence parallelism, whose local-spec "
            "activations the planner does not count: plan it with spec te, or at tp=1 on the "
            "local spec"
        )
    if cluster.world % (tp * pp):
        raise ValueError(
            f"tp x pp = {tp * pp} does not divide the {cluster.world} GPUs "
            f"({cluster.nodes} x {cluster.gpus_per_node}); valid tp x pp: "
            + ", ".join(map(str, divisors(cluster.world)))
        )
    if tp > cluster.gpus_per_node:
        raise ValueError(
            f"tp={tp} spans nodes of {cluster.gpus_per_node} GPUs; keep tensor parallelism "
            f"inside a node (tp <= {cluster.gpus_per_node})"
        )
    if cluster.world % (expert_tp * ep * pp):
        raise ValueError(
            f"expert_tp x ep x pp = {expert_tp * ep * pp} does not divide the {cluster.world} "
            "GPUs: choose ep and expert_tp whose product with pp divides them"
        )
    dp = cluster.world // (tp * pp)
    problem = split_problem(
        setting.sequences_per_step // setting.group_size,
        dp=dp,
        group_size=setting.group_size,
        mini_batches=setting.mini_batches,
        micro_batch_size=None if setting.token_budget else setting.micro_batch_size,
    )
    if problem:
        raise ValueError(f"{problem} (the trainer refuses it: whole prompt groups per rank)")
    rtp = setting.rollout_tp
    if arch.num_kv_heads % rtp and rtp % arch.num_kv_heads:
        raise ValueError(
            f"rollout tp={rtp} and num_key_value_heads={arch.num_kv_heads}: "
            "one must divide the other"
        )
    return dp


class _Stage(NamedTuple):
    stage: int
    state: TrainerState
    ref_model: int
    activations: int
    forward_working: int
    phases: dict[str, int]
    parts: dict[str, dict[str, int]]


def plan(arch: ModelArch, setting: Setting, cluster: Cluster) -> Plan:
    """Bytes per GPU by phase for `setting` on `cluster`: each figure, and each phase's peak,
    on its most-loaded pipeline stage."""
    dp = check_layout(arch, setting, cluster)
    engines = setting.engines(cluster)
    cluster = setting.trainer_cluster(cluster)
    tp, pp = setting.tp, setting.pp
    rows = setting.sequences_per_step // setting.mini_batches // dp
    micro = rows // setting.micro_batch_size
    vllm = vllm_bytes(
        arch,
        capacity=cluster.capacity,
        utilization=setting.utilization,
        rollout_tp=setting.rollout_tp,
        sequences=-(-setting.rollout_sequences // engines),
        max_model_len=setting.max_model_len,
        dtype=setting.engine_dtype,
        sleep_level=setting.sleep_level,
    )
    stages = []
    for stage in range(pp):
        state = trainer_state(
            arch,
            tp=tp,
            pp=pp,
            dp=dp,
            stage=stage,
            params_dtype=setting.params_dtype,
            optimizer=setting.optimizer,
            distributed=setting.distributed_optimizer,
            ep=setting.ep,
            expert_tp=setting.expert_tp,
        )
        ref = 0
        if setting.kl_beta > 0:  # a frozen copy: parameters only, no DDP buffer
            ref = trainer_state(
                arch,
                tp=tp,
                pp=pp,
                dp=dp,
                stage=stage,
                params_dtype=setting.params_dtype,
                ep=setting.ep,
                expert_tp=setting.expert_tp,
            ).params
        act = activation_bytes(
            arch,
            tp=tp,
            pp=pp,
            stage=stage,
            b=setting.micro_batch_size,
            s=setting.seq_len,
            dtype=setting.params_dtype,
            recompute=setting.recompute,
            recompute_method=setting.recompute_method,
            recompute_num_layers=setting.recompute_num_layers,
            spec=setting.spec,
            experts=setting.experts,
        )
        train_act = min(pp - stage, micro) * act.saved + act.working
        resident = {
            "parameters": state.params,
            "gradients": state.grads,
            "optimizer": state.optimizer,
            "reference model": ref,
            "reserve": RESERVE,
        }
        activations = {"old_logp": act.forward_working, "train": train_act}
        beside = vllm.parts if setting.colocated else lambda phase: {}
        parts = {
            phase: resident | {"activations": activations.get(phase, 0)} | beside(phase)
            for phase in setting.phases
        }
        if vllm.reserved:
            parts["wake"]["sync buffers"] = sync_bytes(
                arch,
                dtype=setting.engine_dtype,
                pp=pp,
                nodes=cluster.nodes,
                separate=not setting.colocated,
            )
        phases = {phase: sum(kinds.values()) for phase, kinds in parts.items()}
        stages.append(_Stage(stage, state, ref, train_act, act.forward_working, phases, parts))
    # every figure is that of its own most-loaded stage (train: the first, by 1F1B's in-flight
    # micro-batches; rollout: the last, by the output layer)
    worst = {name: max(stages, key=lambda x: x.phases[name]) for name in stages[0].phases}
    return Plan(
        setting,
        cluster,
        dp,
        micro,
        stage=max(stages, key=lambda x: max(x.phases.values())).stage,
        state=TrainerState(
            params=max(x.state.params for x in stages),
            grads=max(x.state.grads for x in stages),
            optimizer=max(x.state.optimizer for x in stages),
        ),
        ref_model=max(x.ref_model for x in stages),
        activations=max(x.activations for x in stages),
        forward_working=max(x.forward_working for x in stages),
        vllm=vllm,
        engines=engines,
        phases={name: x.phases[name] for name, x in worst.items()},
        phase_stage={name: x.stage for name, x in worst.items()},
        parts={name: x.parts[name] for name, x in worst.items()},
    )


# ---- search ----------------------------------------------------------------------------------

PEAK_FLOPS = 989e12
"""bf16 dense peak of an H100 / H200 SXM; the ordering uses it with MFU."""
MFU = 0.4
NVLINK_BYTES_S = 150e9
NETWORK_BYTES_S = 25e9


def step_seconds(arch: ModelArch, p: Plan) -> float:
    """An ordering rule, not a prediction. Per GPU: 2 N flops per token per pass (N the active
    parameters, `params_active`), with forward + backward = 3 passes, one more for the
    forward-only pass of the policy (`Setting.policy_pass`), one for the reference (kl_beta >
    0), one for full recompute and 0.1 for selective, at MFU x peak scaled by the micro-batch's
    GEMM efficiency n / (n + 1024); times the 1F1B bubble 1 + (pp - 1) / m; plus
    TP all-reduces (4 per layer of [n, h] bf16, ring, NVLink) and the DP gradient all-reduce
    (fp32, over the network when DP spans nodes); a MoE model's token all-to-alls (4 per layer
    of the [n k, h] routed states in bf16, times the imbalance, over NVLink while ep x tp fits
    a node)."""
    s = p.setting
    tokens = s.sequences_per_step * s.seq_len
    passes = 3 + (1 if s.policy_pass else 0) + (1 if s.kl_beta > 0 else 0)
    passes += {"none": 0.0, "selective": 0.1, "full": 1.0}[s.recompute]
    n = s.micro_batch_size * s.seq_len
    efficiency = n / (n + 1024)
    flops = 2 * params_active(arch) * tokens * passes / p.cluster.world
    compute = flops / (PEAK_FLOPS * MFU * efficiency)
    compute *= 1 + (s.pp - 1) / p.micro_batches
    tp_bytes = 4 * arch.num_layers * tokens / p.dp * arch.hidden_size * 2 * 2 * (s.tp - 1) / s.tp
    tp_comm = tp_bytes / NVLINK_BYTES_S / s.pp
    dp_bytes = 2 * (p.dp - 1) / p.dp * p.state.grads
    cross_node = p.dp * s.tp * s.pp > p.cluster.gpus_per_node
    dp_comm = dp_bytes / (NETWORK_BYTES_S if cross_node else NVLINK_BYTES_S)
    ep_comm = 0.0
    if arch.is_moe and s.ep > 1:
        routed = tokens / p.dp * arch.moe_topk * s.moe_imbalance
        ep_bytes = 4 * arch.num_layers * routed * arch.hidden_size * 2 * (s.ep - 1) / s.ep
        within = s.ep * s.tp <= p.cluster.gpus_per_node
        ep_comm = ep_bytes / (NVLINK_BYTES_S if within else NETWORK_BYTES_S) / s.pp
    return compute + tp_comm + dp_comm + ep_comm


def search(
    arch: ModelArch,
    base: Setting,
    cluster: Cluster,
    *,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
) -> list[tuple[float, Plan]]:
    """Every (tp, pp, ep, micro_batch_size, recompute) whose plan fits, fastest first by
    `step_seconds`; ep over the divisors of a MoE model's experts (base's expert_tp). tp stays
    inside a node; vLLM's layout is `base`'s."""
    found, trainer = [], base.trainer_cluster(cluster)
    eps = divisors(arch.num_experts) if arch.is_moe else [1]
    for tp, pp, ep in itertools.product(
        range(1, trainer.gpus_per_node + 1), range(1, arch.num_layers + 1), eps
    ):
        if trainer.world % (tp * pp) or arch.num_layers % pp:
            continue
        for mbs, recompute in itertools.product(micro_batch_sizes, RECOMPUTE):
            setting = dataclasses.replace(
                base, tp=tp, pp=pp, ep=ep, micro_batch_size=mbs, recompute=recompute
            )
            try:
                p = plan(arch, setting, cluster)
            except ValueError:
                continue
            if p.fits:
                found.append((step_seconds(arch, p), p))
    found.sort(key=lambda item: item[0])
    return found
