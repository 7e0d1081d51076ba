"""The memory planner: model recipes, parameter counts, CLI errors, the layout search, the
phases of a step on an engine's GPU, and the recipes' header verdicts."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from cwgrpo_megatron.analysis import planner
from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.convert.arch import RECIPES, ModelArch, recipe_names
from tools import plan_memory

# transformers' count on the meta device (the issue's table; model cards round differently)
HF_COUNTS = {
    "r1_distill_qwen_1p5b": 1_777_088_000,
    "qwen2p5_math_7b": 7_615_616_512,
    "qwen2p5_14b": 14_770_033_664,
    "qwen2p5_32b": 32_763_876_352,
    "qwen2p5_72b": 72_706_203_648,
    "llama3p1_8b": 8_030_261_248,
    "llama3p1_70b": 70_553_706_496,
    "qwen3_1p7b": 1_720_574_976,
    "qwen3_8b": 8_190_735_360,
    "qwen3_32b": 32_762_123_264,
    "qwen3_30b_a3b": 30_532_122_624,
    "qwen3_235b_a22b": 235_093_634_560,
}


def test_every_recipe_is_counted():
    assert recipe_names() == sorted(HF_COUNTS)


@pytest.mark.parametrize("name", sorted(HF_COUNTS))
def test_parameter_counts_match_transformers_on_meta(name):
    import transformers

    data = json.loads((RECIPES / f"{name}.json").read_text())
    settings = {k: v for k, v in data.items() if not k.startswith("_") and k != "model_type"}
    config = transformers.AutoConfig.for_model(data["model_type"], **settings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf_count = sum(p.numel() for p in model.parameters())
    assert hf_count == HF_COUNTS[name]
    assert planner.params_total(ModelArch.recipe(name)) == hf_count


def test_llama_recipes_carry_rope_scaling():
    assert ModelArch.recipe("llama3p1_8b").rope_scaling_factor == 8.0
    assert ModelArch.recipe("qwen2p5_72b").rope_scaling_factor is None
    bad = json.loads((RECIPES / "llama3p1_8b.json").read_text())
    bad["rope_scaling"]["high_freq_factor"] = 2.0
    with pytest.raises(ValueError, match="Megatron-Core fixes high_freq_factor=4.0"):
        ModelArch.from_hf_dict(bad)


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'qwen9'.*qwen2p5_14b"):
        ModelArch.recipe("qwen9")


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2
    from cwgrpo_megatron.megatron.conversion import start_arch

    path = save_tiny_qwen2(tmp_path / "tiny")
    with pytest.raises(ValueError, match="is not the model.arch='qwen2p5_math_7b'.*hidden_size"):
        start_arch(path, recipe="qwen2p5_math_7b")
    assert start_arch(path, recipe=str(path / "config.json")).hidden_size > 0


def _cli(capsys, *args):
    code = plan_memory.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=3"], "tp=3 does not divide num_attention_heads=28.*valid tp: 1, 2, 4"),
        (["parallel.tp=1", "parallel.pp=5"], "pp=5 does not divide.*valid pp: 1, 2, 4, 7, 14, 28"),
        (["parallel.tp=4", "parallel.pp=4"], "tp x pp = 16 does not divide the 8 GPUs"),
        (["model.arch=qwen9"], "unknown model 'qwen9'.*qwen2p5_math_7b"),
        (["parallel.ep=2"], "ep=2 and expert_tp=1 split experts.*dense model"),
        (["model.arch=qwen3_30b_a3b", "parallel.ep=3"], "ep=3 does not divide num_experts=128"),
        (
            ["model.arch=qwen3_30b_a3b", "parallel.tp=1", "parallel.pp=2", "parallel.ep=8"],
            "expert_tp x ep x pp = 16 does not divide the 8 GPUs",
        ),
        (["model.arch=qwen3_30b_a3b", "--spec", "local"], "tp=4 with a MoE model runs sequence"),
        (["model.arch=qwen3_30b_a3b", "--moe-imbalance", "0.9"], "moe_imbalance=0.9.*at least 1"),
    ],
)
def test_cli_refuses_impossible_layouts(capsys, overrides, message):
    code, out, err = _cli(capsys, "--config", "configs/qwen2p5_math_7b.yaml", *overrides)
    assert code == 2 and out == ""
    assert err.startswith("error: ")
    assert re.search(message, err), err


def test_cli_json_has_the_promised_fields(capsys):
    code, out, _ = _cli(capsys, "--config", "configs/qwen2p5_math_7b.yaml", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["per_gpu"]["fits"]
    assert plan["params_total"] == HF_COUNTS["qwen2p5_math_7b"]
    keys = ("params", "grads", "optimizer", "ref_model", "activations", "vllm", "peak", "capacity")
    assert set(keys) | {"fits"} == set(plan["per_gpu"])
    g = plan["per_gpu"]
    # bf16 + Adam, distributed optimizer over dp=2 at TP4: (2 + 4 + 12/2) bytes a parameter,
    # up to the padding of the output layer's vocabulary and Megatron's buffer alignment
    per_rank = HF_COUNTS["qwen2p5_math_7b"] / 4
    assert g["params"] / per_rank == pytest.approx(2, rel=1e-3)
    assert g["grads"] / per_rank == pytest.approx(4, rel=1e-3)
    assert g["optimizer"] / per_rank == pytest.approx(6, rel=1e-3)
    assert g["peak"] == max(plan["phases"].values())
    # the recipe's engines: one on every GPU (rollout.tp 1, replicas auto), asleep at level 2
    assert plan["rollout"] == {
        "tp": 1,
        "engines_per_node": 8,
        "sleep_level": 2,
        "placement": "colocated",
        "engine_gpus_per_node": 0,
    }
    assert list(plan["phases"]) == ["rollout", "old_logp", "train", "wake"]
    for phase, parts in plan["parts"].items():
        assert sum(parts.values()) == plan["phases"][phase], phase


def _plan(capsys, *overrides) -> dict:
    code, out, _ = _cli(capsys, "--config", "configs/qwen2p5_math_7b.yaml", "--json", *overrides)
    assert code in (0, 1)
    return json.loads(out)


def test_the_old_logp_phase_is_there_only_where_the_step_runs_a_forward_only_pass(capsys):
    no_ref = "algo.kl_beta=0"
    cw, grpo = _plan(capsys, no_ref), _plan(capsys, no_ref, "algo.policy_loss=grpo")
    engine = _plan(capsys, no_ref, "algo.stats_logp=rollout")
    assert list(cw["phases"]) == ["rollout", "old_logp", "train", "wake"]
    assert list(grpo["phases"]) == list(engine["phases"]) == ["rollout", "train", "wake"]
    assert grpo["phases"]["train"] == cw["phases"]["train"]
    # the reference model's pass stays (the recipe's kl_beta = 0.04)
    assert "old_logp" in _plan(capsys, "algo.policy_loss=grpo")["phases"]
    # and the step's compute loses one forward pass of five (3 + old + reference)
    cfg = load_config("configs/qwen2p5_math_7b.yaml", overrides=["algo.policy_loss=grpo"])
    setting = planner.Setting.from_config(cfg)
    arch, cluster = ModelArch.recipe(cfg.model.arch), planner.Cluster(nodes=1, gpus_per_node=8)
    without = planner.step_seconds(arch, planner.plan(arch, setting, cluster))
    forced = dataclasses.replace(setting, policy_pass=True)
    with_pass = planner.step_seconds(arch, planner.plan(arch, forced, cluster))
    assert not setting.policy_pass and 0.75 < without / with_pass < 0.85


def test_the_sleep_level_decides_what_the_engine_holds_in_each_phase(capsys):
    asleep, awake = _plan(capsys), _plan(capsys, "rollout.sleep_level=0")
    weights = asleep["vllm"]["weights"]
    # rollout: the whole reservation either way
    assert asleep["parts"]["rollout"] == awake["parts"]["rollout"]
    engine = ("engine weights", "KV cache", "engine other")
    for phase in ("old_logp", "train"):
        held = {k: asleep["parts"][phase].get(k, 0) for k in engine}
        assert held == {"engine weights": 0, "KV cache": 0, "engine other": 1 << 30}, phase
        # at level 0 the engine keeps its reservation: the train phase no longer fits 80 GiB
        gap = awake["phases"][phase] - asleep["phases"][phase]
        assert gap == awake["per_gpu"]["vllm"] - (1 << 30)
    assert not awake["per_gpu"]["fits"] and asleep["per_gpu"]["fits"]
    # wake: the weights are back, the KV cache is not (the trainer's activations are gone);
    # the IPC sync packs into a 1 GiB buffer while the export holds one tensor (the embedding)
    wake = asleep["parts"]["wake"]
    assert wake["engine weights"] == weights and "KV cache" not in wake
    assert wake["activations"] == 0
    embedding = 152_064 * 3_584 * 2
    assert wake["sync buffers"] == max(1 << 30, embedding) + embedding
    old_logp = asleep["parts"]["old_logp"]
    assert asleep["phases"]["wake"] == (
        asleep["phases"]["old_logp"] - old_logp["activations"] + weights + wake["sync buffers"]
    )
    # level 1 frees the same GPU memory (its weights wait in host memory)
    assert _plan(capsys, "rollout.sleep_level=1")["phases"] == asleep["phases"]


def test_the_planners_sync_sizes_are_the_syncs_own():
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

    from cwgrpo_megatron.weight_sync.senders import TRANSFER_BUCKET_BYTES
    from cwgrpo_megatron.weight_sync.transfer import BUFFER_BYTES

    assert planner.IPC_BUFFER_BYTES == BUFFER_BYTES
    assert planner.NCCL_BUFFERS == DEFAULT_PACKED_NUM_BUFFERS  # what send_nccl leaves at default
    assert planner.SYNC_BUCKET_BYTES == TRANSFER_BUCKET_BYTES
    arch = ModelArch.recipe("qwen2p5_72b")  # stages on other nodes: the shm path's bucket
    assert planner.sync_bytes(arch, dtype="bfloat16", pp=4, nodes=8) == TRANSFER_BUCKET_BYTES


def test_engines_follow_rollout_replicas(capsys):
    def engines(*overrides):
        plan = _plan(capsys, *overrides)
        return plan["rollout"]["engines_per_node"], plan["vllm"]["kv_needed"]

    every_gpu, kv_each = engines()
    assert every_gpu == 8
    assert engines("rollout.tp=2") == (4, kv_each)  # twice the sequences, half the KV heads
    one, kv_one = engines("rollout.replicas=per_node")
    assert one == 1 and kv_one == 8 * kv_each  # one engine samples all 144 sequences
    # dynamic sampling: an engine holds a round of gen_prompts_per_step prompts at once (the
    # recipe's prompts_per_step is 12)
    rounds = ("train.dynamic_sampling=true", "train.gen_prompts_per_step=24")
    assert engines(*rounds) == (8, 2 * kv_each)


def test_separate_placement_plans_the_trainer_on_the_other_gpus(capsys):
    colocated = _plan(capsys, "parallel.tp=2")
    apart = ("rollout.placement=separate", "rollout.gpus_per_node=2", "parallel.tp=2")
    separate = _plan(capsys, *apart, "rollout.gpu_memory_utilization=0.9")
    # the trainer's dp counts 6 GPUs a node, the engines 2 (one per GPU at rollout.tp=1)
    assert colocated["layout"]["dp"] == 4 and separate["layout"]["dp"] == 3
    # rollout.sleep_level resolves to 0: the engines' GPUs are their own
    assert separate["rollout"] == {
        "tp": 1,
        "engines_per_node": 2,
        "sleep_level": 0,
        "placement": "separate",
        "engine_gpus_per_node": 2,
    }
    # no engine bytes on a trainer GPU in any phase; an owner sends over NCCL from two buffers
    engine = {"engine weights", "KV cache", "engine other"}
    assert all(not engine & set(parts) for parts in separate["parts"].values())
    embedding = 152_064 * 3_584 * 2
    assert separate["parts"]["wake"]["sync buffers"] == 2 * max(1 << 30, embedding) + embedding
    assert colocated["parts"]["wake"]["sync buffers"] == max(1 << 30, embedding) + embedding
    assert separate["per_gpu"]["vllm"] == 0
    # an engine holds its weights on its own GPU, and 4 times the sequences of one of 8
    assert separate["vllm"]["reserved"] == int(0.9 * 80 * 2**30)
    assert separate["vllm"]["kv_needed"] == 4 * colocated["vllm"]["kv_needed"]
    assert separate["vllm_fits"]
    code, _, err = _cli(capsys, "--config", "configs/qwen2p5_math_7b.yaml", *apart[:2])
    assert code == 2 and "tp x pp = 4 does not divide the 6 GPUs" in err
    code, _, err = _cli(
        capsys, "--config", "configs/qwen2p5_math_7b.yaml", *apart[:1], "rollout.gpus_per_node=8"
    )
    assert code == 2 and "rollout.gpus_per_node=8 leaves the trainer none" in err


def test_plot_draws_every_phase(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "memory.png"
    code, _, err = _cli(capsys, "--config", "configs/qwen2p5_math_7b.yaml", "--plot", str(out))
    assert code == 0 and f"plot: {out}" in err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["memory.png"]  # no temporary left


ROOT = Path(__file__).resolve().parents[2]
RECIPES_WITH_VERDICT = sorted(
    p for p in (ROOT / "configs").glob("*.yaml") if "planner at" in p.read_text()
)


def test_the_gpu_recipes_state_their_verdict():
    names = {p.stem for p in RECIPES_WITH_VERDICT}
    assert names == {
        "r1_distill_qwen_1p5b", "qwen2p5_math_7b", "qwen2p5_14b", "qwen2p5_32b", "qwen2p5_72b",
        "qwen3_1p7b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b",
    }  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES_WITH_VERDICT, ids=lambda p: p.stem)
def test_each_recipe_header_is_its_plan(capsys, recipe):
    """The header's command, run: its verdict and each phase's peak, to 0.1 GiB; and the
    recipe sets rollout.tp itself, with a comment saying why."""
    text = recipe.read_text()
    command = re.search(r"^#\s+python tools/plan_memory.py (.+)$", text, re.M).group(1).split()
    line = re.search(
        r"^# planner at (\d+) GiB a GPU: (FITS|DOES NOT FIT), peak GiB (.+)$", text, re.M
    )
    said = {phase: float(v) for v, phase in re.findall(r"([\d.]+) \((\w+)\)", line.group(3))}
    code, out, _ = _cli(capsys, *command, "--json", "--gpu-gib", line.group(1))
    plan = json.loads(out)
    assert {k: round(v / planner.GiB, 1) for k, v in plan["phases"].items()} == said
    assert plan["per_gpu"]["fits"] == (line.group(2) == "FITS") == (code == 0)
    rollout = text[text.index("\nrollout:") :]
    assert re.search(rf"^  tp: {plan['rollout']['tp']} +# \w", rollout, re.M), (
        "rollout.tp unexplained"
    )


def test_text_report_reads_the_verdict(capsys):
    config = ("--config", "configs/qwen2p5_72b.yaml", "--nodes", "8")
    code, out, _ = _cli(capsys, *config, "rollout.tp=1")
    assert code == 1  # one TP1 engine cannot hold 72B weights in 24 GiB
    assert "DOES NOT FIT" in out and "do not fit its reservation" in out
    code, out, _ = _cli(capsys, *config, "--rollout-tp", "8")
    assert code == 0 and "verdict: FITS" in out
    assert "1 engine(s)" not in out and "8 engine(s)" in out and "asleep (level 2) 1.00" in out
    assert re.search(r"^  wake +\d", out, re.M)
    assert _cli(capsys, *config)[0] == 0  # the config's own rollout.tp: 8


def _layouts(capsys, config, *args):
    code, out, _ = _cli(capsys, "--config", config, "--search", "--json", "--top", "1000", *args)
    rows = json.loads(out)["fits"]
    return code, {(r["layout"]["tp"], r["layout"]["pp"]) for r in rows}, rows


@pytest.mark.parametrize(
    ("config", "args", "expected"),
    [
        ("configs/qwen2p5_math_7b.yaml", [], [(2, 2), (4, 1)]),  # verl / NeMo-RL, 8 GPUs
        ("configs/qwen2p5_14b.yaml", ["--nodes", "4"], [(8, 2)]),
        ("configs/qwen2p5_32b.yaml", ["--nodes", "4", "--rollout-tp", "8"], [(8, 2)]),
        ("configs/qwen2p5_72b.yaml", ["--nodes", "8", "--rollout-tp", "8"], [(4, 4)]),
        (
            "configs/qwen2p5_72b.yaml",
            ["--nodes", "8", "--rollout-tp", "8", "model.arch=llama3p1_70b"],
            [(4, 4)],
        ),
    ],
)
def test_search_finds_the_published_layouts(capsys, config, args, expected):
    code, layouts, rows = _layouts(capsys, config, *args)
    assert code == 0
    for layout in expected:
        assert layout in layouts, (layout, sorted(layouts))
    seconds = [r["step_seconds"] for r in rows]
    assert seconds == sorted(seconds)
    assert all(r["per_gpu"]["peak"] <= r["per_gpu"]["capacity"] for r in rows)


def test_72b_does_not_fit_without_model_parallelism(capsys):
    config = "configs/qwen2p5_72b.yaml"
    _, layouts, _ = _layouts(capsys, config, "--nodes", "8", "--rollout-tp", "8")
    assert layouts and (1, 1) not in layouts
    code, out, _ = _cli(
        capsys,
        "--config",
        "configs/qwen2p5_72b.yaml",
        "--rollout-tp",
        "8",
        "--json",
        "parallel.tp=1",
        "parallel.pp=1",
        "train.prompts_per_step=16",  # one node: dp = 8 takes 2 of the 16 prompt groups each
    )
    plan = json.loads(out)
    assert code == 1 and not plan["per_gpu"]["fits"]
    # parameters and fp32 gradients alone are 6 bytes a parameter: 406 GiB on one GPU
    assert plan["per_gpu"]["params"] + plan["per_gpu"]["grads"] > 6 * 72e9


def test_distributed_optimizer_matches_megatron_lm_bytes_per_parameter():
    arch = ModelArch.recipe("qwen2p5_math_7b")
    for dp, distributed, expected in ((1, False, 18), (8, True, 6 + 12 / 8)):
        state = planner.trainer_state(
            arch, tp=1, pp=1, dp=dp, stage=0, params_dtype="bfloat16", distributed=distributed
        )
        # the output layer and embedding carry vocabulary padding: 152064 is already a
        # multiple of 128, so the count is the HF one
        assert state.total / HF_COUNTS["qwen2p5_math_7b"] == pytest.approx(expected, rel=1e-6)


def test_recompute_lowers_activation_bytes_as_megatron_would():
    arch = ModelArch.recipe("qwen2p5_math_7b")
    kinds = {
        mode: planner.activation_bytes(
            arch, tp=4, pp=1, stage=0, b=1, s=4096, dtype="bfloat16", recompute=mode, spec="local"
        ).saved
        for mode in planner.RECOMPUTE
    }
    assert kinds["full"] < kinds["selective"] < kinds["none"]


def test_a_moe_plan_follows_expert_parallelism_and_the_routing_imbalance(capsys):
    base = ("--config", "configs/qwen3_30b_a3b.yaml", "--gpu-gib", "140", "--json")
    even, busy = (json.loads(_cli(capsys, *base, "--moe-imbalance", x)[1]) for x in ("1", "1.5"))
    ep4 = json.loads(_cli(capsys, *base, "parallel.ep=4")[1])
    assert even["layout"] == {"tp": 2, "pp": 1, "dp": 4, "ep": 8, "expert_tp": 1}
    # more tokens on the busiest rank's experts: more activations, the same state
    assert busy["per_gpu"]["activations"] > even["per_gpu"]["activations"]
    assert busy["per_gpu"]["params"] == even["per_gpu"]["params"]
    # half the expert ranks: twice the experts (and their unsharded optimizer state) a GPU
    experts = 48 * 128 * 3 * 2048 * 768
    grown = ep4["per_gpu"]["params"] - even["per_gpu"]["params"]
    assert grown == pytest.approx(experts * 2 * (1 / 4 - 1 / 8), rel=1e-3)
    # 3.35B of 30.5B parameters are active: 8 of 128 experts a token
    assert even["params_active"] == HF_COUNTS["qwen3_30b_a3b"] - 48 * 120 * 3 * 2048 * 768


def test_the_search_varies_expert_parallelism(capsys):
    code, out, _ = _cli(
        capsys, "--config", "configs/qwen3_30b_a3b.yaml", "--gpu-gib", "140", "--search",
        "--json", "--top", "1000",
    )  # fmt: skip
    eps = {row["layout"]["ep"] for row in json.loads(out)["fits"]}
    assert code == 0 and len(eps) > 1 and eps <= {1, 2, 4, 8, 16, 32, 64, 128}
