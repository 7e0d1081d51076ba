"""What a run reads before any model exists: the start checkpoint's architecture, the tokenizer
and prompt format, the training prompts and (on the engines' owners) the evaluation
problems."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cwgrpo_megatron.comm import all_gather_objects, fail_together, job_rank
from cwgrpo_megatron.config import Config, ModelConfig
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.data.prompt_set import PromptSet, build_prompt_sets
from cwgrpo_megatron.data.prompts import SYSTEM_PROMPT, Problem, PromptFormat
from cwgrpo_megatron.eval.runner import load_benchmarks
from cwgrpo_megatron.megatron.conversion import start_arch

log = logging.getLogger("cwgrpo_megatron.train")


@dataclass(frozen=True)
class Inputs:
    arch: ModelArch
    tokenizer: object
    prompt_format: PromptFormat
    train_set: PromptSet
    benchmarks: dict[str, list[Problem]] | None
    """Evaluation problems by benchmark, on the ranks that evaluate (`read`'s `evaluators`) when
    eval.benchmarks names any; else None."""

    @classmethod
    def read(cls, cfg: Config, group, *, evaluators: tuple[int, ...] = (0,)) -> Inputs:
        """Every rank reads the same inputs (each node its own copy of model.path), and the
        ranks `evaluators` (the engines' owners) the benchmarks; a failure on any rank raises
        on all of them. One all_gather_object checks the architectures."""
        rank = job_rank()
        with fail_together("loading the tokenizer and the prompts", group):
            # a missing model folder, or one that is not model.arch, fails here, clearly
            arch = start_arch(cfg.model.path, recipe=cfg.model.arch)
            tokenizer = load_tokenizer(cfg.model)
            fmt = prompt_format(cfg.model)
            train_set, heldout, report = build_prompt_sets(cfg.data, tokenizer, fmt)
            benchmarks = None
            if rank in evaluators and cfg.eval.benchmarks:
                benchmarks = _benchmarks(cfg, heldout)
        _same_model_everywhere(arch, cfg.model.path, group)
        if rank == 0:
            log.info(
                "prompts: %d train, %d held out (%d rows read, %d skipped, %d too long)",
                *(report.train, report.heldout, report.rows, report.skipped_rows),
                report.too_long,
            )
        return cls(arch, tokenizer, fmt, train_set, benchmarks)


def load_tokenizer(model_cfg: ModelConfig):
    """model.tokenizer: the built-in Qwen tokenizers, a folder, or (None) model.path's files."""
    from cwgrpo_megatron.data import tokenizers

    name = model_cfg.tokenizer
    if name == "qwen2.5":
        return tokenizers.qwen25_tokenizer()
    if name == "qwen3":
        return tokenizers.qwen3_tokenizer()
    if name == "r1_distill":
        return tokenizers.r1_distill_tokenizer()
    from transformers import AutoTokenizer

    folder = name or model_cfg.path
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"no tokenizer could be loaded from {folder} ({err}); set model.tokenizer to a "
            "tokenizer folder, qwen3, qwen2.5 or r1_distill"
        ) from err


def prompt_format(model_cfg: ModelConfig) -> PromptFormat:
    auto = model_cfg.chat_template == "auto"
    return PromptFormat(
        template="qwen2.5" if auto else model_cfg.chat_template,
        use_tokenizer_template=auto,
        system=model_cfg.system_prompt or SYSTEM_PROMPT,
    )


def _benchmarks(cfg: Config, heldout: PromptSet) -> dict[str, list[Problem]]:
    e = cfg.eval
    names = [b for b in e.benchmarks if b != "heldout"]
    benchmarks = load_benchmarks(names, data_dir=e.data_dir, limit=e.limit, split=e.split)
    if "heldout" in e.benchmarks:
        benchmarks["heldout"] = heldout.problems[: e.limit] if e.limit else heldout.problems
    return benchmarks


def _same_model_everywhere(arch: ModelArch, path: str, group) -> None:
    """ValueError on every rank when model.path holds another model on some node (each node
    reads its own copy, and each replica's engine starts from it)."""
    archs = all_gather_objects(arch, group)
    for member, other in enumerate(archs):
        if archs[0].differences(other):
            raise ValueError(
                f"model.path={path} holds another model on rank {member} than on rank 0 "
                f"({'; '.join(archs[0].differences(other))}): every node must hold the same "
                "checkpoint"
            )
