"""Seeded synthetic tasks with integer answers: a model can visibly learn them in minutes on CPU.

As a prompt source, in `data.train_files` (or anywhere a file name is read):

    synthetic:TASK               2000 problems drawn with seed 0
    synthetic:TASK?n=500&seed=3  500 problems drawn with seed 3

Tasks (`SYNTHETIC_TASKS`, a registry; each draws one problem from a `random.Random`):

    repeat     "Repeat this number: 4821"                                  -> 4821
    add        "What is 3 + 5?" (single digits)                            -> 8
    larger     "Which number is larger, 41 or 67?" after one worked example -> 67
    smaller    the same with the smaller number                             -> 41
    successor  "What number comes right after 57?"                          -> 58
    largest3   "Which number is largest: 412, 87, 630?" after one example    -> 630
    largest5   the same with five numbers of up to 4 digits (a harder held-out split)

A source's problems are distinct texts in a fixed order, a function of (task, n, seed) only, so
the held-out split that `data.heldout_size` takes from them never shares a problem with the
training prompts. A task with fewer distinct problems than `n` (add has 100) is an error that
says how many it has.

The matching reward is `integer_answer` (`reward.verifier: integer_answer`): the first integer
in the completion, compared with the gold one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from urllib.parse import parse_qs

from cwgrpo_megatron.data.names import SYNTHETIC_TASKS

PREFIX = "synthetic:"
DEFAULT_SIZE = 2000
_MAX_DRAWS_PER_PROBLEM = 50

Task = Callable[[random.Random], tuple[str, int]]
register_task = SYNTHETIC_TASKS.register


@register_task("repeat")
def repeat(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(1000, 9999)
    return f"Repeat this number: {n}", n


@register_task("add")
def add(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} + {b}? Answer with the number only.", a + b


def _pair(rng: random.Random) -> tuple[int, int]:
    a, b = rng.sample(range(10, 100), 2)
    return a, b


@register_task("larger")
def larger(rng: random.Random) -> tuple[str, int]:
    a, b = _pair(rng)
    text = (
        f"Which number is larger, 23 or 58? Answer: 58\nWhich number is larger, {a} or {b}? Answer:"
    )
    return text, max(a, b)


@register_task("smaller")
def smaller(rng: random.Random) -> tuple[str, int]:
    a, b = _pair(rng)
    text = (
        "Which number is smaller, 23 or 58? Answer: 23\n"
        f"Which number is smaller, {a} or {b}? Answer:"
    )
    return text, min(a, b)


def _largest(rng: random.Random, count: int, high: int) -> tuple[str, int]:
    numbers = rng.sample(range(10, high + 1), count)
    example = "Which number is largest: 231, 58, 407? Answer: 407"
    asked = f"Which number is largest: {', '.join(map(str, numbers))}? Answer:"
    return f"{example}\n{asked}", max(numbers)


@register_task("largest3")
def largest3(rng: random.Random) -> tuple[str, int]:
    return _largest(rng, 3, 999)


@register_task("largest5")
def largest5(rng: random.Random) -> tuple[str, int]:
    return _largest(rng, 5, 9999)


@register_task("successor")
def successor(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(10, 998)
    return f"What number comes right after {n}? Answer with the number only.", n + 1


def parse_source(source: str) -> tuple[str, int, int]:
    """`synthetic:TASK?n=N&seed=S` -> (task, n, seed)."""
    spec = source[len(PREFIX) :]
    task, _, query = spec.partition("?")
    SYNTHETIC_TASKS.get(task)  # an unknown task names the known ones
    options = parse_qs(query, keep_blank_values=True) if query else {}
    unknown = set(options) - {"n", "seed"}
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {sorted(unknown)}; use n= and seed=")
    try:
        n = int(options.get("n", [DEFAULT_SIZE])[0])
        seed = int(options.get("seed", [0])[0])
    except ValueError:
        raise ValueError(f"{source}: n and seed must be integers") from None
    if n < 1:
        raise ValueError(f"{source}: n must be >= 1")
    return task, n, seed


def generate(task: str, n: int, seed: int = 0) -> list[dict]:
    """`n` distinct problems of `task` as rows {"id", "problem", "answer"} (answer as text)."""
    draw = SYNTHETIC_TASKS.get(task)
    rng = random.Random(f"{task}:{seed}")
    rows, seen = [], set()
    for _ in range(n * _MAX_DRAWS_PER_PROBLEM):
        if len(rows) == n:
            break
        text, answer = draw(rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"id": f"{task}-{len(rows)}", "problem": text, "answer": str(answer)})
    if len(rows) < n:
        raise ValueError(
            f"synthetic task {task!r} gave only {len(rows)} distinct problems, fewer than n={n}: "
            f"ask for at most {len(rows)} (synthetic:{task}?n={len(rows)})"
        )
    return rows


def source_rows(source: str) -> list[dict]:
    task, n, seed = parse_source(source)
    return generate(task, n, seed)
