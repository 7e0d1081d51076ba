"""The CW-GRPO training loop (DESIGN section 4): one call per phase, into the package that owns it.

Step k (1-based), on every rank of the job (steps 1-3 are `components.rollouts.Rollouts`,
step 10 is `components.sync.WeightSync`):

    1. prompts     the sampler draws a round's prompts (the same on every rank); each engine
                   replica's owner takes its share (`rollout.replicas.Replicas.share`)
    2. rollouts    G completions per prompt from the owner's engine; prompt j of round r is
                   sampled with `rollout_seed(train.seed, k, r * R + j)`, whatever the layout,
                   the number of replicas or the history
    3. rewards     each owner scores its own groups in its worker pool, so each completion is
                   scored once in the whole job; one all-gather then gives every rank the round.
                   Steps 1-3 repeat while dynamic sampling (`data.dynamic_sampling`) lacks
                   groups with a reward signal; then the engines sleep (rollout.sleep_level)
                   while the trainer works. With rollout.async_steps = 1, steps 1-3 of step
                   k+1 run in the background during steps 4-9 of step k, with the weights
                   after step k-1 (policy lag 1), and are gathered before step 10
    4. advantages  per group, and the TrainBatch (identical on every rank)
    5-9.           `train_step`: micro-batches, forward-only pass, scope statistics, 1F1B
                   training pass, optimizer step, metrics reduced once (before it, with
                   run.probe_groups, the policy's entropy on a fixed probe set)
    10. sync       the engines' weights wake, the trainer's weights go into every
                   replica's engine, then their KV caches wake; every run.verify_sync steps
                   each engine is checked
    then the metrics line, evaluation and checkpoint, each when due.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cwgrpo_megatron.algo.advantages import get_advantage_estimator
from cwgrpo_megatron.comm import fail_together
from cwgrpo_megatron.comm.collectives import Group
from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.common.plugins import load_plugins
from cwgrpo_megatron.common.timing import PhaseTimer
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.data.batching import TrainBatch, batch_from_rollouts
from cwgrpo_megatron.data.prompts import PromptSampler
from cwgrpo_megatron.eval.metrics import summary_keys
from cwgrpo_megatron.eval.runner import write_json
from cwgrpo_megatron.megatron import train_checkpoint
from cwgrpo_megatron.megatron.conversion import export_hf
from cwgrpo_megatron.megatron.train_step import probe_entropy, train_step
from cwgrpo_megatron.rollout.base import SamplingConfig
from cwgrpo_megatron.run.run_dir import write_samples
from cwgrpo_megatron.run.step_metrics import (
    actor_metrics,
    cov_histogram,
    rollout_metrics,
    step_tokens,
    timing_metrics,
)

if TYPE_CHECKING:
    from cwgrpo_megatron.components.inputs import Inputs
    from cwgrpo_megatron.components.rollouts import Rollouts, StepRollouts
    from cwgrpo_megatron.components.sync import WeightSync
    from cwgrpo_megatron.megatron.train_step import Actor
    from cwgrpo_megatron.reward.scoring import ScoredGroup
    from cwgrpo_megatron.run.run_dir import RunDir
    from cwgrpo_megatron.run.tracking import Tracker


@dataclass
class LoopState:
    """What a resumed run needs besides the actor's checkpoint (model, optimizer, LR schedule,
    every rank's RNG): the steps done, the prompt sampler's position after the last round drawn,
    and the next step's rollouts when they were made ahead (rollout.async_steps = 1). Rollout
    seeds are a function of (train.seed, step, round, prompt), so nothing of the engine's
    history is needed."""

    step: int
    sampler: PromptSampler
    ahead: StepRollouts | None = None
    """Step `step + 1`'s scored groups, made during step `step` (token ids, sampling
    log-probs, rewards: small beside the model)."""
    probe: TrainBatch | None = None
    """The fixed probe sequences (run.probe_groups of step 1's groups), once step 1 made them."""

    def state_dict(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict()}

    def objects(self) -> dict:
        """What the checkpoint keeps beside `state_dict` (`train_checkpoint.save`'s
        data_objects)."""
        kept = {"ahead": self.ahead, "probe": self.probe}
        return {name: value for name, value in kept.items() if value is not None}

    def load_state_dict(self, state: dict, objects: dict | None = None) -> None:
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.ahead = (objects or {}).get("ahead")
        self.probe = (objects or {}).get("probe")


@dataclass(kw_only=True)
class Trainer:
    """The parts of a run (built by `build.build_trainer`). Rank-specific ones are None where a
    rank has no use for them: an engine, a reward and the evaluation benchmarks on each
    replica's owner (`rollouts.engine`, `rollouts.reward`, `inputs.benchmarks`)."""

    cfg: Config
    inputs: Inputs
    actor: Actor
    rollouts: Rollouts
    sync: WeightSync
    run: RunDir
    state: LoopState
    tracker: Tracker
    control: Group
    """The job's control group (`comm.open_control_group`): its agreements go over it."""
    resources: contextlib.ExitStack
    """The releases of what the parts hold, registered as `build_trainer` built them."""

    def fit(self) -> None:
        if self.cfg.run.eval_at_start and self.cfg.eval.benchmarks and self.state.step == 0:
            self.evaluate_before_training()
        while self.state.step < self.cfg.train.total_steps:
            self.train_one_step()
        if self.cfg.run.export_hf == "at_end":
            self.export()

    def train_one_step(self) -> dict[str, float]:
        """Step `state.step + 1`, phase by phase (the module docstring); its metrics line."""
        cfg, timer, step = self.cfg, PhaseTimer(), self.state.step + 1
        with timer("step"):
            self.rollouts.at_step(step)
            made = self.state.ahead or self.rollouts.collect(step)
            ahead = None
            if cfg.rollout.async_steps and step < cfg.train.total_steps:
                ahead = self.rollouts.start(step + 1)
            with timer("sleep"):
                self.rollouts.sleep()
            scored = made.scored
            batch = self.advantages(scored)
            probed = self.probe(scored, timer)
            results = train_step(self.actor, batch, timer=timer)
            with timer("rollout_wait"):  # the background generation's part not hidden
                self.state.ahead = ahead.finish() if ahead else None
            model, engine = self.actor.model, self.rollouts.engine
            with timer("wake"):
                self.rollouts.wake("weights")
            with timer("sync"):
                pushed = self.sync.push(model, engine)
            with timer("wake"):
                self.rollouts.wake("kv_cache")
            with timer("sync"):
                checked = self.sync.check(model, engine, step=step)
            metrics = {**rollout_metrics(scored), **made.metrics, **actor_metrics(results)}
            metrics.update({"rollout/policy_lag": float(made.lag(step)), **probed, **pushed})
            metrics.update(checked)
            self.write_samples(step, scored)
            if _due(step, cfg.run.eval_every, cfg.train.total_steps) and self.cfg.eval.benchmarks:
                with timer("eval"):
                    metrics.update(self.evaluate(step))
            self.state.step = step
            if _due(step, cfg.run.save_every, cfg.train.total_steps, always_last=True):
                with timer("checkpoint"):  # the checkpoint's line: the step's times so far
                    self.save({"step": step, **metrics, **_timings(made, timer)})
        metrics.update(_timings(made, timer))
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

    def advantages(self, scored: list[ScoredGroup]) -> TrainBatch:
        """Step 4: each group's advantages from its rewards, and the step's TrainBatch: the same on
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

    def probe(self, scored: list[ScoredGroup], timer: PhaseTimer) -> dict[str, float]:
        """Before the update: probe/entropy on the fixed probe set, which step 1 takes from its
        first run.probe_groups groups ({} when run.probe_groups = 0)."""
        if not self.cfg.run.probe_groups:
            return {}
        with timer("probe"):
            if self.state.probe is None:
                self.state.probe = self.advantages(scored[: self.cfg.run.probe_groups])
            return {"probe/entropy": probe_entropy(self.actor, self.state.probe)}

    def evaluate(self, step: int) -> dict[str, float]:
        """The benchmarks on every engine (`Rollouts.evaluate`); rank 0 writes
        eval/step_N.json and returns the metrics ({} elsewhere)."""
        e, metrics = self.cfg.eval, {}
        sampling = SamplingConfig(
            temperature=e.temperature,
            top_p=e.top_p,
            max_tokens=e.max_tokens or self.cfg.rollout.max_tokens,
            seed=e.seed,
        )
        result = self.rollouts.evaluate(self.inputs.benchmarks, n=e.n, sampling=sampling)
        with fail_together("writing the evaluation", self.control):
            if result is not None:
                write_json(result, self.run.eval(step))
                for bench, summary in result["summary"].items():
                    for key in summary_keys(e.n):
                        metrics[f"eval/{bench}/{key}"] = summary[key]
        return metrics

    def save(self, line: dict) -> None:
        plugins = [record.to_json() for record in load_plugins(self.cfg.run.plugins)]
        data_state = {"loop": self.state.state_dict(), "metrics": line, "plugins": plugins}
        train_checkpoint.save(
            self.actor,
            self.run.checkpoints,
            data_state=data_state,
            keep_last=self.cfg.run.keep_last,
            config=dataclasses.asdict(self.cfg),
            side_files_from=self.cfg.model.path,
            data_objects=self.state.objects(),
        )
        if self.cfg.run.export_hf == "on_save":
            self.export()

    def export(self) -> None:
        export_hf(
            self.actor.model,
            self.inputs.arch,
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
                "prompt": self.inputs.tokenizer.decode(g.prompt_ids, skip_special_tokens=False),
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


def _timings(made: StepRollouts, timer: PhaseTimer) -> dict[str, float]:
    """The step's timing_s/* and perf/* metrics: the rollouts' phases as their owners timed
    them (the slowest owner; in its background thread when made ahead), the rest as this
    rank's timer did."""
    seconds = {**made.seconds, **timer.seconds}
    return timing_metrics(seconds, tokens=step_tokens(made.scored))


def _due(step: int, every: int, last: int, *, always_last: bool = False) -> bool:
    """Every `every` steps (0: never), and at the last step when `every` > 0 or always_last."""
    if step == last:
        return always_last or every > 0
    return every > 0 and step % every == 0
