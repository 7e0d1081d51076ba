"""One-step-off rollouts and separate placement, without an engine: the settings and their
errors, where separate engines go (GPUs after the trainer's, CPU cores split and bound), the
policy lag's bookkeeping and the checkpointed next-step rollouts."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch

from cwgrpo_megatron.components.rollouts import StepRollouts
from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.data.prompts import PromptSampler
from cwgrpo_megatron.reward.scoring import ScoredGroup
from cwgrpo_megatron.rollout import engine_sleep_level
from cwgrpo_megatron.rollout.base import Completion
from cwgrpo_megatron.rollout.placement import bind_process, omp_bind, process_cores, split_cores
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.trainer import LoopState

SEPARATE = ["rollout.placement=separate"]
ASYNC = [*SEPARATE, "rollout.async_steps=1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(["rollout.async_steps=2"], "only 0 (synchronous) and 1", id="lag-2"),
        pytest.param(
            ["rollout.async_steps=1"], "set rollout.placement=separate", id="async-colocated"
        ),
        pytest.param(
            [*ASYNC, "train.dynamic_sampling=true"],
            "rollout.async_steps=1 with train.dynamic_sampling=true is not built",
            id="async-dynamic",
        ),
        pytest.param([*SEPARATE, "rollout.in_process=true"], "in_process unset", id="in-process"),
        pytest.param([*SEPARATE, "rollout.backend=torch"], "rollout.backend=vllm", id="torch"),
        pytest.param([*SEPARATE, "rollout.sleep_level=2"], "leave it unset", id="sleep"),
        pytest.param(
            [*SEPARATE, "rollout.weight_sync=ipc"],
            "leave it unset (nccl on GPUs, shm on CPU)",
            id="ipc",
        ),
        pytest.param(
            ["rollout.weight_sync=nccl"],
            "NCCL cannot join two processes on one GPU): set rollout.placement=separate",
            id="nccl-colocated",
        ),
        pytest.param(
            [*SEPARATE, "rollout.tp=2", "rollout.gpus_per_node=3"], "a multiple of it", id="gpus"
        ),
        pytest.param(["rollout.placement=apart"], "colocated, separate", id="placement"),
        pytest.param(["rollout.cpu_cores=0"], "rollout.cpu_cores=0 is out of range", id="cores"),
    ],
)
def test_bad_async_and_placement_settings_name_the_fix(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_separate_engines_never_sleep_and_async_steps_default_to_synchronous():
    cfg = load_config(overrides=ASYNC)
    assert cfg.rollout.separate and cfg.rollout.async_steps == 1
    assert engine_sleep_level(cfg.rollout, cuda=True) == 0
    default = load_config()
    assert default.rollout.async_steps == 0 and not default.rollout.separate
    assert engine_sleep_level(default.rollout, cuda=True) == 2


def test_separate_gpu_engines_take_the_gpus_after_the_trainers_ranks():
    # two nodes of 8 GPUs: 6 trainer ranks each, 2 engines of one GPU each after them
    nodes = [0] * 6 + [1] * 6
    placed = Replicas.place(nodes, "auto", cuda=True, engine_gpus=2)
    assert placed.groups == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    assert [placed.devices(r) for r in range(4)] == [[6], [7], [6], [7]]
    assert not any(placed.shares_gpu(rank) for rank in range(12))
    # one engine of rollout.tp=2 on GPUs 4 and 5 of a node with 4 trainer ranks
    wide = Replicas.place([0] * 4, "auto", engine_tp=2, cuda=True, engine_gpus=2)
    assert wide.groups == ((0, 1, 2, 3),) and wide.devices(0) == [4, 5]
    with pytest.raises(ValueError, match="leave rollout.replicas at auto"):
        Replicas.place(nodes, 2, cuda=True, engine_gpus=2)
    with pytest.raises(ValueError, match="use a multiple of it"):
        Replicas.place(nodes, "auto", engine_tp=2, cuda=True, engine_gpus=3)
    # on CPU engine_gpus means nothing: the colocated placement
    assert Replicas.place(nodes, "auto", engine_gpus=2) == Replicas.place(nodes, "auto")


def test_cpu_cores_split_between_engines_and_the_trainer():
    assert split_cores([0, 1], engine_cores=1, engines=1, engine=0) == ([1], [0])
    assert split_cores([0, 1], engine_cores=1, engines=1, engine=None) == ([], [0])
    # two engines share the last 4 of 8 cores (an unordered mask is sorted first)
    cores = [7, 6, 5, 4, 3, 2, 1, 0]
    assert split_cores(cores, engine_cores=4, engines=2, engine=1) == ([6, 7], [0, 1, 2, 3])
    assert split_cores(cores, engine_cores=4, engines=2, engine=0, tp=2).engine == [4, 5]
    with pytest.raises(ValueError, match="leaves the trainer none"):
        split_cores([0, 1], engine_cores=2, engines=1, engine=0)
    with pytest.raises(ValueError, match="raise it to 4"):
        split_cores(cores, engine_cores=3, engines=2, engine=0, tp=2)
    assert omp_bind([4, 5, 6, 7], 2) == "4,5|6,7" and omp_bind([1], 1) == "1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_bind_process_binds_every_thread_and_the_threads_started_later():
    before = os.sched_getaffinity(0)
    core = max(before)
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)
    early.start()
    try:
        assert process_cores(os.getpid()) == before
        bind_process(os.getpid(), [core])
        late = threading.Thread(target=stop.wait)
        late.start()
        tasks = os.listdir("/proc/self/task")
        assert len(tasks) >= 3  # this thread, early, late
        assert all(os.sched_getaffinity(int(t)) == {core} for t in tasks)
        assert process_cores(os.getpid()) == {core}
    finally:
        bind_process(os.getpid(), before)
        stop.set()
    assert os.sched_getaffinity(0) == before


def _group(position: int) -> ScoredGroup:
    return ScoredGroup(
        position=position,
        problem_id=f"p{position}",
        answer="4",
        prompt_ids=[1, 2, 3],
        completions=[Completion([5, 6], [-0.25, -1.5], "stop")],
        texts=["ab"],
        rewards=[0.5],
        parts={"accuracy": [0.5]},
        correct=[0.0],
    )


def test_policy_lag_is_the_steps_between_the_sampling_weights_and_the_trained_ones():
    # collected at step k: the weights after k - 1, lag 0; made ahead during step k - 1: the
    # weights after k - 2, lag 1
    assert StepRollouts(scored=[], policy_step=4).lag(5) == 0
    assert StepRollouts(scored=[], policy_step=3).lag(5) == 1


def test_the_next_steps_rollouts_go_with_the_loop_state(tmp_path):
    sampler = PromptSampler(10, seed=0)
    sampler.next_indices(4)
    ahead = StepRollouts(
        scored=[_group(0), _group(1)], policy_step=1, seconds={"rollout": 0.5, "reward": 0.125}
    )
    state = LoopState(step=2, sampler=sampler, ahead=ahead)
    torch.save(state.objects(), tmp_path / "objects.pt")
    fresh = LoopState(step=0, sampler=PromptSampler(10, seed=0))
    fresh.load_state_dict(
        state.state_dict(), torch.load(tmp_path / "objects.pt", weights_only=False)
    )
    assert fresh.step == 2 and fresh.ahead == ahead
    assert fresh.sampler.next_indices(3) == sampler.next_indices(3)
    # a synchronous checkpoint holds none, and loading it clears what was there
    assert LoopState(step=1, sampler=sampler).objects() == {}
    fresh.load_state_dict(state.state_dict())
    assert fresh.ahead is None
