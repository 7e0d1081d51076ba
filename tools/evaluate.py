"""Evaluate a model on math benchmarks (avg@n, pass@k, distinct answers) through the rollout
engine.

    python tools/evaluate.py --model-dir HF_OR_MEGATRON_DIR --benchmarks aime24,math500,amc23 \\
        --n 4 --temperature 0.6 --top-p 0.95 --out results.json
    python tools/evaluate.py --model-dir RUN_DIR --out results.json     # a training run's model
    python tools/evaluate.py --model-dir HF_72B --tp 8 --out results.json    # one engine, 8 GPUs

A Megatron checkpoint (a folder with cwgrpo_checkpoint.json) is first converted to HF in a
temporary folder. When the model is a run's (its folder, hf/ export or checkpoints/step_N), the
engine's settings, lengths and prompt format default to that run's config.yaml; a flag given
wins. Lengths that do not fit the model's positions are refused before the engine starts
(`eval.standalone`). Prints a table of avg@n, pass@k (k = 2, 4, 8, 16 below n, and n) and distinct
final answers per benchmark and their average, and writes JSON (atomically) with the summary,
the settings used and every completion with its score and final answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path


def parse(argv):
    from cwgrpo_megatron.common.plugins import add_plugin_argument
    from cwgrpo_megatron.data.names import CHAT_TEMPLATES
    from cwgrpo_megatron.eval import SHIPPED_BENCHMARKS
    from cwgrpo_megatron.eval import standalone as s

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags marked (run) default to the run's config when --model-dir is a run's.",
    )
    p.add_argument(
        "--model-dir",
        required=True,
        help="an HF folder, a Megatron checkpoint, a run folder, its hf/ or checkpoints/step_N",
    )
    p.add_argument(
        "--benchmarks",
        default=",".join(SHIPPED_BENCHMARKS),
        help="comma-separated names (shipped with the package), .jsonl / .parquet files or hub ids",
    )
    p.add_argument("--n", type=int, default=1, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"new tokens per sample (run: eval.max_tokens, else rollout.max_tokens); default "
        f"{s.MAX_TOKENS}, clamped to what the model's positions leave after the prompt budget",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help=f"the prompt budget: longer prompts are skipped and counted; default "
        f"{s.PROMPT_TOKENS}, or with --max-model-len known, what it leaves after --max-tokens",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's prompt + completion tokens (run: rollout.max_model_len); default: "
        "the prompt budget + --max-tokens",
    )
    p.add_argument(
        "--engine",
        default=None,
        help="rollout backend: vllm or torch (run: rollout.backend; default vllm)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="the engine's tensor-parallel GPUs (run: rollout.tp; default 1)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"vLLM's share of each GPU (run: rollout.gpu_memory_utilization; default "
        f"{s.GPU_MEMORY_UTILIZATION})",
    )
    compile_ = p.add_mutually_exclusive_group()
    compile_.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_const",
        const=True,
        default=None,
        help="run vLLM eagerly (run: rollout.enforce_eager; default: compiled on a GPU, eager "
        "on CPU)",
    )
    compile_.add_argument(
        "--compile", dest="enforce_eager", action="store_const", const=False, help="compile it"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the engine's dtype (run: its engine's; default bfloat16)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        choices=CHAT_TEMPLATES,
        help="as model.chat_template (run: its value; default auto: the tokenizer's own, else "
        "qwen2.5)",
    )
    p.add_argument(
        "--system-prompt", default=None, help="the system message (run: model.system_prompt)"
    )
    p.add_argument("--limit", type=int, default=None, help="first N problems per benchmark")
    p.add_argument(
        "--data-dir",
        default=None,
        help="a folder of NAME.jsonl files to read the named benchmarks from (default: the "
        "copies shipped with the package)",
    )
    p.add_argument("--split", default="test", help="the split of a hub dataset id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="eval_results.json")
    add_plugin_argument(p)
    args = p.parse_args(argv)
    args.benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    if args.n < 1:
        p.error(f"--n {args.n}: at least one sample per problem")
    return args


def hf_model_dir(model_dir: Path, scratch: Path) -> Path:
    """`model_dir` if it is an HF checkpoint, else the conversion into `scratch` of the Megatron
    checkpoint it names (a converted one, a run's step_N or its model/ folder, or a run folder:
    `conversion.find_checkpoint`)."""
    from cwgrpo_megatron.megatron.checkpoint import META_NAME

    if (model_dir / "config.json").is_file() and not (model_dir / META_NAME).is_file():
        return model_dir
    from cwgrpo_megatron.megatron.conversion import find_checkpoint, megatron_to_hf

    ckpt = find_checkpoint(model_dir)
    print(f"converting the Megatron checkpoint {ckpt} to HF ...", flush=True)
    return megatron_to_hf(ckpt, scratch / "hf")


def run_config(model_dir: Path) -> tuple:
    """(the config, its file) of the run `model_dir` belongs to (`run_dir.run_folder_of`), or
    (None, None)."""
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.run.run_dir import run_folder_of

    run = run_folder_of(model_dir)
    if run is None:
        return None, None
    path = run.root / "config.yaml"
    try:
        cfg = load_config(path)
    except ValueError as err:
        raise ValueError(
            f"{path} does not load ({err}): evaluate its hf/ or checkpoint folder with the "
            "engine's flags given, or mend the file"
        ) from err
    print(f"settings not given as flags come from the run's {path}", flush=True)
    return cfg, path


def positions_of(hf_dir: Path) -> int | None:
    """The model's max_position_embeddings (None when its config does not say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)


def model_settings(args, cfg):
    """The run's model section (or the defaults) with the prompt-format flags given."""
    from cwgrpo_megatron.config import ModelConfig

    base = cfg.model if cfg is not None else ModelConfig()
    changes = {"chat_template": args.chat_template, "system_prompt": args.system_prompt}
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from cwgrpo_megatron.common.plugins import load_plugins
    from cwgrpo_megatron.components.inputs import load_tokenizer, prompt_format
    from cwgrpo_megatron.eval.runner import evaluate, format_table, load_benchmarks, write_json
    from cwgrpo_megatron.eval.standalone import engine_config, resolve_lengths
    from cwgrpo_megatron.rollout import SamplingConfig, build_engine, eager

    with tempfile.TemporaryDirectory(prefix="cwgrpo-eval-") as scratch:
        try:  # bad input: a name or data file, a folder that is not a model, lengths, a config
            load_plugins(args.plugin)  # before the run's config and the benchmarks' names
            cfg, cfg_path = run_config(Path(args.model_dir))
            benchmarks = load_benchmarks(
                args.benchmarks,
                data_dir=args.data_dir,
                limit=args.limit,
                split=args.split,
                key="--data-dir",
            )
            hf_dir = hf_model_dir(Path(args.model_dir), Path(scratch))
            lengths = resolve_lengths(
                positions_of(hf_dir),
                max_prompt_tokens=args.max_prompt_tokens,
                max_tokens=args.max_tokens,
                max_model_len=args.max_model_len,
                run=None if cfg is None else (cfg.rollout, cfg.eval),
            )
            rollout = engine_config(
                None if cfg is None else cfg.rollout,
                lengths,
                backend=args.engine,
                tp=args.tp,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager,
            )
            model = model_settings(args, cfg)
            tokenizer = load_tokenizer(dataclasses.replace(model, path=str(hf_dir)))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if lengths.clamped:
            print(lengths.clamped, flush=True)
        dtype = args.dtype or (cfg.engine_dtype if cfg is not None else "bfloat16")
        engine = build_engine(rollout, str(hf_dir), dtype=dtype, seed=args.seed)
        sampling = SamplingConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=lengths.max_tokens,
            seed=args.seed,
        )
        try:
            result = evaluate(
                engine,
                tokenizer,
                benchmarks,
                n=args.n,
                sampling=sampling,
                prompt_format=prompt_format(model),
            )
        finally:
            engine.shutdown()
    result["settings"] = {
        **vars(args),
        **dataclasses.asdict(lengths),
        "engine": rollout.backend,
        "tp": rollout.tp,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "enforce_eager": eager(rollout, cuda=torch.cuda.is_available()),
        "dtype": dtype,
        "chat_template": model.chat_template,
        "system_prompt": model.system_prompt,
        "run_config": None if cfg_path is None else str(cfg_path),
    }
    print(format_table(result["summary"], args.n))
    print(f"wrote {write_json(result, args.out)} ({len(result['samples'])} completions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
