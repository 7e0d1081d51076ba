"""Registries and the typed config: unknown names list the choices, YAML overrides and their
order, dump round trips, bad values that name the key, the batch algebra's error, keyword-only
frozen dataclasses, every shipped config loads, the algorithm files stack on every recipe, and
the reward settings."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from cwgrpo_megatron.common.registry import Registry
from cwgrpo_megatron.config import AlgoConfig, Config, config_sources, dump_config, load_config


def test_registry_lists_names_on_unknown():
    reg = Registry("widget")
    reg.register("b")(1)
    reg.register("a")(2)
    assert reg.get("a") == 2
    with pytest.raises(ValueError, match="unknown widget 'c'; choose one of: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(3)


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  policy_loss: grpo\n  kl_beta: 1e-3\n")
    cfg = load_config(path, ["algo.clip_eps_high=0.28", "algo.adv_std_normalize=false"])
    assert cfg.algo.policy_loss == "grpo"
    assert cfg.algo.kl_beta == pytest.approx(1e-3)  # YAML 1.1 reads 1e-3 as a string
    assert cfg.algo.clip_eps_high == pytest.approx(0.28)
    assert cfg.algo.adv_std_normalize is False
    assert load_config().algo == AlgoConfig()


def test_dump_round_trip(tmp_path):
    cfg = load_config(overrides=["algo.kl_beta=0.04"])
    dump_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(tmp_path / "out" / "config.yaml") == cfg
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.yaml"]


def test_the_dump_is_headed_by_its_sources_and_still_loads(tmp_path):
    recipe, overlay = tmp_path / "recipe.yaml", tmp_path / "overlay.yaml"
    recipe.write_text("train:\n  group_size: 3\n  seed: 1\n")
    overlay.write_text("train:\n  seed: 2\n")
    overrides = ["model.system_prompt=Two\nlines", "train.total_steps=4"]
    cfg = load_config([recipe, overlay], overrides)
    out = tmp_path / "config.yaml"
    dump_config(cfg, out, sources=config_sources([recipe, overlay], overrides))
    head = out.read_text().splitlines()[:4]
    assert head[1:] == [
        f"#   1. {recipe}",
        f"#   2. {overlay}",
        "#   3. overrides: 'model.system_prompt=Two\\nlines' train.total_steps=4",
    ]
    assert load_config(out) == cfg


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = EXAMPLES.parent / "configs"
RECIPES = sorted(
    m
    for p in EXAMPLES.glob("train_cwgrpo_*.sh")
    for m in re.findall(r"\"RECIPE\": \"(\w+)\"", p.read_text())
)


@pytest.mark.parametrize("overlay", ["cw_grpo_open_rs", "grpo_open_rs"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_an_algorithm_file_overlays_a_recipe_and_changes_its_algorithm_alone(recipe, overlay):
    base = load_config(CONFIGS / f"{recipe}.yaml")
    stacked = load_config([CONFIGS / f"{recipe}.yaml", CONFIGS / f"{overlay}.yaml"])
    assert dataclasses.replace(stacked, algo=base.algo) == base  # every other section kept
    keys = yaml.safe_load((CONFIGS / f"{overlay}.yaml").read_text())["algo"]
    recipe_algo = yaml.safe_load((CONFIGS / f"{recipe}.yaml").read_text()).get("algo", {})
    expected = load_config(overrides=[f"algo.{k}={v}" for k, v in {**recipe_algo, **keys}.items()])
    assert stacked.algo == expected.algo


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(["algo.policy_los=grpo"], "unknown key 'algo.policy_los'", id="unknown-key"),
        pytest.param(["modle.path=x"], "unknown key 'modle'", id="unknown-section"),
        pytest.param(["model.x=1"], "unknown key 'model.x'", id="unknown-model-key"),
        pytest.param(["data.train_files=a.jsonl"], "must be a list such as [a, b]", id="list-type"),
        pytest.param(["data.train_files=[1]"], "data.train_files[0]=1", id="list-item"),
        pytest.param(
            ["rollout.max_tokens=4000"],
            "data.max_prompt_tokens=512 + rollout.max_tokens=4000 = 4512 tokens exceed "
            "rollout.max_model_len=4096: lower rollout.max_tokens to 3584 or less, or "
            "data.max_prompt_tokens, or raise rollout.max_model_len",
            id="prompt-plus-completion",
        ),
        pytest.param(["eval.benchmarks=[heldout]"], "data.heldout_size=0", id="heldout-empty"),
        pytest.param(
            ["eval.benchmarks=[gsm8k]"],
            "eval.benchmarks: unknown benchmark 'gsm8k'; choose from: aime24",
            id="bad-benchmark",
        ),
        pytest.param(["run.export_hf=always"], "never, on_save, at_end", id="export"),
        pytest.param(["run.keep_last=0"], "run.keep_last=0 is out of range", id="keep"),
        pytest.param(["logging.wandb_mode=cloud"], "disabled, offline, online", id="wandb"),
        pytest.param(["model.chat_template=chatml"], "auto, qwen2.5", id="template"),
        pytest.param(
            ["reward.repetition_max_penalty=1"],
            "is now reward.options.repetition.max_penalty: write reward.options.repetition.max_",
            id="moved-reward",
        ),
        pytest.param(
            ["reward.options.cosine_length.max_lenn=3"],
            "reward.options.cosine_length.max_lenn: reward 'cosine_length' has no option "
            "'max_lenn'; it accepts: max_len, min_value_correct",
            id="misspelt-option",
        ),
        pytest.param(
            ["algo.options.kl_cov.ratioo=0.1"],
            "policy loss 'kl_cov' has no option 'ratioo'; it accepts: ratio, coef",
            id="misspelt-loss-option",
        ),
        pytest.param(
            ["reward.options.overlong.max_tokens=3"],
            "reward 'overlong' gets max_tokens from rollout.max_tokens; remove it here",
            id="provided-option",
        ),
        pytest.param(
            ["reward.options.lenght={a: 1}"],
            "reward.options key='lenght' is not allowed",
            id="opt-name",
        ),
        pytest.param(
            ["algo.policy_loss=ppo"],
            "algo.policy_loss='ppo' is not allowed; choose one of: clip_cov, cw_grpo, grpo, kl_cov",
            id="bad-loss",
        ),
        pytest.param(
            ["algo.cov_scope=batch"], "choose one of: global, group, micro_batch", id="bad-scope"
        ),
        pytest.param(["algo.kl_estimator=k4"], "choose one of: k1, k2, k3", id="bad-kl"),
        pytest.param(["algo.loss_agg=sum"], "token-mean", id="bad-agg"),
        pytest.param(["algo.kl_beta=-1"], "algo.kl_beta=-1.0 is out of range", id="neg-beta"),
        pytest.param(["algo.kl_beta=abc"], "algo.kl_beta='abc' has the wrong type", id="type"),
        pytest.param(["algo.adv_std_normalize=1"], "expected bool", id="bool-type"),
        pytest.param(
            ["algo.loss_agg=seq-mean-token-sum-norm"], "needs algo.loss_norm_length", id="drgrpo"
        ),
        pytest.param(["algo.clip_cov_lb=6"], "is now algo.options.clip_cov.lb", id="moved"),
        pytest.param(["algo"], "must look like section.key=value", id="no-equals"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_bad_yaml_top_level(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(path)


def test_later_config_files_win_key_by_key(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train:\n  seed: 1\n  group_size: 3\nreward:\n  weights: {format: 1}\n")
    second.write_text("train:\n  seed: 2\nreward:\n  weights: {accuracy: 2}\n")
    cfg = load_config([first, second], ["train.group_size=5"])
    assert (cfg.train.seed, cfg.train.group_size) == (2, 5)
    # a mapping-valued key is replaced, not merged: the later file names the whole reward
    assert cfg.reward.weights == {"accuracy": 2.0}
    with pytest.raises(ValueError, match="cannot be read"):
        load_config([first, tmp_path / "missing.yaml"])
    (tmp_path / "broken.yaml").write_text("train: [1\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_total_steps_counts_training_steps_and_the_schedule_their_optimizer_steps():
    overrides = ["train.total_steps=5", "train.ppo_mini_batches=2", "train.prompts_per_step=12"]
    train = load_config(overrides=overrides).train
    assert (train.total_steps, train.optimizer_steps) == (5, 10)


def test_batch_algebra_names_the_fix():
    cfg = load_config(overrides=["train.prompts_per_step=6", "train.group_size=2"])
    assert cfg.check_world(2) == 2 and cfg.train.optimizer_steps == cfg.train.total_steps
    with pytest.raises(ValueError, match="split over dp=4 ranks: fit train.prompts_per_step"):
        cfg.check_world(4)
    with pytest.raises(ValueError, match="not a multiple of tp x pp = 2"):
        load_config(overrides=["parallel.tp=2"]).check_world(3)


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        AlgoConfig("grpo")  # type: ignore[misc]
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.algo = AlgoConfig()  # type: ignore[misc]


def test_every_shipped_config_loads():
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert configs, "configs/ holds no YAML files"
    for path in configs:
        load_config(path)


def test_reward_weights_are_a_typed_mapping():
    cfg = load_config(overrides=["reward.weights={format: 2, cosine_length: 0.5}"])
    assert cfg.reward.weights == {"format": 2.0, "cosine_length": 0.5}
    assert load_config().reward.weights == {"accuracy": 1.0, "format": 1.0}
    with pytest.raises(ValueError, match="reward.weights key='length' is not allowed; choose"):
        load_config(overrides=["reward.weights={length: 1.0}"])
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(overrides=["reward.weights=1.0"])
    with pytest.raises(ValueError, match=r"reward.weights.format='x' has the wrong type"):
        load_config(overrides=["reward.weights={format: x}"])
    with pytest.raises(ValueError, match="reward.weights is empty"):
        load_config(overrides=["reward.weights={}"])


def test_reward_settings_build_the_weighted_sum():
    from cwgrpo_megatron.reward import build_reward

    cfg = load_config(overrides=["reward.weights={format: 2.0}"]).reward
    with build_reward(cfg) as reward:
        assert reward(completions=["a\n</think>\nb", "a"], answers=["", ""]) == [2.0, 0.0]
