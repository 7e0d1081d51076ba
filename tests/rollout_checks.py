"""Checks every rollout backend must pass, on the tiny Qwen2 of `checks.tiny`.

Each check takes (engine, hf_dir) and raises AssertionError on failure. The torch backend runs
them in the pytest process (tests/unit/test_rollout_torch.py); the vLLM backend runs them all in
one harness worker process around one engine (tests/distributed/test_rollout_vllm.py), because an
in-process vLLM engine changes process-wide state (torch.distributed, RNG, env).
"""

from __future__ import annotations

import math

import pytest
import torch

from cwgrpo_megatron.rollout import SamplingConfig
from cwgrpo_megatron.rollout.torch_engine import filter_logits

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
MAX_MODEL_LEN = 256
# spans a whole KV-cache block (vLLM's CPU blocks hold 128 tokens), so the prefix cache keeps it
CACHED_PROMPTS = [*PROMPTS, list(range(100, 260))]


def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, completion, sampling: SamplingConfig) -> torch.Tensor:
    """log_softmax of HF's logits / T, filtered by top-k / top-p, at each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / sampling.temperature
    z = filter_logits(logits, top_k=sampling.top_k, top_p=sampling.top_p)
    return torch.log_softmax(z, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def check_generation(engine, hf_dir):
    sampling = SamplingConfig(temperature=0.7, max_tokens=8, seed=11)
    groups = engine.generate(PROMPTS, 3, sampling)
    assert len(groups) == len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert group.prompt_ids == prompt and group.policy_version == engine.version
        assert len(group.completions) == 3
        for c in group.completions:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
            # a random model of 512 tokens rarely samples the end token in 8 steps
            expected = "stop" if c.token_ids[-1] == 0 else "length"
            assert c.finish_reason == expected
            if expected == "length":
                assert len(c.token_ids) == 8
    # 9 completions of 8 random tokens: all distinct unless sampling ignored the seed per row
    assert len({tuple(c.token_ids) for g in groups for c in g.completions}) == 9


def check_seeded(engine, hf_dir):
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=3)
    first = engine.generate(PROMPTS, 2, sampling)
    again = engine.generate(PROMPTS, 2, sampling)
    other = engine.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_tokens=6, seed=4))

    def ids(groups):
        return [[c.token_ids for c in g.completions] for g in groups]

    assert ids(first) == ids(again)
    assert ids(first) != ids(other)


def check_prompt_seeds(engine, hf_dir):
    """With a seed per prompt, a prompt's samples do not depend on the rest of the call (its
    position, its neighbours): what makes rollouts a function of (seed, step, prompt)."""
    sampling = SamplingConfig(temperature=1.0, max_tokens=6)
    together = engine.generate(PROMPTS, 2, sampling, seeds=[100, 200, 300])
    alone = engine.generate([PROMPTS[1]], 2, sampling, seeds=[200])
    moved = engine.generate([PROMPTS[2], PROMPTS[1]], 2, sampling, seeds=[7, 200])

    def ids(group):
        return [c.token_ids for c in group.completions]

    assert ids(together[1]) == ids(alone[0]) == ids(moved[1])
    assert ids(together[1]) != ids(engine.generate([PROMPTS[1]], 2, sampling, seeds=[201])[0])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(PROMPTS, 2, sampling, seeds=[1, 2])


def check_logprobs_match_hf(engine, hf_dir):
    """Sampling log-probs are those of the distribution sampled from, plain and truncated."""
    model = hf_model(hf_dir)
    for sampling in (
        SamplingConfig(temperature=0.7, max_tokens=8, seed=5),
        SamplingConfig(temperature=1.3, top_p=0.9, top_k=50, max_tokens=8, seed=6),
    ):
        for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, 2, sampling), strict=True):
            for c in group.completions:
                ref = reference_logprobs(model, prompt, c.token_ids, sampling)
                got = torch.tensor(c.logprobs)
                assert (got - ref).abs().max() < 1e-4, (sampling, got, ref)


def check_prompt_logprobs(engine, hf_dir):
    model = hf_model(hf_dir)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8], list(range(20, 60))]
    for seq, got in zip(seqs, engine.prompt_logprobs(seqs), strict=True):
        ids = torch.tensor([seq])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])
        assert len(got) == len(seq) - 1
        assert (torch.tensor(got) - ref.squeeze(-1)).abs().max() < 1e-4


def check_bad_input(engine, hf_dir):
    ok = SamplingConfig(max_tokens=8, seed=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], 1, ok)
    with pytest.raises(ValueError, match="at least one completion"):
        engine.generate([[1, 2]], 0, ok)
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([], 1, ok)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 99999]], 1, ok)
    long = list(range(1, MAX_MODEL_LEN))  # leaves fewer than max_tokens positions
    with pytest.raises(ValueError, match="prompt 0 has 255 tokens.*long_prompt=truncate"):
        engine.generate([long], 1, ok)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        engine.prompt_logprobs([[3]])
    engine.long_prompt = "truncate"
    try:
        (group,) = engine.generate([long], 1, ok)
        assert group.truncated and group.prompt_ids == long[-(MAX_MODEL_LEN - 8) :]
    finally:
        engine.long_prompt = "error"


def _state_dict(hf_dir):
    return {k: v.clone() for k, v in hf_model(hf_dir).state_dict().items()}


def check_weight_update(engine, hf_dir):
    """Updated weights are used at once, with no stale KV blocks from the prefix cache; a
    planted change (the end token made to dominate) shows; restoring the weights brings the
    original samples back."""
    sampling = SamplingConfig(temperature=0.7, max_tokens=8, seed=2)
    engine.load_stream(_state_dict(hf_dir).items())
    version = engine.version

    def sample():
        return [
            c.token_ids for g in engine.generate(CACHED_PROMPTS, 2, sampling) for c in g.completions
        ]

    original = sample()  # also fills the prefix cache with the long prompt's KV blocks
    changed = _state_dict(hf_dir)
    for name, tensor in changed.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensor.mul_(3.0)  # different keys and values for every cached position
    engine.load_stream(changed.items())
    model = hf_model(hf_dir)
    model.load_state_dict(changed)
    groups = engine.generate(CACHED_PROMPTS, 2, sampling)
    for prompt, group in zip(CACHED_PROMPTS, groups, strict=True):
        for c in group.completions:
            ref = reference_logprobs(model, prompt, c.token_ids, sampling)
            assert (torch.tensor(c.logprobs) - ref).abs().max() < 1e-4, "stale weights or KV"

    planted = _state_dict(hf_dir)
    for name, tensor in planted.items():  # the residual stream becomes the token embedding ...
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    planted["model.embed_tokens.weight"][:, 0] = 1.0  # ... whose unit 0 is positive
    planted["lm_head.weight"].zero_()
    planted["lm_head.weight"][:, 0] = -50.0  # so the end token (id 0) leads every other
    planted["lm_head.weight"][0, 0] = 50.0  # by 100 h_0 >> 1
    engine.load_stream(planted.items())
    assert engine.version == version + 2
    groups = engine.generate(CACHED_PROMPTS, 2, sampling)
    assert all(g.policy_version == version + 2 for g in groups)
    for c in (c for g in groups for c in g.completions):
        assert c.token_ids == [0] and c.finish_reason == "stop" and c.logprobs[0] > -1e-3

    engine.load_stream(_state_dict(hf_dir).items())
    assert sample() == original and engine.version == version + 3
    from cwgrpo_megatron.rollout.vllm_engine import VLLMEngine

    if isinstance(engine, VLLMEngine) and not torch.cuda.is_available():
        assert engine.last_load == "in_place"  # on CPU vLLM loads every update in place


def check_bad_weight_update(engine, hf_dir):
    """A bad update fails clearly and leaves a working engine."""
    sampling = SamplingConfig(temperature=0.7, max_tokens=8, seed=9)
    engine.load_stream(_state_dict(hf_dir).items())
    reference = [c.token_ids for g in engine.generate(PROMPTS, 1, sampling) for c in g.completions]
    for change, message in (
        (lambda w: w.update({"model.extra.weight": torch.zeros(2)}), "unknown tensor"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), r"shape \(3,\)"),
        (lambda w: w.pop("model.layers.1.mlp.down_proj.weight"), "missing 1 tensors"),
    ):
        weights = _state_dict(hf_dir)
        change(weights)
        with pytest.raises(ValueError, match=message):
            engine.load_stream(weights.items())
        tokens = [c.token_ids for g in engine.generate(PROMPTS, 1, sampling) for c in g.completions]
        assert tokens == reference  # back on the checkpoint's weights, still generating


def check_trainer_state(engine, hf_dir):
    """Generating leaves the trainer's RNG, thread count and set_num_threads alone."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    engine.generate(PROMPTS, 2, SamplingConfig(max_tokens=4))  # unseeded: the engine's seeds
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # still a working function, not vLLM's no-op
    torch.set_num_threads(threads)


CHECKS = {
    name[len("check_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")
}
