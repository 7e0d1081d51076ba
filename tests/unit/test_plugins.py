"""Plugins (`common.plugins`): imported before the config is checked, named in every error,
recorded by hash; and what they plug into: reward and loss options, the reward contract
(prompts, extra, named values, on_error), schemas and benchmarks."""

import textwrap
import uuid

import pytest

from cwgrpo_megatron.common.plugins import (
    PluginError,
    absolute_entry,
    check_unchanged,
    load_plugins,
)
from cwgrpo_megatron.config import load_config
from tests.e2e.test_train import REPO

EXAMPLES = REPO / "examples" / "plugins"


@pytest.fixture(autouse=True)
def isolated_registries():
    """Every registry and the imported-plugin table as they were before the test: what a
    plugin registers here does not leak into the registry tests run in the same worker."""
    from cwgrpo_megatron.algo.names import POLICY_LOSSES
    from cwgrpo_megatron.common import plugins
    from cwgrpo_megatron.data.names import SCHEMAS
    from cwgrpo_megatron.eval.names import BENCHMARKS
    from cwgrpo_megatron.reward.names import REWARDS

    registries = (POLICY_LOSSES, SCHEMAS, BENCHMARKS, REWARDS)
    for registry in registries:
        registry.names()  # the built-ins, imported now: not inside the test
    saved = [dict(r._items) for r in registries], dict(plugins._LOADED)
    yield
    for registry, items in zip(registries, saved[0], strict=True):
        registry._items.clear()
        registry._items.update(items)
    plugins._LOADED.clear()
    plugins._LOADED.update(saved[1])


def write_plugin(folder, body: str, name: str | None = None):
    """A plugin file with a fresh name (a registry entry lives for the process)."""
    path = folder / f"{name or 'plugin_' + uuid.uuid4().hex[:8]}.py"
    path.write_text(textwrap.dedent(body))
    return path


def fresh(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def reward_source(name: str, call: str) -> str:
    """A plugin file that registers reward `name` whose __call__ body is `call`."""
    body = textwrap.indent(textwrap.dedent(call).strip(), " " * 8)
    return (
        "from cwgrpo_megatron.reward import Reward, register_reward\n\n"
        f"@register_reward({name!r})\nclass Plugged(Reward):\n"
        f"    def __call__(self, *, completions, **_):\n{body}\n"
    )


def reward_plugin(tmp_path, name: str):
    return write_plugin(
        tmp_path,
        f"""
        from cwgrpo_megatron.reward import Reward, register_reward

        @register_reward("{name}")
        class Scale(Reward):
            def __init__(self, *, factor: float, offset: float = 0.0):
                self.factor, self.offset = factor, offset

            def __call__(self, *, completions, prompts=None, extra=None, **_):
                return [
                    {{"score": self.factor * len(c) + self.offset,
                      "prompt_len": float(len(p or "")),
                      "has_id": float("id" in (e or {{}}))}}
                    for c, p, e in zip(completions, prompts or [None] * len(completions),
                                       extra or [None] * len(completions))
                ]
        """,
    )


def test_a_plugins_reward_is_a_valid_config_value_only_once_it_is_imported(tmp_path):
    name = fresh("scale")
    path = reward_plugin(tmp_path, name)
    weights = f"reward.weights={{{name}: 1.0}}"
    option = f"reward.options.{name}.factor=2.0"
    with pytest.raises(ValueError, match=f"reward.weights key='{name}' is not allowed"):
        load_config(overrides=[weights, option])
    cfg = load_config(overrides=[weights, option], plugins=[str(path)])
    assert cfg.run.plugins == [str(path.resolve())]
    assert cfg.reward.options == {name: {"factor": 2.0}}
    # the same entry again (another load of the config): imported once, not registered twice
    again = load_config(overrides=[weights, option, f"run.plugins=[{path}]"])
    assert again.run.plugins == [str(path.resolve())]
    with pytest.raises(ValueError, match=f"reward '{name}' has no option 'factr'; it accepts: "):
        load_config(overrides=[weights, f"reward.options.{name}.factr=2"], plugins=[str(path)])
    with pytest.raises(ValueError, match=f"reward.options.{name}: reward '{name}' needs factor"):
        load_config(overrides=[weights], plugins=[str(path)])


def test_a_plugin_that_fails_to_import_is_named_with_its_traceback(tmp_path):
    broken = write_plugin(tmp_path, "x = 1\nraise RuntimeError('no licence server')\n")
    with pytest.raises(PluginError, match="failed to import") as caught:
        load_config(plugins=[str(broken)])
    message = str(caught.value)
    assert f"run.plugins entry '{absolute_entry(str(broken))}'" in message
    assert "RuntimeError: no licence server" in message and f'File "{broken}", line 2' in message
    with pytest.raises(PluginError, match=r"no such file .*relative path is read from the work"):
        load_config(overrides=["run.plugins=[missing/plugin.py]"])
    with pytest.raises(PluginError, match="'no_such_module_xyz': no module of that name"):
        load_config(overrides=["run.plugins=[no_such_module_xyz]"])
    with pytest.raises(ValueError, match="run.plugins=.* must be a list of module names"):
        load_config(overrides=["run.plugins=plugin.py"])


def test_a_changed_plugin_is_refused_on_resume(tmp_path):
    path = write_plugin(tmp_path, "VALUE = 1\n")
    (record,) = load_plugins([str(path)])
    assert record.file == str(path.resolve()) and len(record.sha256) == 64
    saved = [record.to_json()]
    check_unchanged(saved, [record], where="step_1")  # unchanged: nothing to say
    edited = record.__class__(record.entry, record.file, "0" * 64)
    with pytest.raises(PluginError, match="changed since step_1 was saved .*restore the file"):
        check_unchanged(saved, [edited], where="step_1")
    with pytest.raises(PluginError, match="which run.plugins no longer names"):
        check_unchanged(saved, [], where="step_1")


def test_the_example_plugins_register_what_the_docs_say():
    plugins = [str(EXAMPLES / f) for f in ("length_target.py", "seq_clip_grpo.py")]
    cfg = load_config(
        overrides=[
            "reward.weights={accuracy: 1.0, length_target: 0.5}",
            "reward.options.length_target.target=12",
            "algo.policy_loss=seq_clip_grpo",
            "algo.options.seq_clip_grpo.max_abs=1e-1",  # YAML 1.1's float, read as one
        ],
        plugins=plugins,
    )
    from cwgrpo_megatron.algo import build_policy_loss

    assert build_policy_loss(cfg.algo).max_abs == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"algo.options.seq_clip_grpo: max_abs=-1 must be > 0"):
        build_policy_loss(
            load_config(
                overrides=[
                    "algo.policy_loss=seq_clip_grpo",
                    "algo.options.seq_clip_grpo.max_abs=-1",
                ],
                plugins=plugins,
            ).algo
        )


def test_a_reward_sees_prompts_and_the_row_and_its_named_values_are_logged(tmp_path):
    from cwgrpo_megatron.data.prompts import Problem
    from cwgrpo_megatron.reward import build_reward
    from cwgrpo_megatron.reward.scoring import score_groups
    from cwgrpo_megatron.rollout.base import Completion, RolloutGroup
    from cwgrpo_megatron.run.step_metrics import rollout_metrics

    name = fresh("scale")
    path = reward_plugin(tmp_path, name)
    cfg = load_config(
        overrides=[
            f"reward.weights={{format: 1.0, {name}: 0.5}}",
            f"reward.options.{name}={{factor: 1.0, offset: 1.0}}",
            "reward.verifier=integer_answer",
        ],
        plugins=[str(path)],
    )

    class Chars:  # a tokenizer of one character per token id
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    problems = [
        Problem(id="a", problem="What?", answer="1", extra={"id": "a", "source": "x"}),
        Problem(id="b", problem="Why not?", answer="2", extra={"source": "y"}),
    ]
    groups = [
        RolloutGroup(
            prompt_ids=[1, 2],
            policy_version=0,
            completions=[
                Completion(
                    token_ids=[ord(c) for c in t], logprobs=[0.0] * len(t), finish_reason="stop"
                )
                for t in texts
            ],
        )  # fmt: skip
        for texts in (["ab", "abcd"], ["xyz", "q"])
    ]
    with build_reward(cfg.reward) as reward:
        scored = score_groups([0, 1], problems, groups, tokenizer=Chars(), reward=reward)
    assert scored[0].parts[name] == [3.0, 5.0] and scored[1].parts[name] == [4.0, 2.0]
    assert scored[0].rewards == [1.5, 2.5]  # format scores 0: 0.5 x (len + 1)
    assert scored[0].details[f"{name}/prompt_len"] == [5.0, 5.0]
    assert scored[1].details[f"{name}/has_id"] == [0.0, 0.0]
    line = rollout_metrics(scored)
    assert line[f"reward/{name}"] == pytest.approx(3.5)
    assert line[f"reward/{name}/prompt_len"] == pytest.approx(6.5)
    assert line[f"reward/{name}/has_id"] == pytest.approx(0.5)


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_reward_that_raises_stops_the_scoring_or_scores_zero_and_is_counted(tmp_path, on_error):
    from cwgrpo_megatron.reward import RewardError, build_reward

    name = fresh("flaky")
    call = """
        if any("boom" in c for c in completions):
            raise ConnectionError("the sandbox is down")
        return [1.0] * len(completions)
    """
    path = write_plugin(tmp_path, reward_source(name, call))
    cfg = load_config(
        overrides=[
            f"reward.weights={{format: 1.0, {name}: 1.0}}",
            f"reward.on_error={on_error}",
            "reward.verifier=integer_answer",
        ],
        plugins=[str(path)],
    ).reward
    with build_reward(cfg) as reward:
        fine = reward.score(completions=["a", "b"], answers=["1", "1"])
        assert fine.parts[name] == [1.0, 1.0] and not fine.details
        if on_error == "raise":
            with pytest.raises(RewardError, match=f"reward '{name}' failed: ConnectionError: the"):
                reward.score(completions=["boom", "b"], answers=["1", "1"])
        else:
            out = reward.score(completions=["boom", "b"], answers=["1", "1"])
            assert out.parts[name] == [0.0, 0.0] and out.details == {f"{name}/errors": [1.0, 1.0]}


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ("[1.0]", "returned 1 values for 2 completions"),
        ("[1.0, float('nan')]", "returned nan: scores must be finite numbers"),
        ("[True, False]", "returned True: scores must be finite numbers"),
        ("[{'s': 1.0}, {'t': 2.0}]", r"every completion's dict must have keys \['s'\]"),
    ],
)
def test_a_malformed_reward_result_is_named(tmp_path, result, message):
    from cwgrpo_megatron.reward import RewardError, WeightedReward

    name = fresh("bad")
    path = write_plugin(tmp_path, reward_source(name, f"return {result}"))
    load_plugins([str(path)])
    failed = pytest.raises(RewardError, match=f"reward '{name}' failed: ValueError: .*{message}")
    with WeightedReward({name: 1.0}, verifier="integer_answer") as reward, failed:
        reward.score(completions=["a", "b"], answers=["1", "1"])


def test_a_plugin_schema_reads_rows_and_its_errors_name_the_line(tmp_path):
    from cwgrpo_megatron.data.prompts import load_problems

    load_plugins([str(EXAMPLES / "toy_benchmark.py")])
    problems, _ = load_problems(EXAMPLES / "toy_sums.jsonl", schema="toy_sums")
    assert len(problems) == 12 and problems[0].extra["question"] == problems[0].problem
    cfg = load_config(
        overrides=["data.schema=toy_sums"], plugins=[str(EXAMPLES / "toy_benchmark.py")]
    )
    assert cfg.data.schema == "toy_sums"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "result": 2}\n{"result": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: schema 'toy_sums' failed: KeyError"):
        load_problems(bad, schema="toy_sums")


def test_a_plugin_benchmark_is_loaded_by_name_and_scored_by_its_scorer():
    from cwgrpo_megatron.eval.runner import EvalRequest, _score, benchmark_scorer, load_benchmarks
    from cwgrpo_megatron.reward import get_reward

    cfg = load_config(
        overrides=["eval.benchmarks=[toy_sums, aime24]"],
        plugins=[str(EXAMPLES / "toy_benchmark.py")],
    )
    benchmarks = load_benchmarks(cfg.eval.benchmarks, limit=2)
    assert [p.answer for p in benchmarks["toy_sums"]] == ["74", "30"]
    assert benchmark_scorer("toy_sums") == "integer_answer" and benchmark_scorer("aime24") is None
    chunk = [EvalRequest("toy_sums", i, [1], None) for i in range(2)]
    problems = benchmarks["toy_sums"]
    scorers = {"integer_answer": get_reward("integer_answer")}
    with get_reward("format") as default:  # what a benchmark without a scorer would use
        scores, answers = _score(default, scorers, chunk, problems, ["74", "so 31", "30", "30!"], 2)
    assert scores == [1.0, 0.0, 1.0, 1.0]  # integer_answer's verdicts (format gives 0 here)
    assert answers == ["74", "31", "30", "30"]  # and the answers it read


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_reward_call_past_its_time_limit_fails_and_is_not_called_again_while_it_runs(
    tmp_path, on_error
):
    import threading

    from cwgrpo_megatron.reward import RewardError, build_reward

    name = fresh("slow")
    path = write_plugin(
        tmp_path,
        f"""
        import threading
        from cwgrpo_megatron.reward import Reward, register_reward

        RELEASE = threading.Event()
        CALLS = []

        @register_reward("{name}")
        class Slow(Reward):
            def __call__(self, *, completions, **_):
                CALLS.append(list(completions))
                if "slow" in completions:
                    RELEASE.wait(30)
                return [1.0] * len(completions)
        """,
    )
    (record,) = load_plugins([str(path)])
    import sys

    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == record.file)
    cfg = load_config(
        overrides=[
            f"reward.weights={{{name}: 1.0}}",
            f"reward.on_error={on_error}",
            "reward.call_timeout_s=0.3",
            "reward.verifier=integer_answer",
        ],
        plugins=[str(path)],
    ).reward
    with build_reward(cfg) as reward:
        assert reward.score(completions=["a"], answers=["1"]).parts[name] == [1.0]
        if on_error == "raise":
            with pytest.raises(RewardError, match=r"CallTimeout: it did not return within 0.3 s"):
                reward.score(completions=["slow"], answers=["1"])
        else:
            out = reward.score(completions=["slow"], answers=["1"])
            assert out.parts[name] == [0.0] and out.details[f"{name}/errors"] == [1.0]
            # still running: the next call fails at once, without calling the reward
            out = reward.score(completions=["b", "c"], answers=["1", "1"])
            assert out.details[f"{name}/errors"] == [1.0, 1.0]
            assert module.CALLS == [["a"], ["slow"]]
        module.RELEASE.set()
        for thread in threading.enumerate():
            if thread.name == "timed-reward-call":
                thread.join(5)
        assert reward.score(completions=["d"], answers=["1"]).parts[name] == [1.0]
