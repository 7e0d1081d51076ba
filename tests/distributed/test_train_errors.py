"""Bad input to the trainer: a clear error on every rank, no rank left waiting, and the
checkpoints of earlier runs intact. Two gloo processes at TP2 (so that some failures happen on
one rank only) run every case in turn through `cwgrpo_megatron.train.run`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from tests.distributed.harness import run_distributed
from tests.once import build_once

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def _cases(root: Path, model: Path) -> dict[str, list[str]]:
    good = root / "good.jsonl"
    good.write_text(
        "".join(
            json.dumps({"problem": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(12)
        )
    )
    bad = root / "bad.jsonl"
    bad.write_text(good.read_text() + '{"problem": "no answer"}\n')
    blocker = root / "a_file"
    blocker.write_text("")

    def args(out: str, *extra: str) -> list[str]:
        return [
            "--config",
            str(TINY),
            f"model.path={model}",
            f"run.out_dir={root / out}",
            f"data.train_files=[{good}]",
            "data.heldout_size=0",
            "eval.benchmarks=[]",
            "rollout.backend=torch",
            "parallel.tp=2",
            *extra,
        ]

    return {
        "missing-model": args("m", f"model.path={root / 'no_such_model'}"),
        "malformed-row": args(
            "r", f"data.train_files=[{bad}]", "data.schema=answer", "data.skip_bad_rows=false"
        ),
        "all-prompts-too-long": args("l", "data.max_prompt_tokens=2"),
        # the tiny model has 256 positions: within rollout.max_model_len, beyond the model
        "longer-than-positions": args("p", "rollout.max_tokens=240", "rollout.max_model_len=300"),
        "unknown-key": args("k", "train.sead=1"),
        "batch-algebra": args("b", "parallel.tp=1", "train.prompts_per_step=3"),
        "unwritable-out-dir": args("u", f"run.out_dir={blocker / 'run'}"),
        "first-step": args("w", "train.total_steps=1"),
        "reward-raises": args(
            "w", "train.total_steps=3", "reward.weights={explodes: 1.0}", "run.resume=auto"
        ),
        # the random model is never right: every group's accuracy rewards are equal
        "no-reward-signal": args("n", *DYNAMIC, "reward.weights={accuracy: 1.0}"),
        # 3 rounds of 4 draw the 12 problems once: only "0 + 0"'s group has a signal
        "short-step": args("s", *DYNAMIC, "train.total_steps=1", "reward.weights={zero: 1.0}"),
        "short-step-unsplittable": args(
            "t",
            *DYNAMIC,
            "train.ppo_mini_batches=2",
            "train.total_steps=2",
            "reward.weights={zero: 1.0}",
        ),  # fmt: skip
    }


DYNAMIC = ("train.dynamic_sampling=true", "train.max_gen_batches=3")


def _run_cases(rank, world_size, root: str, model: str) -> dict:
    import torch

    from cwgrpo_megatron.reward import Reward, register_reward
    from cwgrpo_megatron.train import run

    torch.set_num_threads(1)

    @register_reward("explodes")
    class Explodes(Reward):
        def __call__(self, *, completions, answers, **_):
            raise RuntimeError("the reward server is down")

    @register_reward("zero")
    class SpreadOnZero(Reward):
        """0, 1, 0, 1, ... on the completions of the problem whose answer is 0; else 0."""

        def __call__(self, *, completions, answers, **_):
            return [float(a == "0" and i % 2) for i, a in enumerate(answers)]

    out = {}
    for name, argv in _cases(Path(root), Path(model)).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = run(argv)
        out[name] = (code, err.getvalue())
    return out


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """Every case, once per session (`tests/once.py`): the run folders and each rank's
    outcomes."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    def build(root: Path):
        model = save_tiny_qwen2(root / "tiny", end_tokens=32)
        return root, run_distributed(_run_cases, 2, str(root), str(model), timeout=400)

    return build_once(tmp_path_factory, "train_errors", build)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        pytest.param("missing-model", "no_such_model' is not a folder", id="missing-model"),
        pytest.param("malformed-row", "bad.jsonl:13: field 'answer' is missing", id="bad-row"),
        pytest.param(
            "all-prompts-too-long",
            "all 12 prompts are longer than data.max_prompt_tokens=2",
            id="too-long",
        ),
        pytest.param(
            "longer-than-positions",
            "data.max_prompt_tokens=48 + rollout.max_tokens=240 = 288 tokens exceed model.path's "
            "max_position_embeddings=256: lower rollout.max_tokens to 208 or less, or "
            "data.max_prompt_tokens",
            id="positions",
        ),
        pytest.param("unknown-key", "unknown key 'train.sead'", id="unknown-key"),
        pytest.param(
            "batch-algebra", "3 prompts per mini-batch do not split over dp=2", id="algebra"
        ),
        pytest.param("unwritable-out-dir", "cannot be written", id="out-dir"),
        pytest.param("reward-raises", "the reward server is down", id="reward"),
        pytest.param(
            "no-reward-signal",
            "3 rounds (train.max_gen_batches) of 4 prompts (train.gen_prompts_per_step) gave "
            "0 of the 4 groups",
            id="no-signal",
        ),
        pytest.param(
            "short-step-unsplittable",
            "gave 1 of the 4 groups with a reward std >= train.dynamic_sampling_eps=1e-06 that "
            "a step needs, and 1 prompts do not split into 2 mini-batches",
            id="short-step",
        ),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(case, message, results):
    _, per_rank = results
    for rank, outcome in enumerate(per_rank):
        code, err = outcome[case]
        assert code == 1, f"rank {rank} exited {code}:\n{err}"
        assert message in err, f"rank {rank} said:\n{err}"
        assert "Traceback" not in err, f"rank {rank} printed a traceback for bad input:\n{err}"


def test_a_failure_on_one_rank_names_that_rank_on_the_others(results):
    _, (rank0, rank1) = results
    # only rank 0 prepares the run folder, only the TP leader scores: rank 1 learns it from them
    for case in ("unwritable-out-dir", "reward-raises"):
        assert "failed on rank 0" in rank1[case][1], rank1[case][1]
        assert "failed on rank" not in rank0[case][1]


def test_a_failed_step_keeps_the_earlier_checkpoints(results):
    root, (rank0, _) = results
    assert rank0["first-step"][0] == 0, rank0["first-step"][1]
    checkpoints = root / "w" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000001"]
    assert (checkpoints / "step_00000001" / "train_state.json").is_file()
    rows = [json.loads(x) for x in (root / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_a_short_dynamic_step_trains_on_the_groups_it_has_with_a_warning(results):
    root, (rank0, rank1) = results
    code, err = rank0["short-step"]
    assert code == 0 and rank1["short-step"][0] == 0, err
    assert "dynamic sampling: 3 rounds gave 1 of 4 groups with a reward signal" in err
    (row,) = [json.loads(x) for x in (root / "s" / "metrics.jsonl").read_text().splitlines()]
    assert row["dynamic/rounds"] == 3 and row["dynamic/groups_generated"] == 12
    assert row["dynamic/groups_kept"] == 1 and row["dynamic/cap_reached"] == 1
    assert row["groups/frac_zero_std"] == 0 and row["reward/mean"] == 0.5
