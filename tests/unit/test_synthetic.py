"""Synthetic integer tasks: seeded, distinct, a disjoint held-out split, and their reward."""

import pytest

from cwgrpo_megatron.config import DataConfig
from cwgrpo_megatron.data.prompt_set import build_prompt_sets
from cwgrpo_megatron.data.prompts import PromptFormat, load_problems
from cwgrpo_megatron.data.synthetic import SYNTHETIC_TASKS, generate, parse_source
from cwgrpo_megatron.reward import WeightedReward, first_integer, get_reward


@pytest.mark.parametrize("task", SYNTHETIC_TASKS.names())
def test_tasks_are_seeded_distinct_and_answer_as_integers(task):
    rows = generate(task, 60, seed=3)
    assert rows == generate(task, 60, seed=3)
    assert rows != generate(task, 60, seed=4)
    assert len({r["problem"] for r in rows}) == 60
    assert all(str(int(r["answer"])) == r["answer"] for r in rows)


def test_the_answers_are_right():
    (row,) = generate("repeat", 1, seed=0)
    assert row["answer"] in row["problem"]
    for row in generate("add", 20):
        a, b = row["problem"].removeprefix("What is ").split("?")[0].split(" + ")
        assert int(row["answer"]) == int(a) + int(b)
    for row in generate("larger", 20):
        asked = row["problem"].splitlines()[-1]
        a, b = asked.removeprefix("Which number is larger, ").split("?")[0].split(" or ")
        assert int(row["answer"]) == max(int(a), int(b))
    for row in generate("successor", 20):
        n = row["problem"].split("after ")[1].split("?")[0]
        assert int(row["answer"]) == int(n) + 1
    for task, count in (("largest3", 3), ("largest5", 5)):
        for row in generate(task, 20):
            asked = row["problem"].splitlines()[-1].removeprefix("Which number is largest: ")
            numbers = [int(x) for x in asked.split("?")[0].split(", ")]
            assert len(numbers) == count and int(row["answer"]) == max(numbers)


def test_a_synthetic_task_is_an_evaluation_benchmark_under_its_name():
    from cwgrpo_megatron.config import EvalConfig
    from cwgrpo_megatron.eval.runner import benchmark_scorer, load_benchmarks

    entry = "synthetic:largest5?n=8&seed=7"
    EvalConfig(benchmarks=["heldout", entry])  # accepted as a source
    (name, problems), = load_benchmarks([entry]).items()  # fmt: skip
    assert name == "largest5" and len(problems) == 8
    assert [p.answer for p in problems] == [r["answer"] for r in generate("largest5", 8, seed=7)]
    assert benchmark_scorer(name) is None  # scored by the run's verifier (integer_answer)


def test_source_options_and_errors():
    assert parse_source("synthetic:add") == ("add", 2000, 0)
    assert parse_source("synthetic:larger?n=50&seed=7") == ("larger", 50, 7)
    with pytest.raises(ValueError, match="choose one of: add, larger, largest3, largest5, repeat"):
        parse_source("synthetic:multiply")
    with pytest.raises(ValueError, match="unknown option"):
        parse_source("synthetic:add?size=3")
    with pytest.raises(ValueError, match="must be integers"):
        parse_source("synthetic:add?n=many")
    with pytest.raises(ValueError, match=r"only 100 distinct problems.*synthetic:add\?n=100"):
        generate("add", 101)
    problems, stats = load_problems("synthetic:successor?n=7&seed=1")
    assert len(problems) == stats.rows == 7
    assert [p.answer for p in problems] == [r["answer"] for r in generate("successor", 7, 1)]


class _WordTokenizer:
    """Enough of a tokenizer for build_prompt_sets: one id per character."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 500 for c in t] for t in texts]}


def test_the_heldout_split_shares_no_problem_with_training():
    cfg = DataConfig(train_files=["synthetic:repeat?n=300&seed=2"], heldout_size=40, seed=5)
    fmt = PromptFormat(template="plain", use_tokenizer_template=False)
    train, held, report = build_prompt_sets(cfg, _WordTokenizer(), fmt)
    assert (report.train, report.heldout) == (260, 40)
    assert not {p.problem for p in train.problems} & {p.problem for p in held.problems}
    again = build_prompt_sets(cfg, _WordTokenizer(), fmt)[1]
    assert [p.id for p in again.problems] == [p.id for p in held.problems]


def test_integer_answer_reads_the_first_integer():
    assert first_integer("The answer is 4821.") == 4821
    assert first_integer("-12 apples, not 3") == -12
    assert first_integer("4,821") == 4
    assert first_integer("no digits") is None
    reward = get_reward("integer_answer")
    completions = ["4821", " 4821<|im_end|>", "It is 4812", "4821 or 4822", "none", "x4821y"]
    assert reward(completions=completions, answers=["4821"] * 6) == [1, 1, 0, 1, 0, 1]
    assert (reward.stats.total, reward.stats.correct, reward.stats.no_answer) == (6, 4, 1)
    with pytest.raises(ValueError, match="integer gold answers, got '3/4'"):
        reward(completions=["3"], answers=["3/4"])


def test_integer_answer_as_the_verifier_decides_correct():
    with WeightedReward({"integer_answer": 1.0}, verifier="integer_answer") as reward:
        scores = reward.score(
            completions=["58", "The larger is 67", "67"], answers=["58", "67", "5"]
        )
    assert scores.correct == [1.0, 1.0, 0.0]
    assert scores.total == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="choose one of: accuracy, integer_answer"):
        WeightedReward({"format": 1.0}, verifier="regex")
