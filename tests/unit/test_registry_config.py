import re
from pathlib import Path

import pytest

from cwgrpo_megatron.config import AlgoConfig, Config, dump_config, load_config
from cwgrpo_megatron.registry import Registry


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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(["algo.policy_los=grpo"], "unknown key 'algo.policy_los'", id="unknown-key"),
        pytest.param(["model.x=1"], "unknown key 'model'", id="unknown-section"),
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
        pytest.param(["algo.clip_cov_lb=6"], "must be below", id="band"),
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


def test_reward_config_builds_the_weighted_sum():
    cfg = load_config(overrides=["reward.weights={format: 2.0}"]).reward
    with cfg.build() as reward:
        assert reward(completions=["a\n</think>\nb", "a"], answers=["", ""]) == [2.0, 0.0]
