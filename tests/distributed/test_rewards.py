"""Rewards that verify answers with math-verify in its timeout pool of worker processes:
accuracy, cosine length, weighted sums that verify once, and the pool itself. Rewards without
the pool are tested in tests/unit/test_rewards.py."""

import math
import os
import signal
import time

import pytest

from cwgrpo_megatron.reward import WeightedReward, get_reward
from cwgrpo_megatron.reward.pool import TimeoutPool
from cwgrpo_megatron.reward.verify import answer_region, last_boxed

# (gold answer, boxed prediction, equal?)
PAIRS = [
    pytest.param("1/2", "0.5", True, id="fraction-decimal"),
    pytest.param("\\frac{1}{2}", "\\dfrac{1}{2}", True, id="dfrac"),
    pytest.param("\\frac{3}{4}", "0.75", True, id="frac-decimal"),
    pytest.param("\\frac{1}{3}", "0.33", False, id="rounded-third"),
    pytest.param("2/4", "\\frac{1}{2}", True, id="unreduced"),
    pytest.param("\\dfrac{5}{2}", "2.5", True, id="dfrac-decimal"),
    pytest.param("\\tfrac{1}{4}", "0.25", True, id="tfrac"),
    pytest.param("0.1", "\\frac{1}{10}", True, id="decimal-frac"),
    pytest.param("(0,1)", "(0,1)", True, id="open-interval"),
    pytest.param("(0,1)", "[0,1]", False, id="open-vs-closed"),
    pytest.param("[2,5)", "[2,5)", True, id="half-open"),
    pytest.param("[2,5)", "[2,5]", False, id="half-open-vs-closed"),
    pytest.param("\\{1,2,3\\}", "\\{3,2,1\\}", True, id="set-order"),
    pytest.param("\\{1,2\\}", "\\{1,2,3\\}", False, id="set-extra"),
    pytest.param("1,2", "2,1", True, id="unordered-list"),
    pytest.param("30^\\circ", "30", True, id="degrees-dropped"),
    pytest.param("45^{\\circ}", "45^\\circ", True, id="degrees-both"),
    pytest.param("30^\\circ", "60", False, id="degrees-wrong"),
    pytest.param("5 \\text{ cm}", "5", True, id="unit-cm"),
    pytest.param("12 \\text{ meters}", "12", True, id="unit-meters"),
    pytest.param("7\\text{ dollars}", "8", False, id="unit-wrong"),
    pytest.param("33", "033", True, id="leading-zero-pred"),
    pytest.param("033", "33", True, id="leading-zero-gold"),
    pytest.param("33", "034", False, id="leading-zero-wrong"),
    pytest.param(
        "123456789012345678901234567890", "123456789012345678901234567890", True, id="big-int"
    ),
    pytest.param(
        "123456789012345678901234567890",
        "123456789012345678901234567891",
        False,
        id="big-int-off-by-one",
    ),
    pytest.param("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True, id="radical-frac"),
    pytest.param("2\\sqrt{3}", "\\sqrt{12}", True, id="radical-simplify"),
    pytest.param("\\sqrt{2}", "\\sqrt{3}", False, id="radical-wrong"),
    pytest.param("y=2x+1", "2x+1", True, id="equation-rhs"),
    pytest.param("x=5", "5", True, id="equation-value"),
    pytest.param("y=2x+1", "y=2x+2", False, id="equation-wrong"),
    pytest.param(
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        True,
        id="matrix",
    ),
    pytest.param(
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}",
        False,
        id="matrix-wrong",
    ),
    pytest.param("C", "C", True, id="choice"),
    pytest.param("C", "D", False, id="choice-wrong"),
    pytest.param("(B)", "B", True, id="choice-parens"),
    pytest.param("-3", "-3", True, id="negative"),
    pytest.param("-3", "3", False, id="sign"),
    pytest.param("2\\pi", "2\\pi", True, id="pi"),
    pytest.param("\\pi", "3.14159", False, id="pi-approx"),
    pytest.param("10^{3}", "1000", True, id="power"),
    pytest.param("x^2+2x+1", "(x+1)^2", True, id="polynomial"),
    pytest.param("\\infty", "\\infty", True, id="infinity"),
]


@pytest.fixture(scope="module")
def accuracy():
    reward = get_reward("accuracy", workers=2, timeout_s=10.0)
    yield reward
    reward.close()


def test_tricky_pairs(accuracy):
    golds = [p.values[0] for p in PAIRS]
    preds = [f"Thus the answer is \\boxed{{{p.values[1]}}}." for p in PAIRS]
    scores = accuracy(completions=preds, answers=golds)
    wrong = [p.id for p, s in zip(PAIRS, scores, strict=True) if (s == 1.0) != p.values[2]]
    assert not wrong, f"misjudged: {wrong}"
    assert sum(p.values[2] for p in PAIRS) >= 20 and sum(not p.values[2] for p in PAIRS) >= 14


def test_answer_is_the_last_box_after_think(accuracy):
    completions = [
        "<think>maybe \\boxed{5}</think> so \\boxed{6}",
        "<think>maybe \\boxed{5}</think> so \\boxed{6}",
        "first \\boxed{1} then \\boxed{\\frac{1}{2}}",
        "<think>the answer is \\boxed{7}</think> I am not sure.",
        "no box at all",
    ]
    scores = accuracy(completions=completions, answers=["6", "5", "0.5", "7", "1"])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert answer_region("x</think>y</think>z") == "z"


def test_pathological_inputs_return_within_the_timeout():
    polynomial = "+".join(f"{i}x^{{{i}}}" for i in range(400))
    with get_reward("accuracy", workers=2, timeout_s=3.0) as reward:
        start = time.monotonic()
        scores = reward(
            completions=["\\boxed{9^{9^{9^9}}}", f"\\boxed{{{polynomial}}}", "\\boxed{2}"],
            answers=["1", f"({polynomial})+1", "2"],
        )
        elapsed = time.monotonic() - start
    assert scores[0] == 0.0 and scores[1] == 0.0 and scores[2] == 1.0
    assert elapsed < 3.0 * 2 + 5, elapsed  # two rounds of the limit at most, plus start-up


def _slow_square(x):
    if x < 0:
        time.sleep(60)
    if x == 13:
        raise ValueError("unlucky")
    return x * x


def test_pool_kills_overruns_survives_crashes_and_killed_workers():
    with TimeoutPool(_slow_square, workers=2, timeout_s=1.0, default=-1) as pool:
        assert pool.map([(2,), (-1,), (3,), (13,)]) == [4, -1, 9, -1]
        assert pool.stats.timeouts == 1 and pool.stats.errors == 1
        assert "unlucky" in pool.stats.error_examples[0]
        for worker in pool._workers:  # a worker killed from outside, e.g. by the OOM killer
            os.kill(worker.proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert pool.map([(i,) for i in range(6)]) == [i * i for i in range(6)]
        assert pool.stats.restarts >= 3


def test_accuracy_counts_outcomes():
    with get_reward("accuracy", workers=1, timeout_s=10.0) as reward:
        reward(completions=["\\boxed{1}", "none", "\\boxed{2}"], answers=["1", "1", "3"])
        assert (reward.stats.total, reward.stats.correct, reward.stats.no_answer) == (3, 1, 1)
        with pytest.raises(ValueError, match="2 completions but 1 answers"):
            reward(completions=["a", "b"], answers=["1"])


def test_cosine_length_reward_is_clamped():
    with get_reward("cosine_length", max_len=100, workers=1) as reward:
        completions = ["\\boxed{4}"] * 4 + ["\\boxed{5}"] * 4
        lengths = [0, 50, 100, 5000] * 2
        scores = reward(completions=completions, answers=["4"] * 8, completion_lengths=lengths)
    correct, wrong = scores[:4], scores[4:]
    assert correct[:3] == pytest.approx([1.0, 0.75, 0.5])
    assert wrong[:3] == pytest.approx([-1.0, -0.75, -0.5])
    # past max_len the length is clamped: no wrap-around of cos back up
    assert correct[3] == pytest.approx(correct[2]) and wrong[3] == pytest.approx(wrong[2])
    assert math.isfinite(sum(scores))
    with pytest.raises(ValueError, match="completion_lengths"):
        get_reward("cosine_length")(completions=["a"], answers=["1"])


def test_weighted_reward_verifies_each_completion_once():
    """accuracy and cosine_length both need math-verify's verdict: one verification serves
    both, and score() returns each part, the sum and the verdict."""
    combo = WeightedReward(
        {"accuracy": 1.0, "cosine_length": 0.5, "format": 2.0},
        workers=1,
        timeout_s=10.0,
        options={"cosine_length": {"max_len": 10}},
    )
    completions = ["x\n</think>\n\\boxed{4}", "\\boxed{5}"]
    with combo:
        out = combo.score(completions=completions, answers=["4", "4"], completion_lengths=[0, 10])
        assert combo.stats.total == 2  # one verification per completion, not two
        assert out.correct == [1.0, 0.0]
        assert out.parts == {
            "accuracy": [1.0, 0.0],
            "cosine_length": pytest.approx([1.0, -0.5]),
            "format": [1.0, 0.0],
        }
        assert out.total == pytest.approx([1.0 + 0.5 + 2.0, 0.0 - 0.25 + 0.0])
        assert combo(completions=completions, answers=["4", "4"], completion_lengths=[0, 10]) == (
            pytest.approx(out.total)
        )
        assert combo.stats.total == 4
        # a part that needs no verdict does not start the verifier
        only_format = WeightedReward({"format": 1.0})
        assert only_format(completions=completions, answers=["", ""]) == [1.0, 0.0]
        assert only_format.stats.total == 0
