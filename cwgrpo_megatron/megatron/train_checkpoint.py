"""Training checkpoints: model, optimizer, LR schedule, RNG, step, data position, config.

    ROOT/step_00000012/
        model/                    dist checkpoint of {"model", "optimizer"} (torch_dist); the
                                  distributed optimizer uses the fully_reshardable format, so
                                  the folder loads at another TP x PP x DP layout too
        train_state.json          step, data position, LR schedule, layout, resolved config
        rng/rank_00003.pt         each rank's Python / NumPy / torch / tracker RNG states
        data_objects.pt           what the data state holds beyond JSON (the next step's
                                  rollouts with rollout.async_steps = 1), when there is any
        cwgrpo_checkpoint.json    what a converted checkpoint holds beside its model
        config.json, tokenizer    (`checkpoint.py`), so that the policy converts to HF
                                  (tools/convert_megatron_to_hf.py) as one does

Each checkpoint is written into a hidden temporary sibling and renamed when complete; a killed
save leaves the previous checkpoints intact. Only the newest `keep_last` are kept.
RNG states are restored only in the layout they were saved in (a rank's stream has no meaning
in another layout); elsewhere a warning says they were not.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from cwgrpo_megatron.comm.collectives import barrier, job_rank, world_group
from cwgrpo_megatron.megatron.checkpoint import (
    TRAIN_STATE_NAME,
    AtomicDir,
    load_dist,
    save_dist,
    write_meta,
)
from cwgrpo_megatron.megatron.cpu import on_cpu
from cwgrpo_megatron.megatron.parallel import layout
from cwgrpo_megatron.megatron.train_step import Actor

log = logging.getLogger(__name__)
STATE_NAME = TRAIN_STATE_NAME
OBJECTS_NAME = "data_objects.pt"
STEP_DIR = re.compile(r"^step_(\d{8})$")
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(actor: Actor, *, is_loading: bool) -> dict:
    # the distributed optimizer gathers its state here, with CUDA-only calls
    with on_cpu():
        model_sd = actor.model.module.sharded_state_dict()
        if is_loading and actor.optim.use_distributed_optimizer:
            _ensure_optimizer_state(actor.optimizer)
        optim_sd = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=SHARDING
        )
    return {"model": model_sd, "optimizer": optim_sd}


def _ensure_optimizer_state(optimizer) -> None:
    """Megatron's distributed optimizer needs its (lazily made) state to exist before it can
    describe the shards to load into. Without apex / TE, Megatron falls back to torch's Adam,
    which also keeps a per-param `step` that Megatron's init_state_fn does not create; the
    loaded value replaces it. TE's and apex's FusedAdam keep the step per group and refuse any
    other per-param key (TE's `state_dict` raises KeyError in `get_unscaled_state`), so they
    get none."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.init_state_fn is None:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        if not isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p].setdefault("step", torch.tensor(0.0))


def _load_optimizer(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, working around megatron-core 0.16's distributed optimizer
    without apex / TE: it sets torch Adam's per-param `step` from the param groups (one tensor
    shared by all parameters), then copies every state key, `step` included, from the
    fully_reshardable parameter state, which has none. So the parameter state is loaded with
    `step` set aside, and each parameter gets its own copy of `step` back."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    for opt, part in zip(chained, parts, strict=True):
        param_state = (
            part.pop("param_state", None) if hasattr(opt, "model_param_group_index_map") else None
        )
        opt.load_state_dict(part)
        if param_state is None:
            continue
        if part.get("param_state_sharding_type") != "fully_reshardable":
            raise ValueError("only fully_reshardable distributed-optimizer checkpoints load here")
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        # Megatron assigns one shared `step` tensor to every parameter, and torch Adam
        # increments each parameter's step in place: give each its own copy.
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.clone()


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def step_dirs(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / STATE_NAME).is_file()]
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def save(
    actor: Actor,
    root: str | Path,
    *,
    data_state: dict,
    keep_last: int = 2,
    config: dict | None = None,
    side_files_from: str | Path | None = None,
    data_objects: dict | None = None,
) -> Path:
    """Write ROOT/step_<actor.step> (collective over all ranks) and prune old ones.
    `data_objects`: picklable objects the same on every rank, written once. `config`
    (the run's resolved config, as a dict) is kept beside the state for readers of the
    checkpoint; nothing here reads it back. `side_files_from`: the HF folder (or converted
    checkpoint) whose config and tokenizer files go beside the model."""
    path = Path(root) / f"step_{actor.step:08d}"
    atomic = AtomicDir(path, overwrite=True)
    with atomic as tmp:
        if job_rank() == 0:
            (tmp / "rng").mkdir()
        save_dist(_sharded_state(actor, is_loading=False), tmp / "model")
        torch.save(_rng_state(), tmp / "rng" / f"rank_{job_rank():05d}.pt")
        if job_rank() == 0:
            state = {
                "step": actor.step,
                "skipped_steps": actor.skipped_steps,
                "data_state": data_state,
                "scheduler": actor.scheduler.state_dict(),
                "layout": layout(),
                "use_distributed_optimizer": actor.optim.use_distributed_optimizer,
                "config": config,
            }
            (tmp / STATE_NAME).write_text(json.dumps(state, indent=2, default=str) + "\n")
            if data_objects:
                torch.save(data_objects, tmp / OBJECTS_NAME)
            write_meta(
                tmp,
                actor.model,
                actor.arch,
                params_dtype=actor.train.params_dtype,
                side_files_from=side_files_from,
            )
        atomic.commit()
    if job_rank() == 0:
        for old in step_dirs(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(world_group())
    return atomic.final


def load(actor: Actor, ckpt: str | Path) -> dict:
    """Restore `actor` from `ckpt`; returns the saved data position."""
    ckpt = Path(ckpt)
    state_path = ckpt / STATE_NAME
    if not state_path.is_file():
        raise ValueError(f"{state_path} is missing: {ckpt} is not a complete training checkpoint")
    state = json.loads(state_path.read_text())
    saved_dist_opt = state["use_distributed_optimizer"]
    if saved_dist_opt != actor.optim.use_distributed_optimizer:
        raise ValueError(
            f"{ckpt} was saved with optim.use_distributed_optimizer={saved_dist_opt}, this run "
            f"uses {actor.optim.use_distributed_optimizer}: their optimizer states are "
            f"not interchangeable; set optim.use_distributed_optimizer={saved_dist_opt}"
        )
    loaded = load_dist(_sharded_state(actor, is_loading=True), ckpt / "model")
    actor.model.module.load_state_dict(loaded["model"], strict=True)
    _load_optimizer(actor.optimizer, loaded["optimizer"])
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.step = state["step"]
    actor.skipped_steps = state["skipped_steps"]
    if state["layout"] == layout():
        rng = torch.load(ckpt / "rng" / f"rank_{job_rank():05d}.pt", weights_only=False)
        _set_rng_state(rng)
    else:
        log.warning(
            "RNG states not restored: saved at %s, running at %s", state["layout"], layout()
        )
    return state["data_state"]


def load_objects(ckpt: str | Path) -> dict:
    """The `data_objects` saved with `ckpt` ({} when it has none)."""
    path = Path(ckpt) / OBJECTS_NAME
    return torch.load(path, weights_only=False) if path.is_file() else {}
