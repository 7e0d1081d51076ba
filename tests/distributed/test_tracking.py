"""The metric sinks on rank 0: metrics.jsonl, TensorBoard and W&B (offline, which runs a service
process of its own), and resume."""

import json

from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.run.run_dir import RunDir
from cwgrpo_megatron.run.tracking import Tracker


def _tracker(tmp_path, *, start_step: int, enabled: bool = True) -> Tracker:
    cfg = load_config(
        overrides=[
            f"run.out_dir={tmp_path}",
            "logging.wandb_mode=offline",
            "logging.tensorboard=true",
            "run.log_every=2",
            "train.total_steps=4",
        ]
    )
    return Tracker(cfg, RunDir(tmp_path), start_step=start_step, enabled=enabled)


def test_every_sink_gets_the_metrics_and_a_resumed_run_continues_its_wandb_run(tmp_path):
    tracker = _tracker(tmp_path, start_step=0)
    for step in (1, 2):
        tracker.log(step, {"reward/mean": 0.5 * step, "actor/grad_norm": float("nan")})
    tracker.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "reward/mean": 0.5, "actor/grad_norm": "nan"},
        {"step": 2, "reward/mean": 1.0, "actor/grad_norm": "nan"},
    ]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    run_id = (tmp_path / "wandb_id").read_text().strip()
    offline = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline and list(offline[0].glob("*.wandb")), "no offline W&B run was written"
    again = _tracker(tmp_path, start_step=2)  # a resumed start: the same W&B run
    again.log(3, {"reward/mean": 2.0})
    again.close()
    assert (tmp_path / "wandb_id").read_text().strip() == run_id
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_disabled_tracker_writes_nothing(tmp_path):
    tracker = _tracker(tmp_path, start_step=0, enabled=False)
    tracker.log(1, {"reward/mean": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_the_summary_gives_phase_times_and_heldout_before_and_after(tmp_path):
    tracker = _tracker(tmp_path, start_step=0)
    tracker.log(0, {"eval/heldout/avg@1": 0.328, "timing_s/eval": 2.0}, advance=False)
    for step in (1, 2):
        tracker.log(step, {"reward/mean": 0.5, "timing_s/rollout": 1.5, "timing_s/step": 4.0})
    tracker.log(3, {"eval/heldout/avg@1": 0.914, "timing_s/eval": 1.0, "timing_s/step": 2.0})
    tracker.close()
    assert tracker.summary() == [
        "time per phase over 3 steps (s): rollout 3.0  eval 3.0  step 10.0",
        "held-out accuracy: 0.33 -> 0.91",
    ]
    assert tracker.bar.n == 3, "the evaluation before step 1 is not a step"
    (tmp_path / "b").mkdir()
    once = _tracker(tmp_path / "b", start_step=0)
    once.log(1, {"eval/heldout/avg@1": 0.5, "timing_s/step": 1.0})
    once.close()
    assert once.summary() == ["time per phase over 1 steps (s): step 1.0"]
