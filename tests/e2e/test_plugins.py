"""Plugins end to end, as docs/extending.md runs them: a DP2 torchrun run of the tiny model
with the example reward and loss, each with a setting from the command line, killed in step 2
and resumed; a resume with an edited plugin refused; a misspelt option and a plugin that raises
on import stopping every rank with a message naming them."""

import json
import shutil
import sys

from tests.e2e.test_train import (
    KILL_SCRIPT,
    MODULE,
    REPO,
    launch,
    metrics,
    torchrun,
    train_args,
)

EXAMPLES = REPO / "examples" / "plugins"


def plugin_args(folder) -> list[str]:
    """The loss as --plugin, the reward in run.plugins, each with an option set here; the
    reward from a copy (so that the test can edit it)."""
    reward = folder / "length_target.py"
    shutil.copy(EXAMPLES / "length_target.py", reward)
    return [
        "--plugin",
        str(EXAMPLES / "seq_clip_grpo.py"),
        f"run.plugins=[{reward}]",
        "reward.weights={accuracy: 1.0, length_target: 0.5}",
        "reward.options.length_target.target=8",
        "algo.policy_loss=seq_clip_grpo",
        "algo.options.seq_clip_grpo.max_abs=0.5",
    ]


def test_a_dp2_run_with_a_plugin_reward_and_loss_trains_and_resumes_after_a_kill(tiny, tmp_path):
    out = tmp_path / "run"
    args = [*train_args(tiny, out, "rollout.backend=torch"), *plugin_args(tmp_path)]
    code, log = launch([*torchrun(2), str(KILL_SCRIPT), "in-step", "2", *args])
    assert code == 1, log  # torchrun's code once a worker is SIGKILLed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    code, log = launch([*torchrun(2), "-m", MODULE, *args, "run.resume=auto"])
    assert code == 0, log
    assert "resumed from" in log and "at step 1" in log
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # the reward's own score (-|L - 8| / 8 in [-1, 0]) and its named values; the loss's
        assert -1.0 <= row["reward/length_target"] <= 0.0
        assert row["reward/length_target/gap"] >= 0.0
        assert row["reward/length_target/has_level"] == 1.0  # MATH rows have a level
        assert 0.0 <= row["actor/adv_clip_frac"] <= 1.0
    assert any(r["actor/adv_clip_frac"] > 0 for r in rows), "max_abs=0.5 clips no advantage"
    env = json.loads((out / "env.json").read_text())
    assert env["layout"]["dp"] == 2
    recorded = {p["entry"]: p for p in env["plugins"]}
    reward_file = str((tmp_path / "length_target.py").resolve())
    assert set(recorded) == {reward_file, str(EXAMPLES / "seq_clip_grpo.py")}
    assert len(recorded[reward_file]["sha256"]) == 64
    # the reward's file edited: its checkpoints were trained with other code
    with (tmp_path / "length_target.py").open("a") as f:
        f.write("\n# edited\n")
    code, log = launch([sys.executable, "-m", MODULE, *args, "run.resume=auto"])
    assert code == 1, log
    assert f"plugin '{reward_file}' changed since" in log and "step_00000003" in log


def test_a_misspelt_option_and_a_plugin_that_raises_stop_every_rank(tiny, tmp_path):
    out = tmp_path / "run"
    misspelt = [*train_args(tiny, out), *plugin_args(tmp_path)]
    misspelt[misspelt.index("algo.options.seq_clip_grpo.max_abs=0.5")] = (
        "algo.options.seq_clip_grpo.max_abz=0.5"
    )
    code, log = launch([*torchrun(2), "-m", MODULE, *misspelt])
    assert code == 1, log
    said = "policy loss 'seq_clip_grpo' has no option 'max_abz'; it accepts: max_abs"
    for rank in (0, 1):
        assert f"[rank {rank}] error: algo.options.seq_clip_grpo.max_abz: {said}" in log, log
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("import json\nraise ImportError('needs the sandbox client')\n")
    code, log = launch(
        [*torchrun(2), "-m", MODULE, *train_args(tiny, out), "--plugin", str(broken)]
    )
    assert code == 1, log
    for rank in (0, 1):
        assert f"[rank {rank}] error: run.plugins entry '{broken}' failed to import:" in log, log
    assert "ImportError: needs the sandbox client" in log and 'broken_plugin.py", line 2' in log
    assert not (out / "checkpoints").exists()
