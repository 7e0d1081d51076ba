"""Weight sync from Megatron (gloo, TP / PP) into real rollout engines, checked by log-probs.

The vLLM engine runs in engine processes owned by rank 0 (an in-process engine would hang a
world of more than one process); the torch backend covers TP2 x PP2 on 4 processes quickly.
"""

import math

import pytest
import torch

from cwgrpo_megatron.checks.tiny import TINY_ENGINE_QWEN2, save_tiny_qwen2, save_tiny_qwen3
from tests.distributed.harness import run_distributed


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "hf", seed=3))


def _check(rank, world_size, hf_dir, tp, pp, backend, rounds, ep=1):
    from cwgrpo_megatron.checks.sync_check import run_check

    return run_check(hf_dir=hf_dir, tp=tp, pp=pp, ep=ep, backend=backend, rounds=rounds, seed=1)


@pytest.fixture(scope="module")
def tied_hf_dir(tmp_path_factory):  # vLLM pads the 500-row vocabulary to 512
    path = tmp_path_factory.mktemp("tied") / "hf"
    return str(save_tiny_qwen2(path, seed=4, tie_word_embeddings=True, vocab_size=500))


@pytest.fixture(scope="module")
def qwen3_hf_dir(tmp_path_factory):  # vLLM's qwen3 model: QK norm, head_dim 64 of hidden 128
    return str(save_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "hf", seed=5))


@pytest.mark.parametrize(
    "tp,pp,backend,rounds,path,model",
    [
        (2, 1, "vllm", 10, "shm", "hf_dir"),
        (1, 2, "vllm", 3, "shm", "hf_dir"),
        (1, 2, "vllm", 2, "shm", "tied_hf_dir"),
        (2, 1, "vllm", 2, "shm", "qwen3_hf_dir"),
        (2, 2, "torch", 3, "stream", "hf_dir"),
    ],
    ids=["tp2-vllm-10-syncs", "pp2-vllm", "pp2-vllm-tied", "qwen3-tp2-vllm", "tp2pp2-torch"],
)
def test_engine_scores_like_trainer_after_each_sync(request, tp, pp, backend, rounds, path, model):
    model = request.getfixturevalue(model)
    report = run_distributed(_check, tp * pp, model, tp, pp, backend, rounds, timeout=300)[0]
    assert report["versions"] == list(range(1, rounds + 1))
    # engine processes take each rank's shards from shared memory; the torch engine (in the
    # trainer's process) takes the streamed export
    assert report["paths"] == [path] * rounds
    # on CPU the engine processes load the buffer in place (vllm_inplace), not through reload
    assert report["loads"] == [None if backend == "torch" else "in_place"] * rounds
    assert max(report["max_abs"]) < 1e-4, report["max_abs"]
    # before each sync the engine still scored the previous weights: the step changed them
    assert min(report["stale_max_abs"]) > 1e-2, report["stale_max_abs"]
    if rounds >= 10:  # no memory growth across syncs (trainer + engine processes)
        rss = report["rss_mb"]
        assert max(rss[3:]) - rss[2] < 32, rss


def test_moe_experts_split_over_ep2_reach_vllms_fused_experts(tmp_path):
    """Each EP rank writes its own experts into the buffer; the engine stacks them into its
    fused [E, 2f, h] experts and packs them for its CPU kernel (`vllm_inplace`)."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen3_moe

    hf_dir = str(save_tiny_qwen3_moe(tmp_path / "hf", seed=6))
    report = run_distributed(_check, 2, hf_dir, 1, 1, "vllm", 2, 2, timeout=300)[0]
    assert report["paths"] == ["shm"] * 2 and report["loads"] == ["in_place"] * 2
    assert max(report["max_abs"]) < 1e-4, report["max_abs"]
    assert min(report["stale_max_abs"]) > 1e-2, report["stale_max_abs"]


def _planted(rank, world_size, hf_dir, backend):
    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.checks.sync_check import start_engine
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.model import unwrap
    from cwgrpo_megatron.megatron.publish import sync_weights
    from cwgrpo_megatron.rollout import SamplingConfig

    cfg = layout_config(
        tp=1, pp=2, micro_batches=1, global_batch=8, group_size=4, steps=1, world_size=world_size
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    engine = None
    try:
        if rank == 0:
            engine = start_engine(backend, hf_dir, dtype="float32", max_model_len=128, seed=0)
        gpt = unwrap(actor.model)
        if hasattr(gpt, "output_layer"):  # the last stage: every logit 0 -> uniform
            torch.nn.init.zeros_(gpt.output_layer.weight)
        sync_weights(actor.model, arch, engine, dtype="float32")
        if engine is None:
            return None
        prompts = [[10, 11, 12], [20]]
        groups = engine.generate(prompts, 2, SamplingConfig(temperature=0.7, max_tokens=5, seed=1))
        return {
            "logprobs": [lp for g in groups for c in g.completions for lp in c.logprobs],
            "versions": [g.policy_version for g in groups],
        }
    finally:
        parallel.destroy()
        if engine is not None:
            engine.shutdown()


def test_a_change_on_the_last_stage_reaches_the_engine(hf_dir):
    result = run_distributed(_planted, 2, hf_dir, "vllm", timeout=300)[0]
    uniform = -math.log(TINY_ENGINE_QWEN2["vocab_size"])
    assert result["versions"] == [1, 1]
    assert len(result["logprobs"]) == 2 * 2 * 5
    assert max(abs(lp - uniform) for lp in result["logprobs"]) < 1e-5


def _export(rank, world_size, hf_dir, tp, pp, shm_dir):
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.comm.collectives import barrier, broadcast_object
    from cwgrpo_megatron.convert.mapping import hf_shapes
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.publish import hf_weights, sync_plan
    from cwgrpo_megatron.rollout.replicas import Replicas
    from cwgrpo_megatron.weight_sync import shm
    from cwgrpo_megatron.weight_sync.nccl import send_nccl
    from cwgrpo_megatron.weight_sync.transfer import HFSource
    from tests.megatron_sync import _transfer_source, fill_buffers

    cfg = layout_config(
        tp=tp, pp=pp, micro_batches=1, global_batch=8, group_size=4, steps=1, world_size=world_size
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    buffer = None
    try:
        ckpt = HFCheckpoint(hf_dir)
        names, streamed_equal = [], True
        for name, tensor in hf_weights(actor.model, arch, dtype="float32"):
            names.append(name)
            streamed_equal &= torch.equal(tensor, ckpt.get(name))
        # every rank writes only its own shards into one buffer (the sync's own path)
        if rank == 0:
            buffer = shm.create(hf_shapes(arch), torch.float32, folder=shm_dir)
        buffer = broadcast_object(buffer, 0, dist.group.WORLD)
        plan = sync_plan(Replicas.single(world_size), arch)
        assert plan.writers == set(range(world_size)) and not plan.transfers
        fill_buffers(actor.model, arch, plan, [buffer], dtype=torch.float32)
        barrier(dist.group.WORLD)
        fresh = shm.SharedWeights.from_message(buffer.to_message())._views()
        shared_equal = all(torch.equal(fresh[n], ckpt.get(n)) for n in ckpt.names())
        barrier(dist.group.WORLD)
        # the GPU paths' source, read as vLLM's IPC transfer reads it: its groups check that
        # each tensor comes in the order metadata() declares; twice, as two syncs would
        source = _transfer_source(actor.model, arch, "float32")
        ipc_equal, declared = True, {m.name: m for m in source.metadata()}
        for _ in range(2):
            for group_names, tensors in source.iter_groups():
                for name, tensor in zip(group_names, tensors, strict=True):
                    meta = declared[name]
                    ipc_equal &= (meta.dtype, meta.shape) == (tensor.dtype, tuple(tensor.shape))
                    ipc_equal &= torch.equal(tensor, ckpt.get(name))
        # the NCCL sender's check of the same source (vLLM's, on the owner), and a rank
        # without an engine joining the export once through vLLM's NCCL trainer engine
        nccl_equal = all(
            torch.equal(tensor, ckpt.get(name))
            for name, tensor in NCCLTrainerWeightTransferEngine._checked_iter(
                source, source.metadata()
            )
        )
        passed = []

        def counted():
            for name, tensor in hf_weights(actor.model, arch, dtype="float32"):
                passed.append(name)
                yield name, tensor

        declared_list = [(m.name, m.dtype, m.shape) for m in source.metadata()]
        send_nccl(HFSource(counted, declared_list))
        return {
            "names": names,
            "streamed": streamed_equal,
            "shared": shared_equal,
            "ipc_names": [m.name for m in source.metadata()],
            "ipc": ipc_equal,
            "nccl": nccl_equal,
            "nccl_pass": passed,
        }
    finally:
        parallel.destroy()
        if rank == 0:
            shm.remove(buffer)


def test_stream_shared_buffer_and_transfer_source_are_the_hf_checkpoint_bit_for_bit(
    hf_dir, tmp_path
):
    """TP2 x PP2: the streamed export, the shared buffer and the source the GPU paths hand to
    vLLM's IPC and NCCL transfers (its order and shapes as declared, by vLLM's own checks) all
    equal the checkpoint on every rank; a rank without an engine passes once over the export
    in vLLM's NCCL trainer engine (the owner's broadcast needs a GPU)."""
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

    out = run_distributed(_export, 4, hf_dir, 2, 2, str(tmp_path), timeout=180)
    expected = sorted(HFCheckpoint(hf_dir).names())
    for result in out:  # every rank of the TP x PP group gets the whole model
        assert sorted(result["names"]) == expected and len(result["names"]) == len(expected)
        assert result["streamed"] and result["shared"] and result["ipc"]
        assert result["ipc_names"] == result["names"]
        assert result["nccl"] and result["nccl_pass"] == result["names"]
    assert list(tmp_path.iterdir()) == []


def _rollout_then_train(rank, world_size, hf_dir, backend):
    """Engine rollouts -> TrainBatch -> train step with truncated IS -> sync, twice."""
    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.checks.sync_check import start_engine
    from cwgrpo_megatron.data.batching import batch_from_rollouts
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.publish import sync_weights
    from cwgrpo_megatron.megatron.train_step import train_step
    from cwgrpo_megatron.rollout import sampling_config

    cfg = layout_config(
        tp=1,
        pp=1,
        micro_batches=2,
        global_batch=8,
        group_size=4,
        steps=2,
        world_size=world_size,
        overrides=["train.temperature=0.7", "algo.tis_cap=2.0", "rollout.max_tokens=6"],
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    engine = start_engine(backend, hf_dir, dtype="float32", max_model_len=64, seed=0)
    try:
        metrics = []
        for step in range(2):
            sampling = sampling_config(cfg.rollout, temperature=cfg.train.temperature, seed=step)
            groups = engine.generate([[5, 6, 7], [9, 10]], 4, sampling)
            rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
            batch = batch_from_rollouts(groups, rewards, seq_len=10)
            (result,) = train_step(actor, batch)
            metrics.append(result.metrics)
            sync_weights(actor.model, arch, engine, dtype="float32")
        return metrics, engine.version
    finally:
        parallel.destroy()
        engine.shutdown()


@pytest.mark.parametrize("backend", ["vllm", "torch"])
def test_rollouts_train_and_sync_with_the_log_prob_gap_logged(hf_dir, backend):
    metrics, version = run_distributed(_rollout_then_train, 1, hf_dir, backend, timeout=300)[0]
    assert version == 2
    for step in metrics:  # engine and trainer sample / score the same distribution
        assert step["rollout/gap_max"] < 1e-4, step
        assert abs(step["actor/tis_weight_mean"] - 1.0) < 1e-4, step


def test_check_weight_sync_cli(hf_dir):
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "check_weight_sync.py"
    args = [sys.executable, str(tool), "--hf-dir", hf_dir, "--engine", "torch", "--rounds", "2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "round 1: max |dlogp|" in done.stdout and "OK: max" in done.stdout
    assert "before any step: max |dlogp|" in done.stdout and "tol 1.000e-04" in done.stdout
    # a step that changes nothing leaves the engine "in sync" without a sync: the check cannot
    # tell, so it must fail rather than pass
    done = subprocess.run([*args, "--lr", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "FAIL" in done.stdout, done.stdout
    assert "raise --lr" in done.stdout


def _refused_engine(rank, world_size, hf_dir, engine_dir, shm_dir):
    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.comm import PeerFailure
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.publish import sync_weights
    from cwgrpo_megatron.rollout import get_engine

    cfg = layout_config(
        tp=2, pp=1, micro_batches=1, global_batch=8, group_size=4, steps=1, world_size=world_size
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    engine = None
    try:
        if rank == 0 and shm_dir is None:
            engine = get_engine("torch")(engine_dir, dtype="float32", max_model_len=64, seed=0)
        elif rank == 0:
            engine = get_engine("vllm")(engine_dir, max_model_len=64, seed=0, shm_dir=shm_dir)
        try:
            sync_weights(actor.model, arch, engine, dtype="float32")
        except (ValueError, PeerFailure) as err:  # the owner's refusal; its peer's word of it
            return str(err)
        return "synced"
    finally:
        parallel.destroy()
        if engine is not None:
            engine.shutdown()


def test_an_engine_of_another_model_is_refused_on_every_rank(hf_dir, tmp_path):
    other = str(save_tiny_qwen2(tmp_path / "other", intermediate_size=384))
    out = run_distributed(_refused_engine, 2, hf_dir, other, None, timeout=120)
    assert all("other tensor names or shapes" in message for message in out), out


def test_an_engine_without_room_for_its_buffer_is_refused_on_every_rank(hf_dir, tmp_path):
    missing = str(tmp_path / "no-such-tmpfs")
    out = run_distributed(_refused_engine, 2, hf_dir, hf_dir, missing, timeout=300)
    assert all("weight buffer could not be made" in m and "no-such-tmpfs" in m for m in out), out


def _check_with_a_blind_peer(rank, world_size, hf_dir):
    from cwgrpo_megatron.checks.sync_check import run_check
    from cwgrpo_megatron.comm import PeerFailure
    from cwgrpo_megatron.weight_sync.shm import SharedWeights

    visible = SharedWeights.visible
    if rank == 1:  # as if rank 1 had a shared-memory folder of its own (a container, say)
        SharedWeights.visible = lambda self: False
    try:
        run_check(hf_dir=hf_dir, tp=2, backend="vllm", rounds=1, seed=2)
    except (ValueError, PeerFailure) as err:
        return str(err)
    finally:  # the worker serves later tasks
        SharedWeights.visible = visible
    return "synced"


def test_a_rank_that_cannot_see_its_nodes_buffer_stops_every_rank(hf_dir):
    out = run_distributed(_check_with_a_blind_peer, 2, hf_dir, timeout=300)
    assert all("cannot see the weight buffer" in message for message in out), out
    assert "failed on rank 1" in out[0] and "rollout.shm_dir" in out[1], out


def _verify(rank, world_size, hf_dir):
    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.checks.sync_check import SyncMismatchError, start_engine, verify_sync
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.publish import sync_weights
    from cwgrpo_megatron.megatron.train_step import train_step

    cfg = layout_config(
        tp=2, pp=1, micro_batches=1, global_batch=8, group_size=4, steps=1, world_size=world_size
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    engine = None
    if rank == 0:
        engine = start_engine("torch", hf_dir, dtype="float32", max_model_len=64, seed=0)
    try:
        synced = verify_sync(actor.model, arch, engine, tol=1e-4)  # same checkpoint
        batch = synthetic_batch(prompts=2, group_size=4, seq_len=24, vocab_size=arch.vocab_size)
        train_step(actor, batch)
        try:  # the engine was not synced after the step
            verify_sync(actor.model, arch, engine, tol=1e-4)
            stale = "passed"
        except SyncMismatchError as err:
            stale = str(err)
        sync_weights(actor.model, arch, engine, dtype="float32")
        return synced, stale, verify_sync(actor.model, arch, engine, tol=1e-4)
    finally:
        parallel.destroy()


def test_verify_sync_passes_after_a_sync_and_stops_every_rank_on_stale_weights(hf_dir):
    for synced, stale, resynced in run_distributed(_verify, 2, hf_dir, timeout=180):
        assert synced.max < 1e-4 and resynced.max < 1e-4
        assert "differ from the trainer's by up to" in stale and "> tol 0.0001" in stale
