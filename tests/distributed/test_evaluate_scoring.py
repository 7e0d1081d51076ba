"""avg@n, pass@k and distinct final answers of scored completions: the evaluation runner with
the accuracy reward (its timeout pool of worker processes) on fixed completion texts."""

import pytest

from cwgrpo_megatron.data.prompts import Problem
from cwgrpo_megatron.eval.runner import evaluate, format_table
from cwgrpo_megatron.rollout import SamplingConfig
from cwgrpo_megatron.rollout.base import Completion, RolloutGroup


class ScriptedEngine:
    """Returns fixed completion texts (a test double for the scoring path only)."""

    max_model_len = 4096
    version = 0

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, n, sampling, *, seeds=None):
        groups = []
        for i, prompt in enumerate(prompts):
            ids = [self.tokenizer(t)["input_ids"] for t in self.texts[i][:n]]
            completions = [Completion(x, [0.0] * len(x), "stop") for x in ids]
            groups.append(RolloutGroup(list(prompt), completions, 0))
        return groups


def test_avg_pass_at_k_and_distinct_answers_from_scored_completions():
    from cwgrpo_megatron.data.tokenizers import qwen25_tokenizer

    tok = qwen25_tokenizer()
    problems = [
        Problem(id="a", problem="1+1?", answer="2"),
        Problem(id="b", problem="2+2?", answer="4"),
    ]
    texts = [
        ["so \\boxed{2}", "\\boxed{3}", "\\boxed{2}", "no answer"],  # 2 of 4
        ["\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}"],  # 0 of 4
    ]
    result = evaluate(
        ScriptedEngine(tok, texts),
        tok,
        {"toy": problems},
        n=4,
        sampling=SamplingConfig(max_tokens=8, seed=0),
        progress=False,
    )
    toy = result["summary"]["toy"]
    assert toy["avg@4"] == pytest.approx((0.5 + 0.0) / 2) and toy["pass@4"] == pytest.approx(0.5)
    # pass@2 = 1 - C(2, 2) / C(4, 2) = 5/6 for a, 0 for b
    assert toy["pass@2"] == pytest.approx(5 / 12)
    assert [s["score"] for s in result["samples"]] == [1, 0, 1, 0, 0, 0, 0, 0]
    answers = [s["final_answer"] for s in result["samples"]]
    assert answers == ["2", "3", "2", None, "5", "5", "5", "5"]
    assert toy["distinct_answers"] == pytest.approx((2 + 1) / 2)
    assert set(result["summary"]["average"]) == {"avg@4", "pass@2", "pass@4", "distinct_answers"}
    rows = format_table(result["summary"], 4).splitlines()
    assert rows[0].split() == ["benchmark", "avg@4", "pass@2", "pass@4", "distinct", "problems",
                               "skipped"]  # fmt: skip
    assert rows[1].split() == ["toy", "25.0", "41.7", "50.0", "1.50", "2", "0"]
