"""Rollouts made ahead (rollout.async_steps = 1): each rank's background thread generates and
scores while its main thread works (here: a gloo all-reduce, as training makes), and
`Ahead.finish` gathers the step on every rank, or stops every rank with the error of the one
whose thread failed (gloo, 2 processes)."""

import pytest

from tests.distributed.harness import run_distributed


def _ahead_worker(rank, world, fail_rank):
    import time

    import torch
    import torch.distributed as dist

    from cwgrpo_megatron.components.rollouts import Ahead, _in_background
    from cwgrpo_megatron.reward.scoring import ScoredGroup
    from cwgrpo_megatron.rollout.base import Completion, EngineDeadError

    def work():
        time.sleep(0.3)  # still running when the main thread's collective starts
        if rank == fail_rank:
            raise EngineDeadError(f"the vLLM engine processes of rank {rank} died")
        groups = [
            ScoredGroup(
                position=position,
                problem_id=str(position),
                answer="1",
                prompt_ids=[1],
                completions=[Completion([2], [-0.5], "stop")],
                texts=["x"],
                rewards=[float(position)],
                parts={},
                correct=[0.0],
            )
            for position in (2 * rank + 1, 2 * rank)  # out of order on purpose
        ]
        return groups, {"rollout": 1.0 + rank, "reward": 0.25}

    ahead = Ahead(step=4, policy_step=2, future=_in_background(work, name="test-ahead"))
    total = torch.ones(1)
    dist.all_reduce(total)  # the trainer's own collectives go on meanwhile
    try:
        made = ahead.finish()
    except Exception as err:  # noqa: BLE001 - the test reports what each rank raised
        return {"error": f"{type(err).__name__}: {err}", "sum": total.item()}
    return {
        "positions": [g.position for g in made.scored],
        "seconds": made.seconds,
        "lag": made.lag(4),
        "sum": total.item(),
    }


def test_a_step_made_ahead_is_gathered_in_prompt_order_on_every_rank():
    results = run_distributed(_ahead_worker, 2, None)
    for result in results:
        assert result["sum"] == 2.0
        assert result["positions"] == [0, 1, 2, 3]
        assert result["seconds"] == {"rollout": 2.0, "reward": 0.25}  # the slowest owner's
        assert result["lag"] == 1


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failed_background_generation_stops_every_rank(fail_rank):
    results = run_distributed(_ahead_worker, 2, fail_rank)
    died = f"the vLLM engine processes of rank {fail_rank} died"
    assert results[fail_rank]["error"] == f"EngineDeadError: {died}"
    other = results[1 - fail_rank]["error"]
    assert other == (
        f"PeerFailure: generating step 4's rollouts ahead failed on rank {fail_rank}: "
        f"EngineDeadError: {died}"
    )
