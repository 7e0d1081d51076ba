"""The weight sync plan run across "nodes" (gloo processes with a node rank each, as torchrun
sets GROUP_RANK): every node's engine buffer ends as the HF checkpoint bit for bit, and each
node receives exactly the shards it lacks, counted independently from the HF tensors.

The end-to-end runs with two torchrun launches and vLLM engines are in tests/e2e/test_replicas.py.
"""

import os

import pytest
import torch

from cwgrpo_megatron.checks.tiny import save_tiny_qwen2
from tests.distributed.harness import run_distributed


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "hf", seed=5))


def _fill(rank, world_size, hf_dir, tp, pp, per_node, shm_dir):
    os.environ["GROUP_RANK"] = str(rank // per_node)
    import torch.distributed as dist

    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.comm import all_gather_objects, node_of_each_rank
    from cwgrpo_megatron.comm.collectives import barrier
    from cwgrpo_megatron.convert.mapping import hf_shapes
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.publish import sync_plan
    from cwgrpo_megatron.rollout.replicas import Replicas
    from cwgrpo_megatron.weight_sync import shm
    from tests.megatron_sync import fill_buffers

    world = dist.group.WORLD
    cfg = layout_config(
        tp=tp, pp=pp, micro_batches=1, global_batch=8, group_size=4, steps=1, world_size=world_size
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    buffer = None
    try:
        replicas = Replicas.place(node_of_each_rank(world), "per_node")
        plan = sync_plan(replicas, arch)
        if replicas.owned_by(rank) is not None:
            buffer = shm.create(hf_shapes(arch), torch.float32, folder=shm_dir)
        offers = all_gather_objects(buffer, world)
        node = replicas.nodes[rank]
        mine = [offers[o] for o in replicas.owners_on(node)]
        received = fill_buffers(actor.model, arch, plan, mine, dtype=torch.float32)
        barrier(world)
        equal = None
        if buffer is not None:
            ckpt = HFCheckpoint(hf_dir)
            fresh = shm.SharedWeights.from_message(buffer.to_message())._views()
            equal = all(torch.equal(fresh[n], ckpt.get(n)) for n in ckpt.names())
        barrier(world)
        return {
            "node": node,
            "received": received,
            "equal": equal,
            "planned": plan.received_bytes(arch, torch.float32, te_spec=False),
            "writers": sorted(plan.writers),
        }
    finally:
        parallel.destroy()
        shm.remove(buffer)


def _hf_bytes(hf_dir, keep) -> int:
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    return sum(ckpt.get(n).numel() * 4 for n in ckpt.names() if keep(n))


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[1] == "layers" else None


@pytest.mark.parametrize(
    ("tp", "pp", "world", "per_node"),
    [
        pytest.param(1, 2, 4, 2, id="pp2-across-2-nodes-dp2"),
        pytest.param(2, 1, 2, 1, id="tp2-across-2-nodes"),
        pytest.param(1, 2, 4, 4, id="pp2-inside-one-node"),
    ],
)
def test_every_node_buffer_is_the_checkpoint_and_a_node_receives_what_it_lacks(
    hf_dir, tmp_path, tp, pp, world, per_node
):
    out = run_distributed(_fill, world, hf_dir, tp, pp, per_node, str(tmp_path), timeout=180)
    nodes = world // per_node
    assert [r["equal"] for r in out if r["equal"] is not None] == [True] * nodes
    measured = {n: sum(r["received"] for r in out if r["node"] == n) for n in range(nodes)}
    assert measured == out[0]["planned"]
    if nodes == 1:  # every shard on the node: nothing crosses the network
        assert measured == {0: 0}
        assert out[0]["writers"] == [0, 2]  # data-parallel rank 0's stage 0 and stage 1
        return
    if pp == 2:  # one stage a node: each receives the other stage's tensors, once
        first = _hf_bytes(hf_dir, lambda n: "embed" in n or _layer(n) == 0)
        second = _hf_bytes(hf_dir, lambda n: _layer(n) == 1 or n in ("model.norm.weight",))
        second += _hf_bytes(hf_dir, lambda n: n == "lm_head.weight")
        assert measured == {0: second, 1: first}
        # stage 1 is sent to node 0 by one of its two data-parallel copies only
        assert sum(1 for r in out if r["node"] == 0 and r["received"]) == 1
    else:  # TP across nodes: each node lacks the other TP rank's half of every split tensor
        split = _hf_bytes(hf_dir, lambda n: "norm" not in n)
        norms = _hf_bytes(hf_dir, lambda n: "norm" in n)
        assert measured == {0: split // 2, 1: split // 2 + norms}
    assert list(tmp_path.iterdir()) == []
