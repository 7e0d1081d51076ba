"""The trainer end to end on a tiny random Qwen2, as users start it: `python -m
cwgrpo_megatron.train`, torchrun on the launcher, the launcher's bash form, resume after
SIGKILL, the HF export. The vLLM runs use dynamic sampling (`DYNAMIC`), so its rounds are
checked at TP2 against one process, and across a SIGKILL in one process and at DP2."""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from cwgrpo_megatron.common.processes import free_port
from cwgrpo_megatron.config import load_config
from tests.distributed.harness import run_tool
from tests.engine_calls import expected_calls, replica_calls
from tests.once import build_once

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "examples" / "train_cwgrpo_tiny_cpu.sh"
"""The launcher of configs/tiny_cpu.yaml: it takes `run_args`, and stacks any --config on it."""
KILL_SCRIPT = Path(__file__).with_name("kill_script.py")
TINY = REPO / "configs" / "tiny_cpu.yaml"
FILES = ("config.yaml", "env.json", "metrics.jsonl", "samples", "tb", "checkpoints", "hf")
METRICS = (
    "step",
    "reward/mean",
    "reward/std",
    "reward/accuracy",
    "reward/cosine_length",
    "reward/repetition",
    "accuracy/mean",
    "actor/loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/kl",
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/lr",
    "cw/sigma",
    "cw/w_min",
    "cw/w_max",
    "cw/frac_w_below_half",
    "cw/ess",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "response/repetition_4gram",
    "rollout/gap_mean",
    "rollout/gap_max",
    "rollout/policy_lag",
    "groups/frac_zero_std",
    *(f"timing_s/{p}" for p in ("rollout", "rollout_wait", "reward", "old_logp", "train")),
    *(f"timing_s/{p}" for p in ("sync", "eval")),
    "timing_s/checkpoint",
    "timing_s/step",
    "perf/tokens_per_s",
)
DYNAMIC = (
    "train.dynamic_sampling=true",
    "train.gen_prompts_per_step=6",
    "train.dynamic_sampling_eps=0.15",
    "train.max_gen_batches=8",
    "run.probe_groups=2",
)
"""Dynamic sampling on the tiny task, with a threshold that drops about half of its groups
(their reward stds are 0-0.21): rounds of 6 prompts until 4 groups have a std >= 0.15. And a
probe set of step 1's first 2 groups (probe/entropy every step)."""


ONE_THREAD = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""One thread a process, trainer and engine, as torchrun gives its workers: the suite's two
workers share two cores, and a launch whose every process takes both only adds switching.
(A separate engine's cores, rollout.cpu_cores, still bind it.)"""


def launch(cmd: list[str], *, env: dict | None = None, timeout: float = 420):
    """(exit code, output) of `cmd`, run in its own session with output in a file (a SIGKILLed
    trainer can leave helper processes that would hold pipes open); afterwards its whole
    process group is killed. A run past `timeout` gives code 124 and what it printed."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD, **(env or {})}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env['PATH']}"  # torchrun
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=full_env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        return code, out.read()


def run_args(model: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", f"run.out_dir={out}", *extra]


def train_args(model: Path, out: Path, *extra: str) -> list[str]:
    """`run_args` on configs/tiny_cpu.yaml, for `python -m cwgrpo_megatron.train`."""
    return ["--config", str(TINY), *run_args(model, out, *extra)]


MODULE = "cwgrpo_megatron.train"


def python_train(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", MODULE, *train_args(model, out, *extra)]


def torchrun(nproc: int) -> list[str]:
    return [
        "torchrun",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--nproc-per-node",
        str(nproc),
    ]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


def check_run_folder(out: Path, steps: int) -> list[dict]:
    for name in FILES:
        assert (out / name).exists(), f"{name} missing from the run folder"
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        missing = set(METRICS) - set(row)
        assert not missing, f"step {row['step']} lacks {sorted(missing)}"
        bad = {
            k: v for k, v in row.items() if not (isinstance(v, int | float) and math.isfinite(v))
        }
        assert not bad, f"non-finite metrics: {bad}"
    env = json.loads((out / "env.json").read_text())
    assert env["versions"]["torch"] and env["hostnames"] and "tp" in env["layout"]
    assert env["layer_spec"] == "local"  # no Transformer Engine on CPU
    samples = out / "samples" / f"step_{steps:08d}.jsonl.gz"
    records = [json.loads(x) for x in gzip.decompress(samples.read_bytes()).splitlines()]
    assert len(records) == 16  # 4 prompts x 4 completions
    assert {"prompt", "completion", "reward", "finish_reason", "parts"} <= set(records[0])
    assert list((out / "tb").glob("events.out.tfevents.*"))
    return rows


@pytest.fixture(scope="session")
def vllm_run(tiny, tmp_path_factory) -> Path:
    """The reference: 3 steps with the vLLM engine and dynamic sampling in one process, a
    checkpoint every step (built once per session, `tests/once.py`)."""

    def build(folder: Path) -> Path:
        out = folder / "run"
        code, log = launch(python_train(tiny, out, "run.verify_sync=1", *DYNAMIC))
        assert code == 0, log
        for warning in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
            assert warning not in log, "megatron-core's TE / Apex fallback warnings are back"
        return out

    return build_once(tmp_path_factory, "vllm_run", build)


def test_one_process_with_vllm_writes_the_whole_run_folder(vllm_run):
    rows = check_run_folder(vllm_run, steps=3)
    assert all(r["sync/gap"] <= r["sync/tol"] == 1e-4 for r in rows)
    assert rows[-1]["eval/heldout/avg@2"] >= 0.0  # run.eval_every=3: the last step evaluates
    # synchronous (rollout.async_steps=0): each step samples with the weights it trains, and
    # no checkpoint holds rollouts made ahead, only the probe set (run.probe_groups, DYNAMIC)
    assert all(r["rollout/policy_lag"] == 0 and r["timing_s/rollout_wait"] < 0.01 for r in rows)
    kept = list((vllm_run / "checkpoints").glob("*/data_objects.pt"))
    assert kept and all(set(torch.load(p, weights_only=False)) == {"probe"} for p in kept)
    # dynamic sampling: every step full of groups with a reward spread, after several rounds
    for r in rows:
        assert r["dynamic/groups_kept"] == 4 and r["dynamic/cap_reached"] == 0, r
        assert r["dynamic/groups_generated"] == 6 * r["dynamic/rounds"], r
        assert "dynamic/reward_generated" in r, r
        assert r["groups/frac_zero_std"] == 0, r
    assert max(r["dynamic/rounds"] for r in rows) > 1, "no step needed a second round"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(vllm_run / "tb"))
    events.Reload()
    rounds = [e.value for e in events.Scalars("dynamic/rounds")]
    assert rounds == [r["dynamic/rounds"] for r in rows]
    assert rows[-1]["actor/kl"] > 0, "the policy never moved away from the reference"
    steps = sorted(p.name for p in (vllm_run / "checkpoints").iterdir())
    assert steps == ["step_00000002", "step_00000003"]  # run.keep_last=2


def test_a_run_folder_converts_to_hf_that_transformers_and_vllm_load(vllm_run, tiny, tmp_path):
    """The run's newest training checkpoint, through the converter as users call it: its
    policy in HF, logits equal to the trainer's, and vLLM serves it (tools/evaluate.py)."""
    from tests.e2e.export_check import export_matches_checkpoint

    hf = tmp_path / "hf"
    code, log = run_tool("convert_megatron_to_hf.py", 1, "--ckpt", str(vllm_run), "--out", str(hf))
    assert code == 0, log
    worst = export_matches_checkpoint(hf, vllm_run / "checkpoints" / "step_00000003", tiny)
    assert worst < 1e-5, worst
    # a checkpoint's model/ folder names that checkpoint
    model_dir = vllm_run / "checkpoints" / "step_00000002" / "model"
    argv = ("--ckpt", str(model_dir), "--out", str(tmp_path / "hf2"))
    code, log = run_tool("convert_megatron_to_hf.py", 1, *argv)
    assert code == 0 and "step_00000002" in log, log
    # short problems: the tiny model has 256 positions
    problems = tmp_path / "short.jsonl"
    problems.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n"
                                for q, a in (("1 + 1 = ?", "2"), ("2 + 5 = ?", "7"))))  # fmt: skip
    results = tmp_path / "eval.json"
    tool = [sys.executable, str(REPO / "tools" / "evaluate.py"), "--model-dir", str(hf)]
    code, log = launch(
        [*tool, "--benchmarks", str(problems), "--n", "2", "--max-tokens", "8",
         "--max-model-len", "256", "--dtype", "float32", "--out", str(results)]
    )  # fmt: skip
    assert code == 0, log
    samples = json.loads(results.read_text())["samples"]
    assert len(samples) == 4 and all(s["tokens"] >= 1 for s in samples)


def test_torch_engine_from_a_megatron_checkpoint_and_its_hf_export(tiny, tmp_path):
    ckpt = tmp_path / "megatron"
    # the converter's main (its command is tested in tests/distributed/test_conversion.py)
    code, log = run_tool("convert_hf_to_megatron.py", 1, "--hf-dir", str(tiny), "--out", str(ckpt))
    assert code == 0, log
    out = tmp_path / "run"
    code, log = launch(python_train(ckpt, out, "rollout.backend=torch"))
    assert code == 0, log
    check_run_folder(out, steps=3)
    from tests.e2e.export_check import export_matches_checkpoint

    worst = export_matches_checkpoint(out / "hf", out / "checkpoints" / "step_00000003", tiny)
    assert worst < 1e-5, worst


def _check_two_process_run(out: Path, code: int, log: str, layout: dict, steps: int) -> list:
    assert code == 0, log
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert json.loads((out / "env.json").read_text())["layout"] == layout
    # verify_sync after every step: the engine scores like the trainer, which has moved
    assert all(r["sync/gap"] <= r["sync/tol"] for r in rows), rows
    assert rows[-1]["actor/kl"] > 0
    return rows


def test_torchrun_on_the_launcher_at_tp2_trains_like_one_process(tiny, vllm_run, tmp_path):
    """With two overlays stacked on the launcher's recipe: the algorithm file (the recipe's
    own algorithm settings, so the run is the reference's) and one that sets run.log_every."""
    out, overlay = tmp_path / "run", tmp_path / "overlay.yaml"
    overlay.write_text("run:\n  log_every: 3\n")
    algo = REPO / "configs" / "cw_grpo_open_rs.yaml"
    stacked = ["--config", str(algo), "--config", str(overlay)]
    extra = ("parallel.tp=2", "run.verify_sync=1", *DYNAMIC)
    code, log = launch([*torchrun(2), str(LAUNCHER), *stacked, *run_args(tiny, out, *extra)])
    layout = {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "expert_tp": 1}
    rows = _check_two_process_run(out, code, log, layout, steps=3)
    # the same seeds give the same completions, the same rounds and groups kept, and TP
    # changes only the order of fp32 sums
    same_run_as(out, rows, vllm_run)
    # config.yaml: the recipe's values under the overlays', then the overrides; its sources
    # head it in order, and it loads as a config
    saved = yaml.safe_load((out / "config.yaml").read_text())
    recipe = yaml.safe_load(TINY.read_text())
    assert saved["rollout"]["max_tokens"] == recipe["rollout"]["max_tokens"] == 16
    assert saved["train"]["group_size"] == recipe["train"]["group_size"] == 4
    assert saved["algo"]["kl_beta"] == 0.04 and saved["run"]["log_every"] == 3
    assert saved["parallel"]["tp"] == 2 and saved["run"]["out_dir"] == str(out)
    sources = [line for line in (out / "config.yaml").read_text().splitlines() if "#   " in line]
    assert sources[:3] == [f"#   {i}. {p}" for i, p in enumerate((TINY, algo, overlay), 1)]
    assert sources[3].startswith("#   4. overrides: model.path=") and len(sources) == 4
    stacked_cfg = load_config([TINY, algo, overlay], run_args(tiny, out, *extra))
    assert load_config(out / "config.yaml") == stacked_cfg


def same_run_as(out: Path, rows: list[dict], reference: Path) -> None:
    """The same completions step by step as the `reference` run (another layout or placement),
    and every value of every step within the fp32 order of its sums (the engines' gaps
    aside)."""
    for step in range(1, len(rows) + 1):
        assert samples(out, step) == samples(reference, step), f"step {step}"
    for ours, single in zip(
        without_timings(rows), without_timings(metrics(reference)), strict=True
    ):
        assert ours.keys() == single.keys()
        for key, value in single.items():
            if not key.startswith("sync/"):
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def samples(out: Path, step: int) -> list[dict]:
    path = out / "samples" / f"step_{step:08d}.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]


@pytest.mark.parametrize(
    ("where", "count", "left", "nproc"),
    [
        # killed in step 2's update at DP2: step 1's checkpoint is the newest
        pytest.param("in-step", 2, ["step_00000001"], 2, id="kill-in-step-2-dp2"),
        # killed in the save of step 2, files written but not renamed: step 1's again
        pytest.param(
            "in-save", 2, [".step_00000002.partial", "step_00000001"], 1, id="kill-in-save-2"
        ),
    ],
)
def test_sigkill_then_resume_writes_the_uninterrupted_metrics(
    where, count, left, nproc, tiny, vllm_run, tmp_path
):
    """With dynamic sampling, whose rounds move the sampler by a varying count each step. In
    one process the run after the cut equals the uninterrupted one value for value. At DP2
    (killed under torchrun, resumed by the launcher's bash form) it has the one-process run's
    completions and rounds, and its values within the fp32 order of the DP all-reduce."""
    out = tmp_path / "run"
    traced = ("run.verify_sync=1", "run.trace_engine=true", "rollout.sleep_level=2", *DYNAMIC)
    kill = [str(KILL_SCRIPT), where, str(count), *train_args(tiny, out, *traced)]
    resume = train_args(tiny, out, *traced, "run.resume=auto")
    env = None
    if nproc == 1:
        killed_run, resumed_run = [sys.executable, *kill], [sys.executable, "-m", MODULE, *resume]
    else:  # torchrun starts the kill script in place of the launcher; torchrun then exits 1
        resume = run_args(tiny, out, *traced, "run.resume=auto")
        killed_run, resumed_run = [*torchrun(nproc), *kill], ["bash", str(LAUNCHER), *resume]
        env = {"NNODES": "1", "GPUS_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())}
    code, log = launch(killed_run)
    assert code == (-signal.SIGKILL if nproc == 1 else 1), log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == left
    killed = replica_calls(out / "engine_calls.jsonl", 0)
    code, log = launch(resumed_run, env=env)
    assert code == 0, log
    assert "resumed from" in log and "at step 1" in log
    # the probe set is step 1's, kept in the checkpoint: the resumed steps score the same
    # sequences (the comparisons below include probe/entropy), which the updates move
    probes = [row["probe/entropy"] for row in metrics(out) if "probe/entropy" in row]
    assert len(probes) == 3 and len(set(probes)) == 3, probes
    if nproc == 1:
        assert without_timings(metrics(out)) == without_timings(metrics(vllm_run))
    else:
        assert json.loads((out / "env.json").read_text())["layout"]["dp"] == 2
        same_run_as(out, metrics(out), vllm_run)
    # the engine's calls: the killed run's are the start of an uninterrupted run's (step 2's
    # rollouts and sleep at least); the resumed run loads step 1's weights into its fresh
    # engine, then runs steps 2 and 3 in the same order (step 3 evaluates)
    whole = expected_calls([1, 2, 3], 2, eval_steps=[3])
    assert len(killed) >= 7 and killed == whole[: len(killed)], killed
    resumed = expected_calls([2, 3], 2, eval_steps=[3], resumed_at=1)
    assert replica_calls(out / "engine_calls.jsonl", 0) == killed + resumed


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (4 experts, top-2) whose completions end at varied lengths."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen3_moe

    return build_once(
        tmp_path_factory, "tiny_moe", lambda d: save_tiny_qwen3_moe(d / "hf", end_tokens=32)
    )


def test_qwen3_moe_at_tp2_ep2_trains_under_torchrun_and_resumes_exactly_after_sigkill(
    tiny_moe, tmp_path
):
    """The whole loop on 4 ranks with the experts split over 2 of them beside TP2 (TP2 x DP2 x
    EP2, sequence parallel): vLLM rollouts from the synced experts, CW-GRPO's statistics from
    their sampling log-probs (algo.stats_logp=rollout: no forward-only pass), checkpoints, the
    HF export; killed in step 2's update and resumed by the launcher, it writes the
    uninterrupted run's metrics value for value."""
    ep2 = ("parallel.tp=2", "parallel.ep=2", "run.verify_sync=1", "algo.stats_logp=rollout")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    env = {"NNODES": "1", "GPUS_PER_NODE": "4"}
    code, log = launch(
        ["bash", str(LAUNCHER), *run_args(tiny_moe, whole, *ep2)],
        env={**env, "MASTER_PORT": str(free_port())},
    )
    assert code == 0, log
    rows = check_run_folder(whole, steps=3)
    layout = json.loads((whole / "env.json").read_text())["layout"]
    assert (layout["tp"], layout["dp"], layout["ep"]) == (2, 2, 2)
    assert all(0 < r["moe/load_balancing_loss"] <= 4 for r in rows)
    kill = [str(KILL_SCRIPT), "in-step", "2", *train_args(tiny_moe, cut, *ep2)]
    code, log = launch([*torchrun(4), *kill])
    assert code == 1, log
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_00000001"]
    code, log = launch(
        ["bash", str(LAUNCHER), *run_args(tiny_moe, cut, *ep2, "run.resume=auto")],
        env={**env, "MASTER_PORT": str(free_port())},
    )
    assert code == 0 and "resumed from" in log and "at step 1" in log, log
    assert without_timings(metrics(cut)) == without_timings(rows)
