"""The planner's trainer-state bytes equal what Megatron-Core allocates, to the byte (gloo, 4
processes), and its activation bytes equal the tensors saved for backward (1 process)."""

import dataclasses
from functools import partial

from tests.distributed.harness import run_distributed

# (tp, pp) on 4 processes: dp = 4 / (tp pp)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODELS = {
    "qwen2-tied": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "llama": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
}
# the activation bytes also for Qwen3's per-head q / k norms (head_dim 64, not h / heads) and
# for Qwen3-MoE's routed experts (4 experts, top 2, of width 32), at fewer lengths
ACTIVATION_MODELS = {
    **{name: (overrides, (64, 128, 256, 512)) for name, overrides in MODELS.items()},
    "qwen3": (dict(architectures=["Qwen3ForCausalLM"], head_dim=64), (64, 256)),
    "qwen3-moe": (
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        (64, 256),
    ),
}
CASES = [(dtype, distopt) for dtype in ("float32", "bfloat16") for distopt in (False, True)]


def _arch(name):
    from cwgrpo_megatron.checks.tiny import TINY_QWEN2
    from cwgrpo_megatron.convert.arch import ModelArch

    # an odd vocabulary, so that padding to 128 x tp shows
    overrides = ACTIVATION_MODELS[name][0]
    return ModelArch.from_hf_dict({**TINY_QWEN2, "vocab_size": 1000, **overrides})


def _allocated(arch, layout: list[str], dtype: str, distopt: bool) -> dict[str, int]:
    """What Megatron allocates for the trainer's state at `layout` (config overrides), after
    one optimizer step (Adam creates its moments on the first)."""
    from cwgrpo_megatron.checks.memory import trainer_state_bytes
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.megatron.cpu import on_cpu
    from cwgrpo_megatron.megatron.train_step import build_actor

    cfg = load_config(
        overrides=[
            *layout,
            f"train.params_dtype={dtype}",
            f"optim.use_distributed_optimizer={distopt}",
            "optim.lr=1e-3",
        ]
    )
    actor = build_actor(arch, lambda model: None, train=cfg.train, algo=cfg.algo, optim=cfg.optim)
    actor.model.zero_grad_buffer()
    actor.optimizer.zero_grad()
    with on_cpu():
        actor.optimizer.step()
    return trainer_state_bytes(actor.model, actor.optimizer)


def _measure_states(rank, world):
    from megatron.core import parallel_state

    from cwgrpo_megatron.analysis.planner import trainer_state
    from cwgrpo_megatron.megatron import parallel

    out = []
    for tp, pp in LAYOUTS:
        parallel.initialize(tp=tp, pp=pp)
        layout = parallel.layout()
        dp_rank, _ = parallel.data_parallel()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        for name in MODELS:
            arch = _arch(name)
            for dtype, distopt in CASES:
                measured = _allocated(
                    arch, [f"parallel.tp={tp}", f"parallel.pp={pp}"], dtype, distopt
                )
                predicted = trainer_state(
                    arch,
                    tp=tp,
                    pp=pp,
                    dp=layout["dp"],
                    stage=stage,
                    params_dtype=dtype,
                    distributed=distopt,
                    dp_rank=dp_rank,
                )
                out.append(
                    dict(
                        case=(name, tp, pp, dtype, distopt, rank),
                        measured=measured,
                        predicted=dict(
                            params=predicted.params,
                            grads=predicted.grads,
                            optimizer=predicted.optimizer,
                        ),
                    )
                )
        parallel.destroy()
    return out


def test_trainer_state_bytes_are_exact():
    results = [r for rank in run_distributed(_measure_states, 4, timeout=600) for r in rank]
    assert len(results) == 4 * len(LAYOUTS) * len(MODELS) * len(CASES)
    for r in results:
        assert r["measured"]["optimizer"] > 0, r
        assert r["predicted"] == r["measured"], r["case"]


MOE_LAYOUTS = [(1, 2), (1, 4), (2, 2)]
"""(pp, ep) on 4 processes at tp 1 (a MoE layer trains beside TP only with sequence
parallelism, which needs Transformer Engine)."""


def _measure_moe_states(rank, world):
    from megatron.core import parallel_state

    from cwgrpo_megatron.analysis.planner import trainer_state
    from cwgrpo_megatron.checks.tiny import TINY_ENGINE_QWEN3_MOE, TINY_QWEN2
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.megatron import parallel

    moe = {**TINY_QWEN2, **TINY_ENGINE_QWEN3_MOE, "architectures": ["Qwen3MoeForCausalLM"]}
    arch = ModelArch.from_hf_dict(moe)
    out = []
    for pp, ep in MOE_LAYOUTS:
        parallel.initialize(tp=1, pp=pp, ep=ep)
        layout = parallel.layout()
        dp_rank, _ = parallel.data_parallel()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        expert_dp_rank = parallel_state.get_expert_data_parallel_rank()
        for dtype, distopt in CASES:
            measured = _allocated(arch, [f"parallel.pp={pp}", f"parallel.ep={ep}"], dtype, distopt)
            predicted = trainer_state(
                arch,
                tp=1,
                pp=pp,
                dp=layout["dp"],
                stage=stage,
                params_dtype=dtype,
                distributed=distopt,
                dp_rank=dp_rank,
                ep=ep,
                expert_dp_rank=expert_dp_rank,
            )
            out.append(
                dict(
                    case=(pp, ep, dtype, distopt, rank),
                    measured=measured,
                    predicted=dataclasses.asdict(predicted),
                )
            )
        parallel.destroy()
    return out


def test_moe_trainer_state_bytes_are_exact_with_expert_parallelism():
    # the experts' own DDP buffer, sharded over the expert-data-parallel ranks
    results = [r for rank in run_distributed(_measure_moe_states, 4, timeout=600) for r in rank]
    assert len(results) == 4 * len(MOE_LAYOUTS) * len(CASES)
    for r in results:
        assert r["measured"]["optimizer"] > 0, r
        assert r["predicted"] == r["measured"], r["case"]


RECOMPUTE = {
    "none": [],
    "full": ["train.recompute_granularity=full", "train.recompute_num_layers=1"],
    "full-chunks-of-2": ["train.recompute_granularity=full", "train.recompute_num_layers=2"],
    "full-block-3": [
        "train.recompute_granularity=full",
        "train.recompute_method=block",
        "train.recompute_num_layers=3",
    ],
    "selective": ["train.recompute_granularity=selective"],
}


def _built(arch, dtype: str, recompute: list[str]):
    """(cfg, model in training mode) of the activation measurements: `arch` in `dtype` with
    the cw_grpo loss, a reference model's KL term and the `recompute` overrides."""
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.megatron.model import DTYPES, build_model

    cfg = load_config(overrides=[f"train.params_dtype={dtype}", "algo.kl_beta=0.04", *recompute])
    model = build_model(
        arch,
        params_dtype=DTYPES[dtype],
        calculate_per_token_loss=True,
        **cfg.train.recompute_overrides(),
    )
    return cfg, model


def _measure_activations(rank, world):
    from cwgrpo_megatron.analysis.planner import activation_bytes
    from cwgrpo_megatron.checks.memory import micro_batch_saved_bytes
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel

    parallel.initialize(tp=1, pp=1)
    out = []
    for name, (_, lengths) in ACTIVATION_MODELS.items():
        arch = _arch(name)
        for dtype in ("float32", "bfloat16"):
            for mode, overrides in RECOMPUTE.items():
                cfg, model = _built(arch, dtype, overrides)
                for s in lengths:
                    batch = synthetic_batch(
                        prompts=1, group_size=2, seq_len=s, vocab_size=1000, seed=s
                    )
                    measured = micro_batch_saved_bytes(model, batch, cfg, arch)
                    t = cfg.train
                    predicted = activation_bytes(
                        arch,
                        tp=1,
                        pp=1,
                        stage=0,
                        b=2,
                        s=s,
                        dtype=dtype,
                        recompute=t.recompute_granularity,
                        recompute_method=t.recompute_method,
                        recompute_num_layers=t.recompute_num_layers,
                        spec="local",
                    ).saved
                    out.append(dict(case=(name, dtype, mode, s), m=measured, p=predicted))
    parallel.destroy()
    return out


def test_activation_bytes_match_saved_tensors():
    results = run_distributed(_measure_activations, 1, timeout=600)[0]
    for r in results:
        print(r["case"], r["m"], r["p"], f"{r['p'] / r['m'] - 1:+.2%}")
    for r in results:
        assert r["p"] == r["m"], r  # the issue asks for 15%; the local spec is exact


def _measure_expert_parallel_activations(rank, world):
    from cwgrpo_megatron.analysis.planner import Experts, activation_bytes, layer_saved_bytes
    from cwgrpo_megatron.checks.memory import micro_batch_saved_bytes
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel

    parallel.initialize(tp=1, pp=1, ep=2)
    arch, out = _arch("qwen3-moe"), []
    received = []  # the routed tokens that reach this rank's experts, layer by layer
    for dtype in ("float32", "bfloat16"):
        for mode in ("none", "selective"):
            cfg, model = _built(arch, dtype, RECOMPUTE[mode])
            for layer in model.decoder.layers:
                layer.mlp.experts.register_forward_hook(
                    lambda module, args, output: received.append(args[0].shape[0])
                )
            for s in (64, 256):
                batch = synthetic_batch(
                    prompts=1, group_size=2, seq_len=s, vocab_size=1000, seed=s + rank
                )
                received.clear()
                measured = micro_batch_saved_bytes(model, batch, cfg, arch)
                even = 2 * s * arch.moe_topk
                predicted = activation_bytes(
                    arch, tp=1, pp=1, stage=0, b=2, s=s, dtype=dtype, recompute=mode, spec="local"
                ).saved
                # each layer's own routed tokens in place of the even share: the layer's bytes at
                # its `Experts.imbalance`, less those at 1
                layer = partial(
                    layer_saved_bytes, arch, tp=1, b=2, s=s, dtype=dtype, recompute=mode,
                    spec="local",
                )  # fmt: skip
                even_layer = layer(experts=Experts(ep=2))
                predicted += sum(
                    layer(experts=Experts(ep=2, imbalance=r / even)) - even_layer for r in received
                )
                uneven = max(received) != min(received)
                case = (dtype, mode, s, rank)
                out.append(dict(case=case, m=measured, p=predicted, uneven=uneven))
    parallel.destroy()
    return out


def test_moe_activation_bytes_at_expert_parallelism_follow_the_routed_tokens():
    # EP2 on 2 processes: each rank's experts keep what the tokens routed to them need, and
    # the routing is uneven (the planner's imbalance), so the counts differ by layer and rank
    results = sum(run_distributed(_measure_expert_parallel_activations, 2, timeout=600), [])
    for r in results:
        print(r["case"], r["m"], r["p"], f"{r['p'] / r['m'] - 1:+.2%}")
    assert any(r["uneven"] for r in results)
    for r in results:
        assert r["p"] == r["m"], r


def _megatron_counts(rank, world):
    import torch

    from cwgrpo_megatron.analysis.planner import stage_tensors
    from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size, recipe_names
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.model import build_model

    parallel.initialize(tp=1, pp=1)
    out = {}
    for name in recipe_names():
        arch = ModelArch.recipe(name)
        # the meta device: no weights, no memory, whatever the size
        with torch.device("meta"):
            model = build_model(arch, params_dtype=torch.bfloat16, perform_initialization=False)
        names = [(n, p.numel()) for n, p in model.named_parameters()]
        padding = padded_vocab_size(arch.vocab_size, tp=1) - arch.vocab_size
        vocab_tensors = 1 if arch.tie_embeddings else 2
        out[name] = dict(
            count=sum(n for _, n in names) - vocab_tensors * padding * arch.hidden_size,
            planner_tensors=names == stage_tensors(arch, tp=1, pp=1, stage=0),
        )
        del model
    parallel.destroy()
    return out


def test_megatron_parameter_counts_on_meta_equal_transformers():
    from tests.unit.test_planner import HF_COUNTS

    counts = run_distributed(_megatron_counts, 1, timeout=600)[0]
    assert {name: c["count"] for name, c in counts.items()} == HF_COUNTS
    # and the planner's list of tensors is Megatron's, name by name, in order
    assert all(c["planner_tensors"] for c in counts.values()), counts
