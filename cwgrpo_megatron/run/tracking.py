"""Where a step's metrics go, on rank 0: metrics.jsonl (every step, appended and flushed), a
tqdm bar, and every run.log_every steps a console line, TensorBoard and Weights & Biases. At
the end, `summary()` gives the time per phase and the first and last evaluation.

Other ranks hold a tracker that does nothing, so the loop calls it unconditionally.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import uuid

from tqdm import tqdm

from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.run.run_dir import RunDir
from cwgrpo_megatron.run.step_metrics import PHASES, Histogram

log = logging.getLogger("cwgrpo_megatron.train")
BAR_KEYS = {"reward/mean": "reward", "actor/entropy": "entropy", "timing_s/step": "s/step"}
CONSOLE_KEYS = (
    "reward/mean",
    "accuracy/mean",
    "actor/loss",
    "actor/grad_norm",
    "actor/entropy",
    "cw/sigma",
    "response_length/mean",
    "timing_s/step",
)


def _json_value(value: float):
    """JSON has no NaN / inf: they are written as strings ("nan", "inf"), never dropped."""
    return value if math.isfinite(value) else str(value)


class Tracker:
    def __init__(self, cfg: Config, run: RunDir, *, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.every = cfg.run.log_every
        self.heldout_key = f"eval/heldout/avg@{cfg.eval.n}"
        self.phase_seconds: dict[str, float] = {}
        self.steps_logged = 0
        self.heldout: list[float] = []
        self.file = self.tb = self.wandb = self.bar = None
        if not enabled:
            return
        self.file = run.metrics.open("a", encoding="utf-8")
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # events of steps this run is about to redo (after a resume) are dropped
            self.tb = SummaryWriter(str(run.tb), purge_step=start_step + 1)
        if cfg.logging.wandb_mode != "disabled":
            self.wandb = _start_wandb(cfg, run)
        total = cfg.train.total_steps
        self.bar = tqdm(total=total, initial=start_step, desc="training", unit="step", leave=True)

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        advance: bool = True,
        histograms: dict[str, Histogram | None] | None = None,
    ) -> None:
        """One metrics line; `advance=False` for a line that is not a training step (the
        evaluation before the first one). `histograms` go to TensorBoard only."""
        if not self.enabled:
            return
        line = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self._remember(metrics, advance)
        if advance:
            self.bar.update(1)
        self.bar.set_postfix(
            {short: f"{metrics[k]:.3g}" for k, short in BAR_KEYS.items() if k in metrics},
            refresh=True,
        )
        if step % self.every:
            return
        shown = "  ".join(f"{k} {metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        log.info("step %d  %s", step, shown)
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            for key, hist in (histograms or {}).items():
                if hist is not None:
                    self.tb.add_histogram_raw(key, *hist, global_step=step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def _remember(self, metrics: dict[str, float], advance: bool) -> None:
        self.steps_logged += advance
        for key, value in metrics.items():
            if key.startswith("timing_s/"):
                phase = key.removeprefix("timing_s/")
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + value
        if self.heldout_key in metrics:
            self.heldout.append(metrics[self.heldout_key])

    def summary(self) -> list[str]:
        """Lines for the end of a run: seconds per phase over the steps this process ran, and,
        when the held-out set was evaluated at least twice, "held-out accuracy: a -> b"."""
        if not self.enabled or not self.steps_logged:
            return []
        seconds = self.phase_seconds
        phases = "  ".join(f"{k} {seconds[k]:.1f}" for k in PHASES if seconds.get(k, 0) > 0)
        lines = [f"time per phase over {self.steps_logged} steps (s): {phases}"]
        if len(self.heldout) >= 2:
            lines.append(f"held-out accuracy: {self.heldout[0]:.2f} -> {self.heldout[-1]:.2f}")
        return lines

    def close(self) -> None:
        for sink in (self.bar, self.tb):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.file is not None:
            self.file.close()


def _start_wandb(cfg: Config, run: RunDir):
    try:
        import wandb
    except ImportError as err:
        raise ValueError(
            f"logging.wandb_mode={cfg.logging.wandb_mode} needs wandb: pip install wandb, or set "
            "logging.wandb_mode=disabled"
        ) from err
    # one W&B run per run folder: a resumed start continues it
    id_file = run.root / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    write_atomic(id_file, run_id + "\n")
    return wandb.init(
        project=cfg.logging.wandb_project,
        name=cfg.logging.wandb_name or run.root.name,
        id=run_id,
        resume="allow",
        mode=cfg.logging.wandb_mode,
        dir=str(run.root),
        config=dataclasses.asdict(cfg),
    )
