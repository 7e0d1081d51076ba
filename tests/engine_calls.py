"""The engine calls a run must make (docs/design.md, section 4), against its
engine_calls.jsonl (`run.trace_engine`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cwgrpo_megatron.rollout.trace import read_calls


def step_calls(step: int, level: int, *, evaluates: bool) -> list[tuple]:
    """One step of one replica: rollouts, sleep, weights back, the load, KV cache back, and
    the evaluation's generate calls (one, once consecutive ones are merged) when it is due."""
    calls = [
        (step, "generate", None, None),
        (step, "sleep", level, None),
        (step, "wake", None, ("weights",)),
        (step, "load", None, None),
        (step, "wake", None, ("kv_cache",)),
    ]
    return calls + [(step, "generate", None, None)] if evaluates else calls


def expected_calls(
    steps: Iterable[int], level: int, *, eval_steps: Iterable[int] = (), resumed_at=None
) -> list[tuple]:
    """A replica's calls over `steps`; a resumed run first loads the checkpoint's weights."""
    calls = [] if resumed_at is None else [(resumed_at, "load", None, None)]
    for step in steps:
        calls += step_calls(step, level, evaluates=step in set(eval_steps))
    return calls


def replica_calls(path: Path, replica: int) -> list[tuple]:
    """`replica`'s calls in the file, with consecutive generate calls of one step merged (an
    evaluation makes one per batch of prompts)."""
    out = []
    for r in read_calls(path):
        if r["replica"] != replica:
            continue
        call = (r["step"], r["call"], r["level"], None if r["tags"] is None else tuple(r["tags"]))
        if not (out and call[1] == "generate" and out[-1] == call):
            out.append(call)
    return out
