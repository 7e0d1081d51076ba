"""Build a run's parts from its config, in the order that fails cheapest first.

    engine replicas  ->  run folder (rank 0; every node must see it)  ->  tokenizer and
      prompts  ->  Megatron groups, model and optimizer  ->  rollout engines and rewards (each
      replica's owner)  ->  weight sync plan  ->  sync-check calibration  ->  resume from a
      checkpoint  ->  env.json, metrics

Each phase that can fail on some ranks only runs under `fail_together`, so every rank raises
the same error instead of waiting for a peer that is gone. What was started before a failure
(Megatron's groups, the engine, the reward's workers) is stopped again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

from cwgrpo_megatron.comm import (
    all_gather_objects,
    all_gather_or_fail,
    close_control_group,
    fail_together,
    job_rank,
    node_of_each_rank,
    open_control_group,
    size_of,
    world_group,
)
from cwgrpo_megatron.common.plugins import check_unchanged, load_plugins
from cwgrpo_megatron.common.settings import check_length
from cwgrpo_megatron.components.inputs import Inputs
from cwgrpo_megatron.components.rollouts import Rollouts
from cwgrpo_megatron.components.sync import WeightSync
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.megatron import parallel, train_checkpoint
from cwgrpo_megatron.megatron.conversion import load_start_weights
from cwgrpo_megatron.megatron.model import use_transformer_engine
from cwgrpo_megatron.megatron.train_step import Actor, build_actor
from cwgrpo_megatron.run.run_dir import (
    RunDir,
    checkpoint_to_resume,
    mark_node,
    prepare,
    rewind_metrics,
    wait_for_nodes,
    write_env,
)
from cwgrpo_megatron.run.tracking import Tracker
from cwgrpo_megatron.trainer import LoopState, Trainer

log = logging.getLogger("cwgrpo_megatron.train")


def build_trainer(cfg: Config, *, sources: Sequence[str] = ()) -> Trainer:
    """Every part of the run on this rank; `sources` (`config.config_sources`) head the run's
    config.yaml. Each part that holds a resource registers its release on one ExitStack as it
    is built; a failure releases what was built, and the Trainer's `close` releases the rest,
    in one order: metric sinks, reward workers, Megatron's groups, then the engines (an
    in-process vLLM engine ends torch.distributed)."""
    cfg.check_world(size_of(world_group()))
    # every agreement and object collective of the run goes over this gloo group, bounded
    group = open_control_group(cfg.run.collective_timeout_min)
    replicas = Rollouts.place(cfg, group)
    with fail_together("preparing the run folder", group):
        run = (
            prepare(cfg, sources=sources)
            if job_rank() == 0
            else RunDir(Path(cfg.run.out_dir).resolve())
        )
    _check_shared_folder(run, group, wait_s=cfg.run.shared_dir_wait_s)
    inputs = Inputs.read(cfg, group, evaluators=replicas.owners)
    with contextlib.ExitStack() as stack:
        engines = stack.enter_context(contextlib.ExitStack())  # entered first: released last
        stack.callback(close_control_group, group)  # after Megatron's groups, before the engines
        parallel.initialize(**cfg.parallel.sizes(), seed=cfg.train.seed)
        stack.callback(parallel.destroy)
        actor = _build_actor(cfg, inputs.arch, group)
        rollouts = Rollouts.build(
            cfg, replicas, inputs, actor, run, group, engines=engines, stack=stack
        )
        sync = WeightSync.build(
            cfg, replicas, actor.model, inputs.arch, rollouts.engine, control=group
        )
        state = LoopState(step=0, sampler=rollouts.sampler)
        saved_line = _resume(cfg, run, actor, state, group)
        rollouts.at_step(state.step)
        if state.step:  # the engines still hold the start checkpoint
            sync.push(actor.model, rollouts.engine)
            sync.check(actor.model, rollouts.engine, step=None)
        _write_run_files(run, state.step, saved_line, group, cfg.run.plugins)
        tracker = Tracker(cfg, run, start_step=state.step, enabled=job_rank() == 0)
        stack.callback(tracker.close)
        return Trainer(
            cfg=cfg,
            inputs=inputs,
            actor=actor,
            rollouts=rollouts,
            sync=sync,
            run=run,
            state=state,
            tracker=tracker,
            control=group,
            resources=stack.pop_all(),
        )


def _check_shared_folder(run: RunDir, group, *, wait_s: float) -> None:
    """Every node's first rank writes a marker into the run folder and rank 0 waits for them
    all (`run_dir.mark_node`, `wait_for_nodes`): a node that does not see rank 0's folder
    stops the run on every rank before anything is built. Two all_gather_objects, then one in
    `fail_together`; the markers are removed again. Nothing happens on one node."""
    nodes = node_of_each_rank(group)
    if len(set(nodes)) == 1:
        return
    rank = job_rank()
    hosts_tokens = all_gather_objects((socket.gethostname(), uuid.uuid4().hex[:12]), group)
    token = hosts_tokens[0][1]  # rank 0's: this start's markers, never an earlier start's
    order = list(dict.fromkeys(nodes))
    names: dict[int, str] = {}
    for node, (host, _) in zip(nodes, hosts_tokens, strict=True):
        names.setdefault(order.index(node), node if node == host else f"{node} ({host})")
    marker = None
    try:
        with fail_together("checking that run.out_dir is shared", group):
            if nodes.index(nodes[rank]) == rank:
                marker = mark_node(run, token, order.index(nodes[rank]), wait_s=wait_s)
            if rank == 0:
                wait_for_nodes(run, token, names, wait_s=wait_s)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def _build_actor(cfg: Config, arch: ModelArch, group) -> Actor:
    """The policy (model, DDP, optimizer, schedule) from model.path, in Megatron's groups."""
    with fail_together("loading the model", group):
        check_length(
            ("data.max_prompt_tokens", cfg.data.max_prompt_tokens),
            ("rollout.max_tokens", cfg.rollout.max_tokens),
            ("model.path's max_position_embeddings", arch.max_position_embeddings),
        )
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


def _write_run_files(
    run: RunDir, step: int, saved_line: dict | None, group, run_plugins: Sequence[str]
) -> None:
    """env.json, and metrics.jsonl rewound to the resumed step (rank 0)."""
    hostnames = all_gather_objects(socket.gethostname(), group)
    if job_rank() == 0:
        rewind_metrics(run.metrics, step=step, saved_line=saved_line)
        spec = "te" if use_transformer_engine() else "local"
        plugins = [record.to_json() for record in load_plugins(run_plugins)]
        write_env(
            run, layout=parallel.layout(), hostnames=hostnames, layer_spec=spec, plugins=plugins
        )


def _resume(cfg: Config, run: RunDir, actor: Actor, state: LoopState, group) -> dict | None:
    """Load the checkpoint run.resume points to (rank 0 decides, every rank follows) into the
    actor and the loop state; returns the metrics line saved with it."""
    found = all_gather_or_fail(
        lambda: checkpoint_to_resume(cfg, run) if job_rank() == 0 else None,
        "finding the checkpoint to resume",
        group,
    )[0]
    if found is None:
        return None
    with fail_together(f"resuming from {found}", group):
        data_state = train_checkpoint.load(actor, found)
        check_unchanged(data_state.get("plugins", []), load_plugins(cfg.run.plugins), where=found)
        state.load_state_dict(data_state["loop"], train_checkpoint.load_objects(found))
        if actor.step != state.step * cfg.train.ppo_mini_batches:
            raise ValueError(
                f"{found} holds {actor.step} optimizer steps for {state.step} training steps: "
                "train.ppo_mini_batches differs from the run that saved it"
            )
    if job_rank() == 0:
        log.info("resumed from %s at step %d", found, state.step)
    return data_state.get("metrics")
