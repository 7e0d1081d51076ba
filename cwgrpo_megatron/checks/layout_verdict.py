"""PASS or FAIL for `tools/check_layout.py --against REF.json`, with a tolerance measured, not
chosen.

Three differences between a run and the reference, each a worst case:

    loss       max_i |loss_i - ref_i|                           over optimizer steps
    grad_norm  max_i |g_i - ref_i| / ref_i                      over optimizer steps
    update     max_t |u_t - ref u_t| / ref n_t                  over HF tensors t

where, for tensor t's change d_t over the run, u_t = sum(r_t * d_t) with a fixed Gaussian r_t
and n_t = |d_t| (`layout_check.run`): for an error e_t on the update, u_t moves by a draw of
N(0, |e_t|^2), so `update` reads as the relative error of the worst tensor's update.

The tolerance rule. `--calibrate` runs the reference layout again, CALIBRATION_RUNS times, on a
channel-permuted copy of the model (`checks.symmetry`): the same function in exact arithmetic, with
the sums that tensor parallelism splits (over heads, MLP channels and the vocabulary) taken in
another order. Their worst difference to the reference is the fp32 noise of this model, batch and
step, per quantity:

    noise_q = max(max over calibration runs of diff_q, FLOOR x scale_q)
    tol_q   = FACTOR x noise_q

with scale_q = max |ref loss| for the loss and 1 for the relative quantities, so a noise that
happens to come out 0 still leaves the tolerance of a rounding. FACTOR = 10 covers what the
calibration runs cannot: a layout changes the shape of the sums, not only their order (partial
sums per rank, then the all-reduce's own order), and two draws of the noise are a small sample. On
SmolLM2-135M (30 layers), PP2 and DP2 stay within the noise, TP3 reaches 4.4x it (the grad
norm), and the planted errors of `layout_check.PLANTS` lie 3e3x to 3e6x above it
(docs/self-checks.md)."""

from __future__ import annotations

import math

QUANTITIES = ("loss", "grad_norm", "update")
CALIBRATION_RUNS = 2
FACTOR = 10.0
FLOOR = 2.0**-23  # one fp32 rounding, relative


def differences(run: dict, ref: dict) -> dict[str, float]:
    """The three worst-case differences of `run` to `ref` (both `layout_check.run` results)."""
    if len(run["loss"]) != len(ref["loss"]):
        raise ValueError(f"{len(run['loss'])} optimizer steps against the reference's "
                         f"{len(ref['loss'])}: run both with the same --steps")  # fmt: skip
    if set(run["update"]) != set(ref["update"]):
        raise ValueError("the run's model has other tensors than the reference's")
    loss = _worst(abs(a - b) for a, b in zip(run["loss"], ref["loss"], strict=True))
    grad = _worst(
        abs(a - b) / max(abs(b), 1e-30)
        for a, b in zip(run["grad_norm"], ref["grad_norm"], strict=True)
    )
    update = _worst(
        abs(u - ref["update"][name][0]) / max(ref["update"][name][1], 1e-30)
        for name, (u, _) in run["update"].items()
    )
    return {"loss": loss, "grad_norm": grad, "update": update}


def _worst(values) -> float:
    """The largest value; a NaN (which max() would skip past) counts as infinitely large."""
    return max(math.inf if math.isnan(x) else x for x in values)


def noise(ref: dict, calibration_runs: list[dict]) -> dict[str, float]:
    """noise_q of the rule above, from the reference and its channel-permuted reruns."""
    if not calibration_runs:
        raise ValueError("no calibration runs")
    diffs = [differences(c, ref) for c in calibration_runs]
    scale = {"loss": max(abs(x) for x in ref["loss"]), "grad_norm": 1.0, "update": 1.0}
    return {q: max(max(d[q] for d in diffs), FLOOR * scale[q]) for q in QUANTITIES}


def verdict(run: dict, ref: dict) -> tuple[bool, list[dict]]:
    """(passed, one row per quantity: {quantity, diff, noise, tol, ratio}); `ref` must carry
    "noise" (made with --calibrate)."""
    if "noise" not in ref:
        raise ValueError(
            "the reference has no noise calibration: make it with tools/check_layout.py "
            "--calibrate (at the reference layout, usually TP1)"
        )
    diffs = differences(run, ref)
    rows = []
    for q in QUANTITIES:
        tol = FACTOR * ref["noise"][q]
        rows.append(
            {
                "quantity": q,
                "diff": diffs[q],
                "noise": ref["noise"][q],
                "tol": tol,
                "ratio": diffs[q] / ref["noise"][q],
            }  # fmt: skip
        )
    return all(r["diff"] <= r["tol"] for r in rows), rows


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'quantity':<10} {'worst diff':>11} {'fp32 noise':>11} {'tol':>11} {'x noise':>9}"]
    for r in rows:
        lines.append(
            f"{r['quantity']:<10} {r['diff']:>11.3e} {r['noise']:>11.3e} {r['tol']:>11.3e} "
            f"{r['ratio']:>9.2f}"
        )
    return lines
