"""Evaluate a model on math benchmarks (avg@n, pass@n) through the rollout engine.

    python tools/evaluate.py --model-dir HF_OR_MEGATRON_DIR --benchmarks aime24,math500,amc23 \\
        --n 4 --temperature 0.6 --top-p 0.95 --max-tokens 4096 --out results.json

A Megatron checkpoint (a folder with cwgrpo_checkpoint.json) is first converted to HF in a
temporary folder. Prints a table of avg@n and pass@n per benchmark and their average, and writes
JSON (atomically) with the summary, the settings and every completion with its score.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def parse(argv):
    from cwgrpo_megatron.eval import BENCHMARKS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-dir",
        required=True,
        help="an HF folder, a Megatron checkpoint, a run's checkpoints/step_N or a run folder",
    )
    p.add_argument(
        "--benchmarks",
        default=",".join(BENCHMARKS),
        help="comma-separated names (shipped with the package), .jsonl / .parquet files or hub ids",
    )
    p.add_argument("--n", type=int, default=1, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None, help="default: max-tokens + 1024")
    p.add_argument("--engine", default="vllm", help="rollout backend: vllm or torch")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--template", default="qwen2.5", help="used when the tokenizer has none")
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


def main(argv=None) -> int:
    args = parse(argv)
    from transformers import AutoTokenizer

    from cwgrpo_megatron.data.prompts import PromptFormat
    from cwgrpo_megatron.eval.runner import evaluate, format_table, load_benchmarks, write_json
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine

    try:
        benchmarks = load_benchmarks(
            args.benchmarks,
            data_dir=args.data_dir,
            limit=args.limit,
            split=args.split,
            key="--data-dir",
        )
    except ValueError as err:  # a bad name or a missing / malformed data file
        print(f"error: {err}", file=sys.stderr)
        return 2
    sampling = SamplingConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="cwgrpo-eval-") as scratch:
        try:
            hf_dir = hf_model_dir(Path(args.model_dir), Path(scratch))
        except ValueError as err:  # not a model folder, or a broken checkpoint
            print(f"error: {err}", file=sys.stderr)
            return 2
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        engine = get_engine(args.engine)(
            hf_dir,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len or args.max_tokens + 1024,
        )
        try:
            result = evaluate(
                engine,
                tokenizer,
                benchmarks,
                n=args.n,
                sampling=sampling,
                prompt_format=PromptFormat(template=args.template),
            )
        finally:
            engine.shutdown()
    result["settings"] = dict(vars(args))
    print(format_table(result["summary"], args.n))
    print(f"wrote {write_json(result, args.out)} ({len(result['samples'])} completions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
