"""Math answer verification with math-verify, in a TimeoutPool (see pool.py).

    gold        wrapped as \\boxed{answer} before parsing
    prediction  the last \\boxed{...} of the completion, after </think> where that tag is present

A verification that times out, fails to parse or raises scores 0 and is counted, never raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cwgrpo_megatron.data.latex import last_boxed

THINK_END = "</think>"


def answer_region(completion: str) -> str:
    """The part of a completion that may hold the final answer: after the last </think>."""
    head, sep, tail = completion.rpartition(THINK_END)
    return tail if sep else completion


def verify_one(completion: str, answer: str) -> tuple[float, str]:
    """(score, outcome) with outcome one of ok, no_answer, parse_error. Runs in a worker."""
    from math_verify import parse, verify

    # math-verify warns that its own timeouts are off: the pool enforces them from outside
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    boxed = last_boxed(answer_region(completion))
    if boxed is None:
        return 0.0, "no_answer"
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    if not gold or not pred:
        return 0.0, "parse_error"
    return (1.0 if verify(gold, pred, timeout_seconds=None) else 0.0), "ok"


@dataclass
class VerifyStats:
    total: int = 0
    correct: int = 0
    no_answer: int = 0
    parse_error: int = 0
    timeouts: int = 0
    errors: int = 0


def gold_parses(answer: str) -> bool:
    """Whether math-verify can parse `\\boxed{answer}` (a dataset's gold answer is usable)."""
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return bool(parse(f"\\boxed{{{answer}}}", parsing_timeout=None))
