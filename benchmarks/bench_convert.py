"""Seconds and peak memory of HF <-> Megatron conversion for a ~0.5B random Qwen2.

The model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, ffn 4864,
vocab 151936, tied embeddings), random weights built locally with transformers and saved as
bf16 safetensors. Each direction runs in a fresh process; peak RSS (ru_maxrss) above that
process's RSS after imports (VmHWM, see memory.py) is reported as a multiple of the model's bytes.

Target (issue "policy model and conversion"): <= 1.5x model bytes both ways.

Usage: python benchmarks/bench_convert.py [--quick] [--workdir DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
QUICK = dict(
    QWEN_05B,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    vocab_size=4096,
)

CHILD = r"""
import json, sys, time
from cwgrpo_megatron.megatron import conversion
from memory import peak_since_reset, reset_peak
base = reset_peak()
start = time.perf_counter()
if sys.argv[1] == "to_megatron":
    conversion.hf_to_megatron(sys.argv[2], sys.argv[3], dtype="bfloat16")
else:
    conversion.megatron_to_hf(sys.argv[2], sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - start, "peak": peak_since_reset() - base}))
"""


def build_hf(path: Path, quick: bool) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**(QUICK if quick else QWEN_05B), architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))  # the weights' bytes


def run(direction: str, src: Path, dst: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, direction, str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        raise SystemExit(f"{direction} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        model_bytes = build_hf(work / "hf", args.quick)
        print(
            f"built and saved the model in {time.perf_counter() - start:.1f}s: "
            f"{model_bytes / 2**30:.3f} GiB of bf16 weights"
        )
        rows = {
            "hf -> megatron": run("to_megatron", work / "hf", work / "ckpt"),
            "megatron -> hf": run("to_hf", work / "ckpt", work / "back"),
        }
    print(f"{'direction':<16} {'seconds':>8} {'peak GiB':>9} {'x model':>8}")
    worst = 0.0
    for name, r in rows.items():
        ratio = r["peak"] / model_bytes
        worst = max(worst, ratio)
        print(f"{name:<16} {r['seconds']:>8.1f} {r['peak'] / 2**30:>9.3f} {ratio:>8.2f}")
    print(
        "target: peak <= 1.5x model bytes both ways:",
        "met" if worst <= 1.5 else f"MISSED ({worst:.2f}x)",
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
