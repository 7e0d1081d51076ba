"""Train a policy with CW-GRPO: parse, build, train, close.

    python -m cwgrpo_megatron.train --config FILE [--config FILE2 ...] [--plugin P ...]
        [section.key=value ...]
    torchrun --nproc-per-node N -m cwgrpo_megatron.train --config FILE ...   (any TP x PP x DP)

Each file overrides the ones before it, key by key, and the overrides come last: a recipe, then
an overlay such as configs/grpo_open_rs.yaml. A launcher (examples/train_cwgrpo_*.sh) puts its
recipe first. The run writes into run.out_dir (see `run_dir`) and continues
from its newest checkpoint when started again (run.resume=auto). Exit code 0 on success; on
failure 1, with the error printed on every rank (a rank whose peer failed says which one).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

HELP_EPILOG = """\
examples:
  python -m cwgrpo_megatron.train --config configs/tiny_cpu.yaml model.path=/tmp/tiny
  torchrun --nproc-per-node 8 -m cwgrpo_megatron.train --config configs/qwen2p5_math_7b.yaml \\
      --config configs/grpo_open_rs.yaml model.path=/models/Qwen2.5-Math-7B

Each --config overrides the files before it, and section.key=value overrides come last.
docs/config.md lists every key with its type, default and meaning (tools/config_reference.py
generates it from the settings dataclasses)."""


def parse(argv=None) -> argparse.Namespace:
    from cwgrpo_megatron.common.plugins import add_plugin_argument

    parser = argparse.ArgumentParser(
        prog="python -m cwgrpo_megatron.train",
        description=__doc__.split("\n\n")[0],
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="a YAML file of settings; repeatable, each over the ones before it",
    )
    add_plugin_argument(parser)
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.seed=3")
    return parser.parse_intermixed_args(argv)  # --config and --plugin among the overrides


def setup_logging(rank: int) -> None:
    """INFO on rank 0, errors only elsewhere (every rank would repeat rank 0's warnings);
    each line names its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.ERROR,
        format=f"[%(asctime)s rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("vllm", "megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures reported by their message alone: bad input, a peer's failure, a failed sync
    check, a rollout engine whose processes died, a reward function that raised."""
    from cwgrpo_megatron.checks.sync_check import SyncMismatchError
    from cwgrpo_megatron.comm import PeerFailure
    from cwgrpo_megatron.reward import RewardError
    from cwgrpo_megatron.rollout.base import EngineDeadError

    return (ValueError, PeerFailure, SyncMismatchError, EngineDeadError, RewardError)


def run(argv=None, *, recipe: str | None = None) -> int:
    """Parse, build, train, close, in an initialised process group; the exit code. `recipe`
    (a launcher's config) comes first: every --config file stacks on it, in order."""
    args = parse(argv)
    configs = ([] if recipe is None else [recipe]) + args.config
    from cwgrpo_megatron.build import build_trainer
    from cwgrpo_megatron.comm import job_rank
    from cwgrpo_megatron.config import config_sources, load_config

    rank = job_rank()
    setup_logging(rank)
    log = logging.getLogger("cwgrpo_megatron.train")
    trainer = None
    try:
        cfg = load_config(configs, args.overrides, plugins=args.plugin)
        trainer = build_trainer(cfg, sources=config_sources(configs, args.overrides))
        trainer.fit()
    except Exception as err:
        # said before closing (stopping an engine takes seconds): once one rank of a node
        # exits, torchrun stops the others there, and each should have said why
        _report(err, rank, log)
        if trainer is not None:
            _close(trainer, rank, log)
        return 1
    except BaseException:  # Ctrl-C, SystemExit: release the engines and workers all the same
        if trainer is not None:
            _close(trainer, rank, log)
        raise
    if not _close(trainer, rank, log):
        return 1
    log.info("done: %s", trainer.run.root)
    for line in trainer.summary():
        print(line, flush=True)
    return 0


def _report(err: Exception, rank: int, log: logging.Logger) -> None:
    """What a user can act on is its message; anything else (a bug) keeps its traceback."""
    if isinstance(err, user_errors()):
        # one write of the whole line: the ranks of a node share torchrun's output, and print's
        # separate write of the newline let another rank's line land inside this one
        sys.stderr.write(f"[rank {rank}] error: {err}\n")
        sys.stderr.flush()
    else:
        log.exception("training failed")


def _close(trainer, rank: int, log: logging.Logger) -> bool:
    """`trainer.close()`; False (with the error reported) when it failed."""
    try:
        trainer.close()
    except Exception as err:
        _report(err, rank, log)
        return False
    return True


def main(argv=None, *, recipe: str | None = None) -> int:
    """`run` in the process group of torchrun's environment, or of this process alone."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    init_distributed()
    try:
        return run(argv, recipe=recipe)
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
