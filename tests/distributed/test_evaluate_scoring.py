"""avg@n and pass@n of scored completions: the evaluation runner with the accuracy reward (its
timeout pool of worker processes) on fixed completion texts."""

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


def test_avg_and_pass_at_n_from_scored_completions():
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
    assert [s["score"] for s in result["samples"]] == [1, 0, 1, 0, 0, 0, 0, 0]
    assert "toy" in format_table(result["summary"], 4)
