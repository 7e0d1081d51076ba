"""Steps 1-3 of a training step: the prompts, their rollouts and their rewards, in one or
more rounds (dynamic sampling); and the engines' memory around the trainer's phases (sleep
after the rollouts, wake for the sync).

    Rollouts = prompt sampler + engine replicas (where the engines live) + this rank's engine
               and reward worker pool (on each replica's owner; None elsewhere)

Prompt j of round r of step k is sampled with `rollout_seed(train.seed, k, r * R + j)` (R
prompts per round), whatever the layout, the number of replicas or the history, and each
completion is scored once in the whole job, by the owner of the replica that sampled it.

One routine makes a round (`make`: this rank's share generated and scored, no collective);
the one agreement and all-gather (`gather`) always run on the trainer's thread. A step's
rollouts come either now (`collect`: its rounds, each made and gathered at once), or ahead of
it (`start` during the previous step, `Ahead.finish` after it, with rollout.async_steps = 1):
the owners make their share in a background thread while the trainer's thread trains, and
the gather comes when the trainer's step is done. The engines run on devices of their own then
(rollout.placement=separate; on CPU `build` binds them and the trainer to their cores).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cwgrpo_megatron.comm import (
    all_gather_or_fail,
    fail_together,
    job_rank,
    node_of_each_rank,
    size_of,
    world_group,
)
from cwgrpo_megatron.comm.collectives import Group
from cwgrpo_megatron.components.inputs import Inputs
from cwgrpo_megatron.config import Config, TrainConfig
from cwgrpo_megatron.data.dynamic_sampling import StepRounds
from cwgrpo_megatron.data.prompts import Problem, PromptSampler
from cwgrpo_megatron.eval.runner import eval_requests, eval_result, sample_requests
from cwgrpo_megatron.megatron.conversion import export_hf, is_megatron_checkpoint
from cwgrpo_megatron.megatron.train_step import Actor
from cwgrpo_megatron.reward import WeightedReward, build_reward
from cwgrpo_megatron.reward.scoring import ScoredGroup, score_groups
from cwgrpo_megatron.rollout import (
    RolloutConfig,
    RolloutEngine,
    build_engine,
    engine_sleep_level,
    sampling_config,
)
from cwgrpo_megatron.rollout.base import SamplingConfig, rollout_seed
from cwgrpo_megatron.rollout.placement import bind_process, split_cores
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.rollout.trace import TracedEngine
from cwgrpo_megatron.run.run_dir import RunDir
from cwgrpo_megatron.weight_sync.senders import check_engine

log = logging.getLogger("cwgrpo_megatron.train")


class StepPrompts(NamedTuple):
    """This rank's share of a round's prompts: positions in the step (r * R + j), problems,
    prompt token ids and sampling seeds (all empty on ranks that own no engine)."""

    positions: list[int]
    problems: list[Problem]
    token_ids: list[list[int]]
    seeds: list[int]


@dataclass(kw_only=True)
class StepRollouts:
    """A step's scored groups (the same on every rank) and how they were made."""

    scored: list[ScoredGroup]
    policy_step: int
    """The trainer's steps done when they were sampled: the engines held the weights after it.
    Trained at step k, the policy lag is k - 1 - policy_step."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Their dynamic/* metrics (`StepRounds.metrics`)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Generation and scoring seconds ("rollout", "reward"): of the slowest owner when made
    ahead, in the background."""

    def lag(self, step: int) -> int:
        """Steps off the policy when trained at `step` (`rollout/policy_lag`)."""
        return step - 1 - self.policy_step


def sampled_after(step: int, *, lag: int) -> int:
    """The `policy_step` of step `step`'s rollouts made `lag` steps off the policy: 0 when made
    at the step itself, rollout.async_steps when made ahead."""
    return step - 1 - lag


@dataclass
class Ahead:
    """A step's rollouts in the making in this rank's background thread (`Rollouts.start`)."""

    step: int
    policy_step: int
    future: concurrent.futures.Future
    group: Group = field(default_factory=world_group)
    """Where the step is gathered: the run's control group."""

    def finish(self) -> StepRollouts:
        """Wait for this rank's share, then one all-gather gives every rank the step's groups;
        a failure on any owner (a dead engine, a reward error) raises on every rank."""
        what = f"generating step {self.step}'s rollouts ahead"
        scored, seconds = gather(self.future.result, what, self.group)
        return StepRollouts(scored=scored, policy_step=self.policy_step, seconds=seconds)


Made = tuple[list[ScoredGroup], dict[str, float]]
"""A rank's share of a round: its scored groups and the seconds of its phases ("rollout",
"reward"); none on a rank without an engine."""


def gather(
    make: Callable[[], Made], what: str, group: Group
) -> tuple[list[ScoredGroup], dict[str, float]]:
    """Every rank's share (`make()` on this rank) on every rank of `group` (the whole job), in
    prompt order, with the slowest owner's seconds of each phase; a failure of `make` on any
    rank raises on every rank (`what` names the phase). One all_gather_object."""
    pieces = all_gather_or_fail(make, what, group)
    scored = sorted((g for groups, _ in pieces for g in groups), key=lambda g: g.position)
    seconds = {
        phase: max(times.get(phase, 0.0) for _, times in pieces) for phase in ("rollout", "reward")
    }
    return scored, seconds


@dataclass(kw_only=True)
class Rollouts:
    rollout: RolloutConfig
    train: TrainConfig
    inputs: Inputs
    sampler: PromptSampler
    """The step's prompt indices, the same on every rank; its position is checkpointed."""
    replicas: Replicas
    rank: int
    """This process's rank in the job."""
    control: Group
    """The job's control group (`comm.open_control_group`): the agreements and gathers."""
    engine: RolloutEngine | None
    reward: WeightedReward | None
    sleep_level: int
    """`rollout.sleep_level` resolved for this machine: 0 never sleeps."""
    split_problem: Callable[[int], str | None]
    """Why n prompt groups cannot be trained at this layout, or None (`Config.split_problem`
    at this run's dp)."""

    @staticmethod
    def place(cfg: Config, group) -> Replicas:
        """Where the engines live: the same on every rank (one all_gather_object of the
        hostnames), so that a bad rollout.replicas fails alike everywhere."""
        replicas = Replicas.place(
            node_of_each_rank(group),
            cfg.rollout.replicas,
            engine_tp=cfg.rollout.tp,
            cuda=torch.cuda.is_available(),
            engine_gpus=cfg.rollout.gpus_per_node if cfg.rollout.separate else 0,
        )
        _check_separate_gpus(cfg, replicas)
        if len(replicas.groups) > 1 and cfg.rollout.backend != "vllm":
            raise ValueError(
                f"rollout.backend={cfg.rollout.backend} has no shared weight buffer, which "
                f"{len(replicas.groups)} engine replicas need: set rollout.replicas=1 or use vllm"
            )
        if job_rank() == 0:
            log.info(
                "rollout: %d engine replicas (owners: ranks %s) on %d nodes",
                len(replicas.owners),
                ", ".join(map(str, replicas.owners)),
                len(set(replicas.nodes)),
            )
        return replicas

    @classmethod
    def build(
        cls,
        cfg: Config,
        replicas: Replicas,
        inputs: Inputs,
        actor: Actor,
        run: RunDir,
        group,
        *,
        engines: contextlib.ExitStack,
        stack: contextlib.ExitStack,
    ) -> Rollouts:
        """Start each replica's engine on its owner (from model.path; a Megatron start
        checkpoint is exported to the run folder first) and its reward (`reward.build_reward`;
        a constructor that refuses its options stops every rank). The engine's
        shutdown goes on `engines` as soon as it runs, the workers' on `stack`, so that a
        failure after either still releases it. The engine's model is checked against the
        trainer's on every node before step 1. With run.trace_engine the engine's calls go to
        the run folder's engine_calls.jsonl (`rollout.trace`)."""
        rank = job_rank()
        replica = replicas.owned_by(rank)
        engine_dir = _engine_dir(cfg, actor, inputs, run)
        engine = reward = None
        with fail_together("starting the rollout engines", group):
            cores = _core_split(cfg.rollout, replicas, rank)
            if replica is not None:
                engine = _start_engine(cfg, replicas, replica, engine_dir, cores)
                engines.callback(engine.shutdown)
                check_engine(engine, inputs.arch)
                if cfg.run.trace_engine:
                    engine = TracedEngine(engine, run.engine_calls, replica=replica)
            if cores is not None:  # after the engines started: they inherit no trainer mask
                _bind_trainer(cores, rank, engine=engine is not None)
            if replica is not None:  # a reward's constructor may refuse its options
                workers = _reward_workers(replicas, rank)
                reward = build_reward(
                    cfg.reward, workers=workers, max_tokens=cfg.rollout.max_tokens
                )
                stack.callback(reward.close)
        return cls(
            rollout=cfg.rollout,
            train=cfg.train,
            inputs=inputs,
            sampler=PromptSampler(len(inputs.train_set), seed=cfg.data.seed),
            replicas=replicas,
            rank=rank,
            control=group,
            engine=engine,
            reward=reward,
            sleep_level=engine_sleep_level(cfg.rollout, cuda=torch.cuda.is_available()),
            split_problem=functools.partial(
                cfg.split_problem, dp=cfg.check_world(size_of(world_group()))
            ),
        )

    def at_step(self, step: int) -> None:
        """The engine's next calls belong to `step` (its trace's step field); the trainer
        sets it as each step begins."""
        if isinstance(self.engine, TracedEngine):
            self.engine.step = step

    def rounds(self) -> StepRounds:
        """A step's generation rounds: with train.dynamic_sampling up to max_gen_batches of
        them, dropping groups without a reward signal (`data.dynamic_sampling`); else one
        round that keeps every group."""
        t = self.train
        return StepRounds(
            target=t.prompts_per_step,
            max_rounds=t.max_gen_batches if t.dynamic_sampling else 1,
            eps=t.dynamic_sampling_eps if t.dynamic_sampling else None,
            split_problem=self.split_problem,
        )

    @property
    def sampling(self) -> SamplingConfig:
        return sampling_config(self.rollout, temperature=self.train.temperature)

    def collect(self, step: int) -> StepRollouts:
        """Steps 1-3 now, with the weights after step - 1: round after round (one without
        dynamic sampling) of prompts drawn, made and gathered, until `rounds` has its groups;
        the slowest owner's seconds of generating ("rollout") and scoring ("reward"), summed
        over the rounds."""
        rounds, seconds = self.rounds(), {}
        while rounds.want_more():
            prompts = self.draw(step, rounds.drawn)
            scored, took = gather(
                functools.partial(self.make, prompts), "making the rollouts", self.control
            )
            rounds.add(scored)
            for phase, value in took.items():
                seconds[phase] = seconds.get(phase, 0.0) + value
        return StepRollouts(
            scored=rounds.batch(),
            policy_step=sampled_after(step, lag=0),
            metrics=rounds.metrics(),
            seconds=seconds,
        )

    def start(self, step: int) -> Ahead:
        """Steps 1-3 of `step` in the background during step - 1 (rollout.async_steps = 1;
        one round, no dynamic sampling), with the weights the engines hold: those after step
        - 2. The prompts are drawn here, on the calling thread, so the sampler moves as in a
        synchronous run; a thread of this rank then makes its share (`make`, no collective)."""
        prompts = self.draw(step)
        # this thread's calls belong to `step`; the trainer's, meanwhile, to step - 1
        engine = self.engine.labeled(step) if isinstance(self.engine, TracedEngine) else self.engine
        return Ahead(
            step=step,
            policy_step=sampled_after(step, lag=self.rollout.async_steps),
            future=_in_background(
                functools.partial(self.make, prompts, engine), name=f"cwgrpo-rollouts-step-{step}"
            ),
            group=self.control,
        )

    def make(self, prompts: StepPrompts, engine: RolloutEngine | None = None) -> Made:
        """Steps 2-3 of this rank's share of a round, with no collective: G completions of
        each of its prompts from its engine (`engine`, default this rank's), scored in its
        reward pool; nothing on a rank without prompts."""
        if not prompts.positions:
            return [], {}
        engine = self.engine if engine is None else engine
        began = time.perf_counter()
        groups = engine.generate(
            prompts.token_ids, self.train.group_size, self.sampling, seeds=prompts.seeds
        )
        generated = time.perf_counter()
        scored = score_groups(
            prompts.positions,
            prompts.problems,
            groups,
            tokenizer=self.inputs.tokenizer,
            reward=self.reward,
        )
        return scored, {"rollout": generated - began, "reward": time.perf_counter() - generated}

    def draw(self, step: int, round_index: int = 0) -> StepPrompts:
        """Step 1: the round's R prompts (train.prompts_per_round) that this rank's engine
        samples (every rank advances the sampler alike, so its position after the last round
        is what a checkpoint holds); none on ranks without an engine."""
        t, prompts = self.train, self.inputs.train_set
        count = t.prompts_per_round
        indices = self.sampler.next_indices(count)
        replica = self.replicas.owned_by(self.rank)
        shares = []
        if replica is not None:
            shares = list(self.replicas.share(replica, count))
        positions = [round_index * count + j for j in shares]
        return StepPrompts(
            positions=positions,
            problems=[prompts.problems[indices[j]] for j in shares],
            token_ids=[prompts.token_ids[indices[j]] for j in shares],
            seeds=[rollout_seed(t.seed, step, p, t.group_size) for p in positions],
        )

    def evaluate(
        self, benchmarks: dict[str, list[Problem]] | None, *, n: int, sampling: SamplingConfig
    ) -> dict | None:
        """The benchmarks on every engine: their requests (`eval.runner.eval_requests`, in
        order) split over the replicas as a step's prompts are, each owner sampling and scoring
        its share; one all-gather of the records (and, from the first owner, the requests).
        `eval_result`'s dict on rank 0, None elsewhere. Each problem's seed goes with it, so
        the result equals a one-engine evaluation's."""
        replica = self.replicas.owned_by(self.rank)

        def mine():
            if replica is None:
                return None
            requests, skipped = eval_requests(
                benchmarks,
                self.inputs.tokenizer,
                n=n,
                sampling=sampling,
                max_model_len=self.engine.max_model_len,
                prompt_format=self.inputs.prompt_format,
            )
            share = self.replicas.share(replica, len(requests))
            records = sample_requests(
                self.engine,
                self.inputs.tokenizer,
                benchmarks,
                requests[share.start : share.stop],
                n=n,
                sampling=sampling,
                reward=self.reward.verifier,
            )
            first = self.rank == self.replicas.owners[0]
            return records, (requests, skipped) if first else None

        pieces = all_gather_or_fail(mine, "evaluating the benchmarks", self.control)
        if self.rank != 0:
            return None
        requests, skipped = pieces[self.replicas.owners[0]][1]
        records = [group for owner in self.replicas.owners for group in pieces[owner][0]]
        return eval_result(requests, records, skipped, n=n)

    # ---- the engines' memory (docs/design.md, section 4) ----------------------------------

    def sleep(self) -> None:
        """After the rollouts: each engine frees its GPU memory at rollout.sleep_level for
        the trainer's phases (nothing at level 0)."""
        if self.sleep_level:
            with fail_together("putting the rollout engines to sleep", self.control):
                if self.engine is not None:
                    self.engine.sleep(self.sleep_level)

    def wake(self, tag: str) -> None:
        """Take back one kind of the engines' memory: "weights" before the sync (the ranks on
        an engine's GPU first return the trainer's cached blocks to the device, at the end of
        its peak), "kv_cache" after it, so that the two are never back together while the
        trainer's buffers are. Nothing at level 0."""
        if not self.sleep_level:
            return
        on_engine_gpu = torch.cuda.is_available() and self.replicas.shares_gpu(self.rank)
        if tag == "weights" and on_engine_gpu:
            torch.cuda.empty_cache()
        with fail_together(f"waking the rollout engines' {tag}", self.control):
            if self.engine is not None:
                self.engine.wake([tag])


def _in_background(work: Callable, *, name: str) -> concurrent.futures.Future:
    """`work()` in a daemon thread (a run that fails meanwhile does not wait for it at exit);
    its result or exception in the returned future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as err:  # handed to the trainer's thread, which raises it
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _engine_dir(cfg: Config, actor: Actor, inputs: Inputs, run: RunDir) -> str:
    """The checkpoint the engines start from: model.path, or a Megatron start checkpoint's HF
    export in the run folder (a collective over the model-parallel groups)."""
    if not is_megatron_checkpoint(cfg.model.path):
        return str(cfg.model.path)
    return str(
        export_hf(
            actor.model,
            inputs.arch,
            run.hf,
            side_files_from=cfg.model.path,
            dtype=cfg.train.params_dtype,
        )
    )


def _start_engine(
    cfg: Config, replicas: Replicas, replica: int, engine_dir: str, cores
) -> RolloutEngine:
    """Replica `replica`'s engine on this rank, on its devices (GPUs) or cores (`cores`, CPU
    with separate placement)."""
    return build_engine(
        cfg.rollout,
        engine_dir,
        dtype=cfg.engine_dtype,
        seed=cfg.train.seed,
        devices=replicas.devices(replica),
        cpu_cores=cores.engine if cores else None,
    )


def _bind_trainer(cores, rank: int, *, engine: bool) -> None:
    """This rank's trainer on its cores (`placement.CoreSplit.trainer`), its torch threads
    no more than them."""
    bind_process(os.getpid(), cores.trainer)
    torch.set_num_threads(min(torch.get_num_threads(), len(cores.trainer)))
    log.info(
        "rollout.placement=separate: rank %d on cores %s%s",
        rank,
        cores.trainer,
        f", its engine on cores {cores.engine}" if engine else "",
    )


def _core_split(cfg: RolloutConfig, replicas: Replicas, rank: int):
    """This rank's `placement.CoreSplit` with separate placement on CPU; None otherwise."""
    if not cfg.separate or torch.cuda.is_available():
        return None
    owners = replicas.owners_on(replicas.nodes[rank])
    return split_cores(
        sorted(os.sched_getaffinity(0)),
        engine_cores=cfg.cpu_cores,
        engines=len(owners),
        engine=owners.index(rank) if rank in owners else None,
        tp=cfg.tp,
    )


def _check_separate_gpus(cfg: Config, replicas: Replicas) -> None:
    """Separate placement on GPUs: rollout.gpus_per_node set, and the GPUs there."""
    r = cfg.rollout
    if not (r.separate and torch.cuda.is_available()):
        return
    if r.gpus_per_node == 0:
        raise ValueError(
            "rollout.placement=separate on GPUs needs rollout.gpus_per_node: how many GPUs of "
            "each node hold engines (torchrun starts one trainer rank per other GPU)"
        )
    node = replicas.nodes[job_rank()]
    ranks = sum(1 for n in replicas.nodes if n == node)
    if ranks + r.gpus_per_node > torch.cuda.device_count():
        raise ValueError(
            f"{ranks} trainer ranks and rollout.gpus_per_node={r.gpus_per_node} engine GPUs "
            f"need {ranks + r.gpus_per_node} GPUs on this node, which has "
            f"{torch.cuda.device_count()}: lower --nproc-per-node or rollout.gpus_per_node"
        )


def _reward_workers(replicas: Replicas, rank: int) -> int:
    """reward.workers = 0: this node's cores shared by the scoring ranks on it (the owners of
    its engine replicas)."""
    node = replicas.nodes[rank]
    return max(1, (os.cpu_count() or 1) // len(replicas.owners_on(node)))
