"""Object collectives over the job's control group, a gloo group with run.collective_timeout_min:
a rank that never arrives stops the others with an error naming the key, instead of a hang
or NCCL's own timeout (gloo, 2 processes)."""

import time

from tests.distributed.harness import run_distributed


def _one_rank_late(rank, world, minutes, late_s):
    from cwgrpo_megatron.comm import (
        CollectiveTimeout,
        close_control_group,
        fail_together,
        open_control_group,
    )

    control = open_control_group(minutes)
    try:
        with fail_together("a phase", control):
            pass  # this rank's phase is done at once
        agreed = "agreed"
        started = time.monotonic()
        if rank == 1:
            time.sleep(late_s)  # the other rank's phase outlasts the timeout
        try:
            with fail_together("the next phase", control):
                pass
            return {"outcome": "agreed twice", "first": agreed}
        except CollectiveTimeout as err:
            return {"outcome": str(err), "waited": time.monotonic() - started}
        except RuntimeError as err:  # the late rank finds its peer gone
            return {"outcome": f"{type(err).__name__}: {err}"}
    finally:
        close_control_group(control)


def test_a_rank_that_does_not_arrive_is_a_timeout_that_names_the_key():
    early, late = run_distributed(_one_rank_late, 2, 0.05, 8.0, timeout=120)
    assert "run.collective_timeout_min=0.05 minutes" in early["outcome"], early
    assert 2.5 < early["waited"] < 8.0, early  # 3 s, not the late rank's 8 s or a hang
    assert late["outcome"] != "agreed twice", late


def test_on_time_ranks_agree_over_the_control_group():
    results = run_distributed(_one_rank_late, 2, 0.5, 0.0, timeout=120)
    assert [r["outcome"] for r in results] == ["agreed twice", "agreed twice"]
