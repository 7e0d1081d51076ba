"""Build a run's parts from its config, in the order that fails cheapest first.

    engine replicas  ->  run folder (rank 0)  ->  tokenizer and prompts  ->  Megatron groups,
      model and optimizer  ->  rollout engines and rewards (each replica's owner)  ->  weight
      sync plan  ->  sync-check calibration  ->  resume from a checkpoint  ->  env.json, metrics

Each phase that can fail on some ranks only runs under `fail_together`, so every rank raises
the same error instead of waiting for a peer that is gone. What was started before a failure
(Megatron's groups, the engine, the reward's workers) is stopped again.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch.distributed as dist

from cwgrpo_megatron.checks.sync_check import SyncVerifier
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.data.prompt_set import build_prompt_sets
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
from cwgrpo_megatron.megatron.train_step import build_actor
from cwgrpo_megatron.reward import build_reward
from cwgrpo_megatron.rollout import build_engine
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
    group, rank = world_group(), dist.get_rank()
    rank0 = rank == 0
    cfg.check_world(dist.get_world_size())
    # the same nodes on every rank: a bad rollout.replicas fails alike everywhere
    replicas = Replicas.place(
        node_of_each_rank(group), cfg.rollout.replicas, engine_tp=cfg.rollout.tp
    )
    if len(replicas.groups) > 1 and cfg.rollout.backend != "vllm":
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend} has no shared weight buffer, which "
            f"{len(replicas.groups)} engine replicas need: set rollout.replicas=1 or use vllm"
        )
    if rank0:
        log.info(
            "rollout: %d engine replicas (owners: ranks %s) on %d nodes",
            len(replicas.owners),
            ", ".join(map(str, replicas.owners)),
            len(set(replicas.nodes)),
        )
    with fail_together("preparing the run folder", group):
        run = prepare(cfg) if rank0 else RunDir(Path(cfg.run.out_dir).resolve())
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
    parallel.initialize(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.train.seed)
    engine = reward = None
    try:
        path = cfg.model.path
        with fail_together("loading the model", group):
            if cfg.rollout.max_model_len > arch.max_position_embeddings:
                raise ValueError(
                    f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                    f"{arch.max_position_embeddings} positions: lower it"
                )
            actor = build_actor(
                arch,
                lambda model: load_start_weights(model, arch, path),
                train=cfg.train,
                algo=cfg.algo,
                optim=cfg.optim,
            )
        engine_dir = path
        if is_megatron_checkpoint(path):  # the engine starts from HF files: export them
            engine_dir = export_hf(
                actor.model, arch, run.hf, side_files_from=path, dtype=cfg.train.params_dtype
            )
        replica = replicas.owned_by(rank)
        with fail_together("starting the rollout engines", group):
            if replica is not None:
                engine = build_engine(
                    cfg.rollout,
                    str(engine_dir),
                    dtype=cfg.engine_dtype,
                    seed=cfg.train.seed,
                    devices=replicas.devices(replica),
                )
                check_engine(engine, arch)  # another model on any node fails before step 1
        if replica is not None:
            reward = build_reward(cfg.reward, workers=_reward_workers(replicas))
        plan = sync_plan(replicas)
        if rank0:
            received = plan.received_bytes(arch, DTYPES[cfg.engine_dtype])
            log.info(
                "weight sync: per sync each node receives from the others %s",
                ", ".join(f"node {n}: {b / 2**20:.1f} MiB" for n, b in received.items()),
            )
        verifier = None
        if cfg.run.verify_sync:
            verifier = SyncVerifier(min_tol=cfg.run.verify_sync_tol)
            gap = verifier.calibrate(actor.model, arch, engine)
            if rank0:
                tol = verifier.tol
                log.info(
                    "sync check: start gap %.2e (mean %.2e), tolerance %.2e (mean %.2e)",
                    *(gap.max, gap.mean, tol.max, tol.mean),
                )
        state = LoopState(step=0, sampler=PromptSampler(len(train_set), seed=cfg.data.seed))
        saved_line = _resume(cfg, run, actor, state, group)
        if state.step:  # the engines still hold the start checkpoint
            sync_weights(actor.model, arch, engine, dtype=cfg.engine_dtype, plan=plan)
            if verifier is not None:
                verifier.check(actor.model, arch, engine)
        hostnames = all_gather_objects(socket.gethostname(), group)
        if rank0:
            rewind_metrics(run.metrics, step=state.step, saved_line=saved_line)
            write_env(run, layout=parallel.layout(), hostnames=hostnames)
        tracker = Tracker(cfg, run, start_step=state.step, enabled=rank0)
    except BaseException:
        # Trainer.close's order: an in-process vLLM engine ends torch.distributed, so it goes last
        if reward is not None:
            reward.close()
        parallel.destroy()
        if engine is not None:
            engine.shutdown()
        raise
    return Trainer(
        cfg=cfg,
        actor=actor,
        arch=arch,
        engine=engine,
        replicas=replicas,
        sync_plan=plan,
        reward=reward,
        tokenizer=tokenizer,
        prompt_format=fmt,
        train_set=train_set,
        benchmarks=benchmarks,
        run=run,
        state=state,
        tracker=tracker,
        verifier=verifier,
    )


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
