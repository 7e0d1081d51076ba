"""Engine replica placement (`rollout.replicas`), prompt shares, and the weight sync plan:
who writes which shard and what crosses the network, on hand-made layouts."""

import pytest
import torch

from cwgrpo_megatron.checks.tiny import TINY_ENGINE_QWEN2
from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync.plan import Place, SyncPlan, sent_items, written_items


def test_per_node_and_counted_replicas_split_each_node_into_consecutive_groups():
    nodes = ["a"] * 4 + ["b"] * 4
    per_node = Replicas.place(nodes, "per_node")
    assert per_node.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and per_node.owners == (0, 4)
    assert per_node.nodes == (0,) * 4 + (1,) * 4
    four = Replicas.place(nodes, 4, engine_tp=2)
    assert four.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [four.devices(r) for r in range(4)] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [four.owned_by(r) for r in range(8)] == [0, None, 1, None, 2, None, 3, None]
    assert four.owners_on(1) == (4, 6)
    # a node is a label (torchrun's node rank or a host name), numbered by first appearance
    interleaved = Replicas.place(["y", "x", "y", "x"], "per_node")
    assert interleaved.groups == ((0, 2), (1, 3)) and interleaved.devices(1) == [0]
    assert Replicas.single(3) == Replicas.place([0, 0, 0], 1)
    # fewer replicas than nodes: one on each of the first nodes, none on the others
    assert Replicas.place(nodes, 1).groups == ((0, 1, 2, 3),)
    assert Replicas.place([0, 1, 2], 2).groups == ((0,), (1,))


@pytest.mark.parametrize(
    ("nodes", "replicas", "engine_tp", "match"),
    [
        pytest.param([0, 0, 1, 1], 3, 1, "does not split over 2 nodes", id="not-a-multiple"),
        pytest.param([0, 0, 1, 1, 2, 2], 4, 1, "does not split over 3 nodes", id="4-on-3-nodes"),
        pytest.param([0, 0, 0, 1, 1, 1], 4, 1, "do not split into 2 replicas", id="uneven"),
        pytest.param([0, 0, 1, 1], "per_node", 4, "rollout.tp=4", id="tp-over-group"),
    ],
)
def test_impossible_placements_say_what_to_change(nodes, replicas, engine_tp, match):
    with pytest.raises(ValueError, match=match):
        Replicas.place(nodes, replicas, engine_tp=engine_tp)


@pytest.mark.parametrize("prompts", [1, 3, 8, 12])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_prompt_shares_cover_the_step_once_in_order(prompts, count):
    replicas = Replicas.place(list(range(count)), "per_node")
    shares = [list(replicas.share(r, prompts)) for r in range(count)]
    assert [p for share in shares for p in share] == list(range(prompts))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_rollout_replicas_and_tp_in_the_config():
    cfg = load_config(None, ["rollout.replicas=4", "rollout.tp=2"])
    assert (cfg.rollout.replicas, cfg.rollout.tp) == (4, 2)
    assert load_config(None, []).rollout.replicas == "auto"
    for bad in ("rollout.replicas=0", "rollout.replicas=each_gpu"):
        with pytest.raises(ValueError, match="auto, per_node or a positive integer"):
            load_config(None, [bad])


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("engine_tp", [1, 2, 4, 8])
def test_auto_puts_an_engine_on_every_engine_tp_gpus_of_every_node(nodes, engine_tp):
    """8 GPUs a node: each run of `engine_tp` consecutive local GPUs is one engine, owned by
    its lowest rank, on exactly those GPUs (its CUDA_VISIBLE_DEVICES)."""
    ranks = [node for node in range(nodes) for _ in range(8)]
    replicas = Replicas.place(ranks, "auto", engine_tp=engine_tp, cuda=True)
    per_node = 8 // engine_tp
    assert len(replicas.groups) == nodes * per_node
    assert replicas.owners == tuple(range(0, 8 * nodes, engine_tp))
    for replica, owner in enumerate(replicas.owners):
        local = owner % 8
        assert replicas.devices(replica) == list(range(local, local + engine_tp))
        assert replicas.groups[replica] == tuple(range(owner, owner + engine_tp))
    # every GPU of the job belongs to exactly one engine
    assert sorted(r for g in replicas.groups for r in g) == list(range(8 * nodes))


def test_the_ranks_on_an_engines_gpus_are_the_ones_that_release_cached_blocks():
    two_nodes = [0] * 4 + [1] * 4
    auto = Replicas.place(two_nodes, "auto", engine_tp=2, cuda=True)
    assert all(auto.shares_gpu(rank) for rank in range(8))  # every GPU hosts an engine
    # one engine per node at TP2: its GPUs are local 0 and 1 of each node
    per_node = Replicas.place(two_nodes, "per_node", engine_tp=2, cuda=True)
    assert [per_node.shares_gpu(rank) for rank in range(8)] == [True, True, False, False] * 2
    one = Replicas.place(two_nodes, 1, engine_tp=1, cuda=True)  # on rank 0's GPU alone
    assert [one.shares_gpu(rank) for rank in range(8)] == [True] + [False] * 7


def test_auto_on_cpu_is_one_engine_a_node_and_an_uneven_gpu_split_is_an_error():
    ranks = [0, 0, 1, 1]
    assert Replicas.place(ranks, "auto") == Replicas.place(ranks, "per_node")
    with pytest.raises(ValueError, match="node of 6 GPUs does not split into engines of "):
        Replicas.place([0] * 6, "auto", engine_tp=4, cuda=True)


def _arch(**changes) -> ModelArch:
    config = {**TINY_ENGINE_QWEN2, "num_hidden_layers": 4, **changes}
    return ModelArch.from_hf_dict({**config, "architectures": ["Qwen2ForCausalLM"]})


def _places(tp: int, pp: int, dp: int) -> list[Place]:
    """Megatron's rank order (tp fastest, then dp, then pp)."""
    return [
        Place(stage=r // (tp * dp), tp_rank=r % tp) for r in range(tp * pp * dp)
    ]  # fmt: skip


def test_a_node_that_holds_every_shard_writes_them_and_receives_nothing():
    places = _places(tp=2, pp=2, dp=2)  # 8 ranks on one node
    plan = SyncPlan.build(Replicas.single(8), places)
    assert plan.transfers == ()
    # data-parallel rank 0's copy: the first holder of each (stage, tp rank)
    assert plan.writers == {0, 1, 4, 5}
    assert plan.received_bytes(_arch(), torch.float32, te_spec=False) == {0: 0}


def test_pipeline_stages_on_other_nodes_are_sent_once_per_node_by_spread_senders():
    places = _places(tp=2, pp=2, dp=2)  # ranks 0-3: stage 0, ranks 4-7: stage 1
    replicas = Replicas.place([0] * 4 + [1] * 4, "per_node")
    plan = SyncPlan.build(replicas, places)
    sent = {(t.shard.stage, t.shard.tp_rank, t.src, t.dst) for t in plan.transfers}
    # node 0 lacks stage 1 (held by ranks 4-7), node 1 lacks stage 0 (ranks 0-3); node n's
    # copy comes from data-parallel copy n mod 2, each TP shard to another rank of the node
    assert sent == {(1, 0, 4, 0), (1, 1, 5, 1), (0, 0, 2, 4), (0, 1, 3, 5)}
    assert plan.writers == {0, 1, 4, 5}
    arch = _arch()
    got = plan.received_bytes(arch, torch.bfloat16, te_spec=False)
    # Transformer Engine's spec names the norms otherwise; the bytes are the same
    assert plan.received_bytes(arch, torch.bfloat16, te_spec=True) == got
    stage = {
        s: sum(
            torch.Size(shape).numel() * 2
            for name, shape in _hf_shapes(arch).items()
            if _stage_of(name, arch) == s
        )
        for s in (0, 1)
    }
    assert got == {0: stage[1], 1: stage[0]}


def test_one_engine_on_two_nodes_sends_only_to_the_engine_node():
    plan = SyncPlan.build(Replicas.place([0, 0, 1, 1], 1), _places(tp=1, pp=2, dp=2))
    assert [(t.shard.stage, t.dst) for t in plan.transfers] == [(1, 0)]


def test_a_tied_output_layer_and_replicated_norms_are_not_sent():
    arch = _arch(tie_word_embeddings=True)
    last = written_items(arch, stage=1, pp=2, te_spec=False)
    assert all("output_layer" not in item.megatron_name for item in last)
    second_rank = sent_items(arch, stage=1, tp_rank=1, pp=2, te_spec=False)
    assert second_rank and all(item.rule.tp_dim is not None for item in second_rank)
    assert len(second_rank) < len(last)


def _hf_shapes(arch):
    from cwgrpo_megatron.convert.mapping import hf_shapes

    return hf_shapes(arch)


def _stage_of(name: str, arch) -> int:
    """Pipeline stage (of 2) of an HF tensor: the embedding first; layers by half; the final
    norm and the output layer last."""
    if "embed" in name:
        return 0
    if ".layers." in name:
        return int(name.split(".")[2]) // (arch.num_layers // 2)
    return 1
