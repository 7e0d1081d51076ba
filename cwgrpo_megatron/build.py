"""Build a run's parts from its config, in the order that fails cheapest first.

    engine replicas  ->  run folder (rank 0)  ->  tokenizer and prompts  ->  Megatron groups,
      model and optimizer  ->  rollout engines and rewards (each replica's owner)  ->  weight
      sync plan  ->  sync-check calibration  ->  resume from a checkpoint  ->  env.json, metrics

Each phase that can fail on some ranks only runs under `fail_together`, so every rank raises
the same error instead of waiting for a peer that is gone. What was started before a failure
(Megatron's groups, the engine, the reward's workers) is stopped again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from cwgrpo_megatron.checks.sync_check import SyncVerifier
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.data.prompt_set import PromptSet, build_prompt_sets
from cwgrpo_megatron.data.prompts import SYSTEM_PROMPT, PromptFormat, PromptSampler
from cwgrpo_megatron.dist import (
    all_gather_objects,
    all_gather_or_fail,
    fail_together,
    node_of_each_rank,
    world_group,
)
from cwgrpo_megatron.eval.runner import load_benchmarks
from cwgrpo_megatron.megatron import parallel, train_checkpoint
from cwgrpo_megatron.megatron.conversion import (
    export_hf,
    is_megatron_checkpoint,
    load_start_weights,
    start_arch,
)
from cwgrpo_megatron.megatron.model import DTYPES
from cwgrpo_megatron.megatron.publish import check_engine, sync_plan, sync_weights
from cwgrpo_megatron.megatron.train_step import Actor, build_actor
from cwgrpo_megatron.reward import build_reward
from cwgrpo_megatron.rollout import RolloutEngine, build_engine
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.run.run_dir import (
    RunDir,
    checkpoint_to_resume,
    prepare,
    rewind_metrics,
    write_env,
)
from cwgrpo_megatron.run.tracking import Tracker
from cwgrpo_megatron.trainer import LoopState, Trainer

log = logging.getLogger("cwgrpo_megatron.train")
DEFAULT_EVAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_tokenizer(model_cfg):
    """model.tokenizer: the built-in Qwen tokenizers, a folder, or (None) model.path's files."""
    from cwgrpo_megatron.data import tokenizers

    name = model_cfg.tokenizer
    if name == "qwen2.5":
        return tokenizers.qwen25_tokenizer()
    if name == "r1_distill":
        return tokenizers.r1_distill_tokenizer()
    from transformers import AutoTokenizer

    folder = name or model_cfg.path
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"no tokenizer could be loaded from {folder} ({err}); set model.tokenizer to a "
            "tokenizer folder, qwen2.5 or r1_distill"
        ) from err


def prompt_format(model_cfg) -> PromptFormat:
    auto = model_cfg.chat_template == "auto"
    return PromptFormat(
        template="qwen2.5" if auto else model_cfg.chat_template,
        use_tokenizer_template=auto,
        system=model_cfg.system_prompt or SYSTEM_PROMPT,
    )


def _eval_benchmarks(cfg: Config, heldout) -> dict:
    e = cfg.eval
    names = [b for b in e.benchmarks if b != "heldout"]
    benchmarks = load_benchmarks(names, data_dir=e.data_dir or DEFAULT_EVAL_DATA, limit=e.limit)
    if "heldout" in e.benchmarks:
        benchmarks["heldout"] = heldout.problems[: e.limit] if e.limit else heldout.problems
    return benchmarks


def _reward_workers(replicas: Replicas) -> int:
    """reward.workers = 0: this node's cores shared by the scoring ranks on it (the owners of
    its engine replicas)."""
    node = replicas.nodes[dist.get_rank()]
    return max(1, (os.cpu_count() or 1) // len(replicas.owners_on(node)))


def build_trainer(cfg: Config) -> Trainer:
    """Every part of the run on this rank. Each part that holds a resource registers its
    release on one ExitStack as it is built; a failure releases what was built, and the
    Trainer's `close` releases the rest, in one order: metric sinks, reward workers, Megatron's
    groups, then the engines (an in-process vLLM engine ends torch.distributed)."""
    group = world_group()
    cfg.check_world(dist.get_world_size())
    replicas = _place_replicas(cfg, group)
    with fail_together("preparing the run folder", group):
        run = prepare(cfg) if dist.get_rank() == 0 else RunDir(Path(cfg.run.out_dir).resolve())
    inputs = _read_inputs(cfg, group)
    with contextlib.ExitStack() as stack:
        engines: list[RolloutEngine] = []  # this rank's engine, once started: released last
        stack.callback(_shut_down, engines)
        parallel.initialize(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.train.seed)
        stack.callback(parallel.destroy)
        actor = _build_actor(cfg, inputs.arch, group)
        engine, reward = _start_rollouts(cfg, replicas, actor, inputs.arch, run, group, engines)
        if reward is not None:
            stack.callback(reward.close)
        plan, verifier = _build_sync(cfg, replicas, actor, inputs.arch, engine)
        state = LoopState(step=0, sampler=PromptSampler(len(inputs.train_set), seed=cfg.data.seed))
        saved_line = _resume(cfg, run, actor, state, group)
        if state.step:  # the engines still hold the start checkpoint
            sync_weights(actor.model, inputs.arch, engine, dtype=cfg.engine_dtype, plan=plan)
            if verifier is not None:
                verifier.check(actor.model, inputs.arch, engine)
        _write_run_files(run, state.step, saved_line, group)
        tracker = Tracker(cfg, run, start_step=state.step, enabled=dist.get_rank() == 0)
        stack.callback(tracker.close)
        return Trainer(
            cfg=cfg,
            actor=actor,
            arch=inputs.arch,
            engine=engine,
            replicas=replicas,
            sync_plan=plan,
            reward=reward,
            tokenizer=inputs.tokenizer,
            prompt_format=inputs.prompt_format,
            train_set=inputs.train_set,
            benchmarks=inputs.benchmarks,
            run=run,
            state=state,
            tracker=tracker,
            verifier=verifier,
            resources=stack.pop_all(),
        )


def _shut_down(engines: list[RolloutEngine]) -> None:
    for engine in engines:
        engine.shutdown()


def _place_replicas(cfg: Config, group) -> Replicas:
    """Where the engines live; the same nodes on every rank, so a bad rollout.replicas fails
    alike everywhere."""
    replicas = Replicas.place(
        node_of_each_rank(group), cfg.rollout.replicas, engine_tp=cfg.rollout.tp
    )
    if len(replicas.groups) > 1 and cfg.rollout.backend != "vllm":
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend} has no shared weight buffer, which "
            f"{len(replicas.groups)} engine replicas need: set rollout.replicas=1 or use vllm"
        )
    if dist.get_rank() == 0:
        log.info(
            "rollout: %d engine replicas (owners: ranks %s) on %d nodes",
            len(replicas.owners),
            ", ".join(map(str, replicas.owners)),
            len(set(replicas.nodes)),
        )
    return replicas


@dataclass(frozen=True)
class Inputs:
    """What the run reads before any model exists: the start checkpoint's architecture, the
    tokenizer and prompt format, the training prompts and (rank 0) the evaluation problems."""

    arch: ModelArch
    tokenizer: object
    prompt_format: PromptFormat
    train_set: PromptSet
    benchmarks: dict | None


def _read_inputs(cfg: Config, group) -> Inputs:
    rank0 = dist.get_rank() == 0
    with fail_together("loading the tokenizer and the prompts", group):
        # a missing model folder, or one that is not model.arch, fails here, clearly
        arch = start_arch(cfg.model.path, recipe=cfg.model.arch)
        tokenizer = load_tokenizer(cfg.model)
        fmt = prompt_format(cfg.model)
        train_set, heldout, report = build_prompt_sets(cfg.data, tokenizer, fmt)
        benchmarks = _eval_benchmarks(cfg, heldout) if rank0 and cfg.eval.benchmarks else None
    _same_model_everywhere(arch, cfg.model.path, group)
    if rank0:
        log.info(
            "prompts: %d train, %d held out (%d rows read, %d skipped, %d too long)",
            report.train,
            report.heldout,
            report.rows,
            report.skipped_rows,
            report.too_long,
        )
    return Inputs(arch, tokenizer, fmt, train_set, benchmarks)


def _build_actor(cfg: Config, arch: ModelArch, group) -> Actor:
    """The policy (model, DDP, optimizer, schedule) from model.path, in Megatron's groups."""
    with fail_together("loading the model", group):
        if cfg.rollout.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                f"{arch.max_position_embeddings} positions: lower it"
            )
        return build_actor(
            arch,
            lambda model: load_start_weights(model, arch, cfg.model.path),
            train=cfg.train,
            algo=cfg.algo,
            optim=cfg.optim,
        )


def _start_rollouts(
    cfg: Config,
    replicas: Replicas,
    actor: Actor,
    arch: ModelArch,
    run: RunDir,
    group,
    started: list[RolloutEngine],
):
    """(engine, reward) on each replica's owner, (None, None) elsewhere; the engine is added
    to `started` as soon as it runs, so that a failure after it still stops it. The engine
    starts from HF files: a Megatron start checkpoint is exported to the run folder first."""
    engine_dir = cfg.model.path
    if is_megatron_checkpoint(engine_dir):
        engine_dir = export_hf(
            actor.model, arch, run.hf, side_files_from=engine_dir, dtype=cfg.train.params_dtype
        )
    replica = replicas.owned_by(dist.get_rank())
    engine = reward = None
    with fail_together("starting the rollout engines", group):
        if replica is not None:
            engine = build_engine(
                cfg.rollout,
                str(engine_dir),
                dtype=cfg.engine_dtype,
                seed=cfg.train.seed,
                devices=replicas.devices(replica),
            )
            started.append(engine)
            check_engine(engine, arch)  # another model on any node fails before step 1
    if replica is not None:
        reward = build_reward(cfg.reward, workers=_reward_workers(replicas))
    return engine, reward


def _build_sync(cfg: Config, replicas: Replicas, actor: Actor, arch: ModelArch, engine):
    """The weight sync's plan, and the verifier when run.verify_sync asks for one (calibrated
    on the start checkpoint, which trainer and engines both hold now)."""
    plan = sync_plan(replicas)
    if dist.get_rank() == 0:
        received = plan.received_bytes(arch, DTYPES[cfg.engine_dtype])
        log.info(
            "weight sync: per sync each node receives from the others %s",
            ", ".join(f"node {n}: {b / 2**20:.1f} MiB" for n, b in received.items()),
        )
    if not cfg.run.verify_sync:
        return plan, None
    verifier = SyncVerifier(min_tol=cfg.run.verify_sync_tol)
    gap = verifier.calibrate(actor.model, arch, engine)
    if dist.get_rank() == 0:
        tol = verifier.tol
        log.info(
            "sync check: start gap %.2e (mean %.2e), tolerance %.2e (mean %.2e)",
            *(gap.max, gap.mean, tol.max, tol.mean),
        )
    return plan, verifier


def _write_run_files(run: RunDir, step: int, saved_line: dict | None, group) -> None:
    """env.json, and metrics.jsonl rewound to the resumed step (rank 0)."""
    hostnames = all_gather_objects(socket.gethostname(), group)
    if dist.get_rank() == 0:
        rewind_metrics(run.metrics, step=step, saved_line=saved_line)
        write_env(run, layout=parallel.layout(), hostnames=hostnames)


def _same_model_everywhere(arch, path: str, group) -> None:
    """ValueError on every rank when model.path holds another model on some node (each node
    reads its own copy, and each replica's engine starts from it)."""
    archs = all_gather_objects(arch, group)
    for member, other in enumerate(archs):
        if archs[0].differences(other):
            raise ValueError(
                f"model.path={path} holds another model on rank {member} than on rank 0 "
                f"({'; '.join(archs[0].differences(other))}): every node must hold the same "
                "checkpoint"
            )


def _resume(cfg: Config, run: RunDir, actor, state: LoopState, group) -> dict | None:
    """Load the checkpoint run.resume points to (rank 0 decides, every rank follows) into the
    actor and the loop state; returns the metrics line saved with it."""
    found = all_gather_or_fail(
        lambda: checkpoint_to_resume(cfg, run) if dist.get_rank() == 0 else None,
        "finding the checkpoint to resume",
        group,
    )[0]
    if found is None:
        return None
    with fail_together(f"resuming from {found}", group):
        data_state = train_checkpoint.load(actor, found)
        state.load_state_dict(data_state["loop"])
        if actor.step != state.step * cfg.train.ppo_mini_batches:
            raise ValueError(
                f"{found} holds {actor.step} optimizer steps for {state.step} rollout steps: "
                "train.ppo_mini_batches differs from the run that saved it"
            )
    if dist.get_rank() == 0:
        log.info("resumed from %s at step %d", found, state.step)
    return data_state.get("metrics")
