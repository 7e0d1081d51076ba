"""The shared-memory weight buffer: each rank's shards land in the right slices of the HF model."""

import os

import pytest
import torch

from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import hf_shapes, stage_params, to_megatron
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync import shm
from cwgrpo_megatron.weight_sync.plan import Place, SyncPlan
from tests.unit.test_mapping_arch import HF  # the same small Qwen2 (tie_word_embeddings varies)


@pytest.fixture
def buffers(tmp_path):
    made = []

    def make(shapes, dtype):
        made.append(shm.create(shapes, dtype, folder=str(tmp_path)))
        return made[-1]

    yield make
    for buffer in made:
        shm.remove(buffer)


def _random_model(arch: ModelArch) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in hf_shapes(arch).items()}


def _rank_params(hf, arch, *, tp, tp_rank, pp, pp_rank, te_spec):
    """What Megatron rank (tp_rank, pp_rank) holds: its shard of every parameter of its stage."""
    padded = padded_vocab_size(arch.vocab_size, tp=tp)
    return {
        item.megatron_name: to_megatron(
            item.rule,
            [hf[n] for n in item.hf_names],
            arch,
            tp=tp,
            tp_rank=tp_rank,
            padded_vocab=padded,
        )
        for item in stage_params(arch, pp_rank=pp_rank, pp=pp, te_spec=te_spec)
    }


@pytest.mark.parametrize("te_spec", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_writes_its_shards_and_the_buffer_is_the_hf_model(
    buffers, tied, tp, pp, dtype, te_spec
):
    """Under either layer spec's parameter names (Transformer Engine fuses the norms into the
    next linear layer), each element of the HF model is written once."""
    arch = ModelArch.from_hf_dict({**HF, "tie_word_embeddings": tied})
    hf = _random_model(arch)
    buffer = buffers(hf_shapes(arch), dtype)
    for view in shm.mapped(buffer).values():
        view.fill_(float("nan"))  # an element nobody writes stays NaN
    places = [Place(stage=s, tp_rank=t) for s in range(pp) for t in range(tp)]
    plan = SyncPlan.build(Replicas.single(len(places)), places)
    written = 0
    for _, shard in plan.writes:
        where = dict(tp=tp, tp_rank=shard.tp_rank, pp=pp, pp_rank=shard.stage, te_spec=te_spec)
        params = _rank_params(hf, arch, **where)
        written += shm.write_shards(buffer, params, arch, plan, shard, te_spec=te_spec)
    element = torch.empty((), dtype=dtype).element_size()
    assert written == sum(t.numel() for t in hf.values()) * element  # each element once
    # what the engine process reads: a fresh mapping of the same file
    fresh = shm.SharedWeights.from_message(buffer.to_message())._views()
    assert list(fresh) == list(hf)
    for name, tensor in hf.items():
        assert torch.equal(fresh[name], tensor.to(dtype)), name


def test_layout_is_aligned_and_travels_as_plain_types(buffers):
    arch = ModelArch.from_hf_dict(HF)
    buffer = buffers(hf_shapes(arch), torch.bfloat16)
    message = buffer.to_message()
    assert all(isinstance(v, (str, int, list)) for v in message.values())
    assert shm.SharedWeights.from_message(message) == buffer
    offsets = [e.offset for e in buffer.entries.values()]
    assert offsets == sorted(offsets)
    starts = {shm.fused_members(n, buffer.entries)[0] for n in buffer.entries}
    assert all(buffer.entries[n].offset % shm.ALIGN == 0 for n in starts)
    assert os.path.getsize(buffer.path) == buffer.nbytes
    assert buffer.visible()
    elsewhere = shm.SharedWeights.from_message({**message, "token": "another node's"})
    assert not elsewhere.visible()


def test_fused_projections_lie_back_to_back_and_read_as_one_view(buffers):
    # a checkpoint's (sorted) order, odd sizes: q, k, v and gate, up are still placed together
    shapes = {
        "model.layers.0.mlp.down_proj.weight": (5, 3),
        "model.layers.0.mlp.gate_proj.weight": (3, 5),
        "model.layers.0.mlp.up_proj.weight": (3, 5),
        "model.layers.0.self_attn.k_proj.bias": (1,),
        "model.layers.0.self_attn.o_proj.weight": (3, 3),
        "model.layers.0.self_attn.q_proj.bias": (3,),
        "model.layers.0.self_attn.v_proj.bias": (1,),
    }
    buffer = buffers(shapes, torch.bfloat16)
    views = shm.mapped(buffer)
    for view in views.values():
        view.copy_(torch.randn(view.shape))
    attn = [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    mlp = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
    for names in (attn, mlp):
        assert shm.fused_members(names[-1], shapes) == names
        fused = shm.span(buffer, names)
        assert torch.equal(fused, torch.cat([views[n] for n in names]))
        assert fused.data_ptr() == views[names[0]].data_ptr()  # a view, not a copy
        assert buffer.entries[names[0]].offset % shm.ALIGN == 0
    assert shm.span(buffer, mlp[::-1]) is None  # not in that order in memory
    assert shm.span(buffer, [mlp[0], "model.layers.0.mlp.down_proj.weight"]) is None
    assert shm.fused_members("model.layers.0.mlp.down_proj.weight", shapes) == [
        "model.layers.0.mlp.down_proj.weight"
    ]


def test_a_buffer_bigger_than_the_free_shared_memory_is_refused_up_front(tmp_path):
    huge = {"w": (1 << 26, 1 << 26)}  # 16 PiB in fp32
    with pytest.raises(RuntimeError, match="GiB of shared memory .* --shm-size"):
        shm.create(huge, torch.float32, folder=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing half-made
