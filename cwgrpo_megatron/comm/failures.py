"""Every rank learns of a failure on any rank, so none waits forever in a collective.

    with fail_together("loading the data", group):
        problems = load(...)          # may raise on some ranks only (a file one node lacks)

On exit every rank of `group` all-gathers one short message (None when it succeeded). A rank
that raised re-raises its own exception; every other rank raises `PeerFailure` naming the first
rank that failed and its message. Cost: one all_gather_object of a few bytes per use, so it
guards phases (start-up, a step's reward scoring), not the inner loop. `all_gather_or_fail`
carries a phase's results and its failures in the same single collective.
"""

from __future__ import annotations

import contextlib

from cwgrpo_megatron.comm.collectives import Group, all_gather_objects, global_rank


class PeerFailure(RuntimeError):
    """Another rank failed; this rank stops too."""


def _summary(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def agree_on_failure(err: BaseException | None, what: str, group: Group) -> None:
    """Collective: raise `err` here, or `PeerFailure` if another rank of `group` had one."""
    messages = all_gather_objects(None if err is None else _summary(err), group)
    if err is not None:
        raise err
    for member, message in enumerate(messages):
        if message is not None:
            raise PeerFailure(f"{what} failed on rank {global_rank(group, member)}: {message}")


def all_gather_or_fail(fn, what: str, group: Group) -> list:
    """`fn()` on every rank of `group`, and every rank's result on every rank, in group-rank
    order: one all_gather_object that carries the failure too. If `fn` raised on any rank,
    every rank raises instead (its own exception, or PeerFailure)."""
    err, result = None, None
    try:
        result = fn()
    except Exception as caught:
        err = caught
    pieces = all_gather_objects((None if err is None else _summary(err), result), group)
    if err is not None:
        raise err
    for member, (message, _) in enumerate(pieces):
        if message is not None:
            raise PeerFailure(f"{what} failed on rank {global_rank(group, member)}: {message}")
    return [r for _, r in pieces]


@contextlib.contextmanager
def fail_together(what: str, group: Group):
    """Run the block; afterwards every rank of `group` raises if any rank's block raised."""
    err = None
    try:
        yield
    except Exception as caught:  # KeyboardInterrupt / SystemExit end the process anyway
        err = caught
    agree_on_failure(err, what, group)
