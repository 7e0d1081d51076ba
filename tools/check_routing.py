"""How often a MoE model's routing differs between the trainer and transformers, and what it
does to the log-prob gap.

    python tools/check_routing.py --hf-dir D [--rows 8 --seq-len 64 --json]

On one fixed batch of random tokens, in fp32 and bf16: the share of (layer, token) pairs whose
top-k expert sets differ (moe/topk_differ), the tokens rerouted in any layer, and the mean
|delta log-prob| over all tokens, over rerouted ones and over the rest. Also the trainer's own
top-k differ between fp32 and bf16. A measurement: it exits 0 unless the input is wrong (2).
transformers stands in for the engine, whose routing vLLM reports only on GPUs
(`cwgrpo_megatron/checks/routing_check.py`).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF Qwen3-MoE checkpoint folder")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)

    import torch

    from cwgrpo_megatron.checks import routing_check
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    if args.rows < 1 or args.seq_len < 2:
        print("error: --rows must be >= 1 and --seq-len >= 2", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    init_distributed()
    try:
        result = routing_check.run(
            args.hf_dir, rows=args.rows, seq_len=args.seq_len, seed=args.seed
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["setup"]
    print(f"{s['rows']} x {s['seq_len']} random tokens, {s['layers']} MoE layers; trainer "
          "(Megatron) against transformers")  # fmt: skip
    print("dtype      topk_differ  rerouted  gap_mean  gap_rerouted  gap_kept  gap_max")
    for dtype in routing_check.DTYPES:
        r = result[dtype]
        print(f"{dtype:<10} {r['topk_differ']:>11.2%}  {r['rerouted_tokens']:>8.2%}  "
              f"{_fmt(r['gap_mean']):>8}  {_fmt(r['gap_mean_rerouted']):>12}  "
              f"{_fmt(r['gap_mean_kept']):>8}  {_fmt(r['gap_max']):>7}")  # fmt: skip
    print(f"trainer fp32 against trainer bf16: topk_differ {result['fp32_vs_bf16_trainer']:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
