"""The CW-GRPO training loop (DESIGN section 4): one call per phase, into the package that owns it.

Step k (1-based), on every rank of the job:

    1. prompts     the sampler draws the step's P prompts (the same on every rank); each
                   engine replica's owner takes its share (`rollout.replicas.Replicas.share`)
    2. rollouts    G completions per prompt from the owner's engine; prompt j of step k is
                   sampled with `rollout_seed(train.seed, k, j)`, whatever the layout, the
                   number of replicas or the history
    3. rewards     each owner scores its own groups in its worker pool, so each completion is
                   scored once in the whole job; one all-gather then gives every rank the step
    4. advantages  per group, and the TrainBatch (identical on every rank)
    5-9.           `train_step`: micro-batches, forward-only pass, scope statistics, 1F1B
                   training pass, optimizer step, metrics reduced once
    10. sync       the weights go into every replica's engine; every run.verify_sync steps
                   each engine is checked
    then the metrics line, evaluation and checkpoint, each when due.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from cwgrpo_megatron.algo.advantages import get_advantage_estimator
from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.common.timing import PhaseTimer
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.data.batching import TrainBatch, batch_from_rollouts
from cwgrpo_megatron.data.prompts import PromptSampler
from cwgrpo_megatron.dist import all_gather_or_fail, fail_together, world_group
from cwgrpo_megatron.eval.runner import evaluate, write_json
from cwgrpo_megatron.megatron import train_checkpoint
from cwgrpo_megatron.megatron.conversion import export_hf
from cwgrpo_megatron.megatron.publish import sync_weights
from cwgrpo_megatron.megatron.train_step import train_step
from cwgrpo_megatron.reward.scoring import score_groups
from cwgrpo_megatron.rollout import sampling_config
from cwgrpo_megatron.rollout.base import SamplingConfig, rollout_seed
from cwgrpo_megatron.run.run_dir import write_samples
from cwgrpo_megatron.run.step_metrics import (
    actor_metrics,
    cov_histogram,
    rollout_metrics,
    step_tokens,
    timing_metrics,
)

if TYPE_CHECKING:
    from cwgrpo_megatron.checks.sync_check import SyncVerifier
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.data.prompt_set import PromptSet
    from cwgrpo_megatron.data.prompts import Problem, PromptFormat
    from cwgrpo_megatron.megatron.train_step import Actor
    from cwgrpo_megatron.reward import WeightedReward
    from cwgrpo_megatron.rollout.base import RolloutEngine
    from cwgrpo_megatron.rollout.replicas import Replicas
    from cwgrpo_megatron.run.run_dir import RunDir
    from cwgrpo_megatron.run.tracking import Tracker
    from cwgrpo_megatron.weight_sync.plan import SyncPlan


@dataclass
class LoopState:
    """What a resumed run needs besides the actor's checkpoint (model, optimizer, LR schedule,
    every rank's RNG): the steps done and the prompt sampler's position. Rollout seeds are a
    function of (train.seed, step, prompt), so nothing of the engine's history is needed."""

    step: int
    sampler: PromptSampler

    def state_dict(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])


class StepPrompts(NamedTuple):
    """This rank's share of a step's prompts: positions in the step, problems, prompt token ids
    and sampling seeds (all empty on ranks that own no engine)."""

    positions: list[int]
    problems: list[Problem]
    token_ids: list[list[int]]
    seeds: list[int]


@dataclass(kw_only=True)
class Trainer:
    """The parts of a run (built by `build.build_trainer`); rank-specific ones are None where a
    rank has no use for them: an engine and a reward on each replica's owner, the evaluation
    benchmarks on rank 0 (which owns the first replica)."""

    cfg: Config
    actor: Actor
    arch: ModelArch
    engine: RolloutEngine | None
    replicas: Replicas
    sync_plan: SyncPlan
    reward: WeightedReward | None
    tokenizer: object
    prompt_format: PromptFormat
    train_set: PromptSet
    benchmarks: dict[str, list[Problem]] | None
    run: RunDir
    state: LoopState
    tracker: Tracker
    verifier: SyncVerifier | None
    resources: contextlib.ExitStack
    """The releases of what the parts hold, registered as `build_trainer` built them."""

    def fit(self) -> None:
        if self.cfg.run.eval_at_start and self.cfg.eval.benchmarks and self.state.step == 0:
            self.evaluate_before_training()
        while self.state.step < self.cfg.rollout_steps:
            self.train_one_step()
        if self.cfg.run.export_hf == "at_end":
            self.export()

    def train_one_step(self) -> dict[str, float]:
        """Step `state.step + 1`, phase by phase (the module docstring); its metrics line."""
        cfg, timer, step = self.cfg, PhaseTimer(), self.state.step + 1
        with timer("step"):
            prompts = self.draw_prompts(step)
            with timer("rollout"):
                groups = self.generate(prompts)
            with timer("reward"):
                scored = self.score(prompts, groups)
            batch = self.advantages(scored)
            results = train_step(self.actor, batch, timer=timer)
            with timer("sync"):
                checked = self.sync(step)
            metrics = {**rollout_metrics(scored), **actor_metrics(results), **checked}
            self.write_samples(step, scored)
            if _due(step, cfg.run.eval_every, cfg.rollout_steps) and self.cfg.eval.benchmarks:
                with timer("eval"):
                    metrics.update(self.evaluate(step))
            self.state.step = step
            if _due(step, cfg.run.save_every, cfg.rollout_steps, always_last=True):
                with timer("checkpoint"):
                    partial = timing_metrics(timer.seconds, tokens=step_tokens(scored))
                    self.save({"step": step, **metrics, **partial})
        metrics.update(timing_metrics(timer.seconds, tokens=step_tokens(scored)))
        self.tracker.log(step, metrics, histograms={"cw/cov": cov_histogram(results)})
        return metrics

    def evaluate_before_training(self) -> None:
        """The benchmarks once before step 1: a metrics line with step 0."""
        timer = PhaseTimer()
        with timer("eval"):
            metrics = self.evaluate(0)
        self.tracker.log(0, {**metrics, "timing_s/eval": timer.seconds["eval"]}, advance=False)

    def summary(self) -> list[str]:
        """The run's closing lines (rank 0; none elsewhere), also written to summary.txt."""
        lines = self.tracker.summary()
        if lines:
            write_atomic(self.run.summary, "\n".join(lines) + "\n")
        return lines

    # ---- the phases ----------------------------------------------------------------------

    def draw_prompts(self, step: int) -> StepPrompts:
        """The step's prompts that this rank's engine samples (every rank advances the sampler
        alike); none on ranks without an engine."""
        t = self.cfg.train
        indices = self.state.sampler.next_indices(t.prompts_per_step)
        replica = self.replicas.owned_by(dist.get_rank())
        positions = []
        if replica is not None:
            positions = list(self.replicas.share(replica, t.prompts_per_step))
        return StepPrompts(
            positions=positions,
            problems=[self.train_set.problems[indices[j]] for j in positions],
            token_ids=[self.train_set.token_ids[indices[j]] for j in positions],
            seeds=[rollout_seed(t.seed, step, j, t.group_size) for j in positions],
        )

    def generate(self, prompts: StepPrompts) -> list:
        """G completions of each of this rank's prompts from its engine; every rank learns of
        a failure on any replica (one all_gather_object of a status), so none waits for a
        replica whose engine is gone."""
        with fail_together("generating the rollouts", world_group()):
            if not prompts.positions:
                return []
            n = self.cfg.train.group_size
            sampling = sampling_config(self.cfg.rollout, temperature=self.cfg.train.temperature)
            return self.engine.generate(prompts.token_ids, n, sampling, seeds=prompts.seeds)

    def score(self, prompts: StepPrompts, groups) -> list:
        """Each owner scores its groups; one all-gather assembles the step's `ScoredGroup`s on
        every rank, in prompt order."""

        def mine():
            if self.reward is None:
                return []
            return score_groups(
                prompts.positions,
                prompts.problems,
                groups,
                tokenizer=self.tokenizer,
                reward=self.reward,
            )

        pieces = all_gather_or_fail(mine, "scoring the rollouts", world_group())
        return sorted((g for piece in pieces for g in piece), key=lambda g: g.position)

    def advantages(self, scored) -> TrainBatch:
        """Each group's advantages from its rewards, and the step's TrainBatch: the same on
        every rank, which `train_step` splits over data-parallel ranks and micro-batches."""
        a = self.cfg.algo
        return batch_from_rollouts(
            scored,
            torch.tensor([g.rewards for g in scored]),
            mask_truncated=self.cfg.train.mask_truncated,
            estimator=get_advantage_estimator(a.advantage_estimator),
            std_normalize=a.adv_std_normalize,
            adv_eps=a.adv_eps,
        )

    def sync(self, step: int) -> dict[str, float]:
        """Weights into every engine: the most MiB a node received from the others; when the
        check is due, the worst engine's gap and the tolerance."""
        done = sync_weights(
            self.actor.model, self.arch, self.engine, dtype=self.cfg.engine_dtype,
            plan=self.sync_plan,
        )  # fmt: skip
        metrics = {"sync/received_mb": max(done.received.values()) / 2**20}
        every = self.cfg.run.verify_sync
        if not every or step % every:
            return metrics
        gap, tol = self.verifier.check(self.actor.model, self.arch, self.engine), self.verifier.tol
        return {**metrics, "sync/gap": gap.max, "sync/tol": tol.max, "sync/gap_mean": gap.mean,
                "sync/tol_mean": tol.mean}  # fmt: skip

    def evaluate(self, step: int) -> dict[str, float]:
        """Benchmarks through rank 0's engine (the other ranks wait for its verdict)."""
        e, metrics = self.cfg.eval, {}
        with fail_together("evaluation", world_group()):
            if self.benchmarks is not None:
                sampling = SamplingConfig(
                    temperature=e.temperature,
                    top_p=e.top_p,
                    max_tokens=e.max_tokens or self.cfg.rollout.max_tokens,
                    seed=e.seed,
                )
                result = evaluate(
                    self.engine,
                    self.tokenizer,
                    self.benchmarks,
                    n=e.n,
                    sampling=sampling,
                    prompt_format=self.prompt_format,
                    reward=self.reward.verifier,
                    progress=False,
                )
                write_json(result, self.run.eval(step))
                for bench, summary in result["summary"].items():
                    for key in (f"avg@{e.n}", f"pass@{e.n}"):
                        metrics[f"eval/{bench}/{key}"] = summary[key]
        return metrics

    def save(self, line: dict) -> None:
        data_state = {"loop": self.state.state_dict(), "metrics": line}
        train_checkpoint.save(
            self.actor,
            self.run.checkpoints,
            data_state=data_state,
            keep_last=self.cfg.run.keep_last,
            config=dataclasses.asdict(self.cfg),
        )
        if self.cfg.run.export_hf == "on_save":
            self.export()

    def export(self) -> None:
        export_hf(
            self.actor.model,
            self.arch,
            self.run.hf,
            side_files_from=self.cfg.model.path,
            dtype=self.cfg.train.params_dtype,
        )

    def write_samples(self, step: int, scored) -> None:
        if not self.tracker.enabled:
            return
        records = [
            {
                "step": step,
                "position": g.position,
                "problem_id": g.problem_id,
                "prompt": self.tokenizer.decode(g.prompt_ids, skip_special_tokens=False),
                "answer": g.answer,
                "completion": text,
                "tokens": len(c.token_ids),
                "finish_reason": c.finish_reason,
                "reward": reward,
                "parts": {name: values[i] for name, values in g.parts.items()},
                "correct": g.correct[i],
            }
            for g in scored
            for i, (c, text, reward) in enumerate(
                zip(g.completions, g.texts, g.rewards, strict=True)
            )
        ]
        write_samples(self.run.samples(step, gzipped=self.cfg.run.samples_gzip), records)

    def close(self) -> None:
        """Release what the run holds, in the order `build_trainer` declared: sinks, reward
        workers, Megatron's groups, the engine."""
        self.resources.close()


def _due(step: int, every: int, last: int, *, always_last: bool = False) -> bool:
    """Every `every` steps (0: never), and at the last step when `every` > 0 or always_last."""
    if step == last:
        return always_last or every > 0
    return every > 0 and step % every == 0
