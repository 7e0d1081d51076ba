"""`python -m cwgrpo_megatron.train ARGS`, SIGKILLed at a chosen point; used by test_train.py.

python kill_script.py in-step K ARGS...    killed inside step K's optimizer update (after
                                           its rollouts and rewards)
python kill_script.py in-save K ARGS...    killed inside the K-th checkpoint save, after the
                                           dist checkpoint files are written, before the
                                           folder is renamed into place
"""

import os
import signal
import sys


def kill_on_call(owner, name: str, count: int, *, after: bool) -> None:
    """Replace owner.name by a wrapper that SIGKILLs this process on its count-th call (before
    or after running the original)."""
    real = getattr(owner, name)
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == count and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if calls == count and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapper)


def main() -> int:
    where, count, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    from cwgrpo_megatron import trainer
    from cwgrpo_megatron.megatron import checkpoint

    if where == "in-step":
        kill_on_call(trainer, "train_step", count, after=False)
    elif where == "in-save":
        kill_on_call(checkpoint.dist_checkpointing, "save", count, after=True)
    else:
        raise SystemExit(f"unknown kill point {where!r}")
    from cwgrpo_megatron.train import main as train_main

    return train_main(args)


if __name__ == "__main__":
    sys.exit(main())
