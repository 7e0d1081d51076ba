"""Math answer verification with math-verify, in a TimeoutPool (see pool.py).

    gold        wrapped as \\boxed{answer} before parsing
    prediction  the last \\boxed{...} of the completion, after </think> where that tag is present

A verification that times out, fails to parse or raises scores 0 and is counted, never raised.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

THINK_END = "</think>"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (balanced braces), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


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
