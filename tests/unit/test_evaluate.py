"""The pass@k estimator, and where benchmarks are read from: the five shipped with the package
by name, a folder that eval.data_dir names, a problem file, a local Hugging Face dataset folder
(what a hub id reads, offline), and tools/fetch_data.py's copy of one; a standalone
evaluation's lengths and engine settings, from its flags, a run's config and the model's
positions. Scoring is tested in
tests/distributed/test_evaluate_scoring.py, tools/evaluate.py in tests/e2e/test_evaluate_cli.py
and the shipped files' gold answers in tests/distributed/test_benchmark_answers.py."""

import json
import runpy
from pathlib import Path

import pytest

from cwgrpo_megatron.eval.benchmarks import SHIPPED
from cwgrpo_megatron.eval.config import EvalConfig
from cwgrpo_megatron.eval.metrics import pass_at_k
from cwgrpo_megatron.eval.names import SHIPPED_BENCHMARKS as BENCHMARKS
from cwgrpo_megatron.eval.runner import benchmark_source, load_benchmarks
from cwgrpo_megatron.eval.standalone import Lengths, engine_config, resolve_lengths

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"problem": "What is 1 + 1?", "answer": "2", "level": "Level 1"},
    {"problem": "What is 2 + 3?", "answer": "5", "level": "Level 2"},
]


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # avg@n
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_the_summary_reports_pass_at_2_4_8_16_below_n():
    from cwgrpo_megatron.eval.metrics import distinct_answers, reported_ks, summary_keys

    assert reported_ks(1) == [1] and reported_ks(4) == [2, 4] and reported_ks(16) == [2, 4, 8, 16]
    assert reported_ks(32) == [2, 4, 8, 16, 32] and reported_ks(6) == [2, 4, 6]
    assert summary_keys(8) == ["avg@8", "pass@2", "pass@4", "pass@8", "distinct_answers"]
    assert distinct_answers(["3", None, "3", "4", None]) == 2 and distinct_answers([None]) == 0


def test_every_benchmark_name_is_shipped_with_its_source_stated():
    shipped = {p.stem for p in SHIPPED.glob("*.jsonl")}
    assert shipped == set(BENCHMARKS)
    sources = (SHIPPED / "SOURCES.md").read_text()
    for name in BENCHMARKS:
        assert benchmark_source(name) == SHIPPED / f"{name}.jsonl"
        assert f"`{name}.jsonl`" in sources


def test_data_dir_overrides_the_shipped_files_and_its_error_names_the_key(tmp_path):
    (tmp_path / "aime24.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    assert [p.answer for p in load_benchmarks(["aime24"], data_dir=tmp_path)["aime24"]] == ["2"]
    with pytest.raises(ValueError, match=r"amc23\.jsonl does not exist; eval\.data_dir="):
        load_benchmarks(["amc23"], data_dir=tmp_path)
    with pytest.raises(ValueError, match="--data-dir=.*leave --data-dir unset"):
        load_benchmarks(["amc23"], data_dir=tmp_path, key="--data-dir")


def test_a_file_is_a_benchmark_reported_under_its_stem(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    loaded = load_benchmarks([str(path), "amc23"], limit=1)
    assert list(loaded) == ["mine", "amc23"] and [p.answer for p in loaded["mine"]] == ["2"]
    with pytest.raises(ValueError, match="two benchmarks would be reported as 'mine'"):
        load_benchmarks([str(path), str(tmp_path / "x" / "mine.jsonl")])


def test_settings_take_names_files_and_hub_ids_and_reject_the_rest():
    EvalConfig(benchmarks=["aime24", "heldout", "data/mine.jsonl", "HuggingFaceH4/MATH-500"])
    with pytest.raises(ValueError, match="eval.benchmarks: unknown benchmark 'gsm8k'.*aime24"):
        EvalConfig(benchmarks=["gsm8k"])


@pytest.fixture
def dataset_folder(tmp_path):
    """A local dataset folder as `save_to_disk` writes it: what a hub id reads, offline."""
    datasets = pytest.importorskip("datasets", reason="the hub extra")
    folder = tmp_path / "open-rs"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(folder))
    return folder


def test_a_local_hugging_face_dataset_loads_as_a_benchmark(dataset_folder):
    loaded = load_benchmarks([str(dataset_folder)], split="test")
    assert [p.answer for p in loaded["open-rs"]] == ["2", "5"]
    with pytest.raises(ValueError, match=r"splits \['test'\], not 'train'"):
        load_benchmarks([str(dataset_folder)], split="train")


def test_fetch_data_writes_a_file_the_loaders_read(dataset_folder, tmp_path, capsys):
    out = tmp_path / "copy" / "open_rs.jsonl"
    tool = runpy.run_path(str(ROOT / "tools" / "fetch_data.py"))
    assert tool["main"]([str(dataset_folder), "--split", "test", "--out", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == ROWS
    assert "2 rows" in capsys.readouterr().out
    assert [p.answer for p in load_benchmarks([str(out)])["open_rs"]] == ["2", "5"]
    # a row the loaders reject stops the copy, and nothing is written
    bad = tmp_path / "bad.jsonl"
    argv = [str(dataset_folder), "--split", "test", "--schema", "math", "--out", str(bad)]
    assert tool["main"](argv) == 2
    assert "--skip-bad-rows" in capsys.readouterr().err and not bad.exists()


def test_a_hub_id_without_the_hub_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets fails
    with pytest.raises(ValueError, match=r'needs `datasets`: pip install -e "\.\[hub\]"'):
        load_benchmarks(["knoveleng/open-rs"])


def _lengths(positions, run=None, **flags):
    given = {"max_prompt_tokens": None, "max_tokens": None, "max_model_len": None, **flags}
    return resolve_lengths(positions, run=run, **given)


def test_standalone_lengths_default_clamp_and_refuse_with_the_flag_to_change():
    # Qwen2.5-Math-7B: 4096 positions leave 3072 new tokens after the 1024-token prompt budget
    got = _lengths(4096)
    assert (got.max_prompt_tokens, got.max_tokens, got.max_model_len) == (1024, 3072, 4096)
    assert got.clamped.startswith("--max-tokens 3072: what the model's 4096 tokens leave")
    assert _lengths(32768) == Lengths(1024, 4096, 5120)  # room for the default: no clamp
    assert _lengths(None, max_tokens=8) == Lengths(1024, 8, 1032)  # positions unknown
    # --max-model-len known: the prompt budget is what it leaves (as a run's evaluation has)
    assert _lengths(4096, max_model_len=2048, max_tokens=512) == Lengths(1536, 512, 2048)
    assert _lengths(4096, max_model_len=2048).max_tokens == 1024
    with pytest.raises(ValueError) as err:
        _lengths(4096, max_tokens=4096)
    assert str(err.value) == (
        "--max-prompt-tokens=1024 + --max-tokens=4096 = 5120 tokens exceed the model's "
        "max_position_embeddings=4096: lower --max-tokens to 3072 or less, or --max-prompt-tokens"
    )
    with pytest.raises(ValueError, match="lower --max-prompt-tokens below 256"):
        _lengths(256)  # the default budget alone is beyond a tiny model
    with pytest.raises(ValueError, match="--max-model-len 8192 exceeds the model's .*=4096"):
        _lengths(4096, max_model_len=8192)
    with pytest.raises(ValueError, match=r"exceed --max-model-len=600: .*, or raise it"):
        _lengths(4096, max_model_len=600, max_prompt_tokens=512, max_tokens=100)
    with pytest.raises(ValueError, match="--max-tokens 0: it must be at least 1"):
        _lengths(4096, max_tokens=0)


def test_standalone_settings_default_to_the_runs_and_flags_win():
    from cwgrpo_megatron.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["rollout.tp=2"])
    run = (cfg.rollout, cfg.eval)
    # eval.max_tokens=16 in rollout.max_model_len=64: prompts of up to 48 tokens, as in training
    assert _lengths(256, run) == Lengths(48, 16, 64)
    assert _lengths(256, run, max_tokens=8) == Lengths(56, 8, 64)
    lengths = _lengths(256, run)
    flags = dict(backend=None, tp=None, gpu_memory_utilization=None, enforce_eager=None)
    from_run = engine_config(cfg.rollout, lengths, **flags)
    assert (from_run.tp, from_run.gpu_memory_utilization, from_run.max_model_len) == (2, 0.5, 64)
    given = engine_config(cfg.rollout, lengths, **{**flags, "tp": 4, "enforce_eager": False})
    assert (given.tp, given.enforce_eager, given.sleep_level) == (4, False, 0)
    alone = engine_config(None, _lengths(4096), **flags)
    assert (alone.tp, alone.gpu_memory_utilization, alone.backend) == (1, 0.9, "vllm")
    # a run whose engines were on devices of their own, one step off: one colocated engine
    separate = ["rollout.placement=separate", "rollout.async_steps=1", "rollout.tp=2"]
    separate_cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", separate)
    one = engine_config(separate_cfg.rollout, lengths, **flags)
    assert (one.placement, one.async_steps, one.tp) == ("colocated", 0, 2)


def test_a_run_folder_is_found_from_its_model_folders(tmp_path):
    from cwgrpo_megatron.run.run_dir import run_folder_of

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    (step / "model").mkdir(parents=True)
    (run / "hf").mkdir()
    assert run_folder_of(run) is None  # no config.yaml and env.json: not a run (yet)
    (run / "config.yaml").write_text("")
    (run / "env.json").write_text("{}")
    for inside in (run, run / "hf", step, step / "model"):
        assert run_folder_of(inside).root == run, inside
    assert run_folder_of(run / "checkpoints") is None and run_folder_of(tmp_path) is None
    assert run_folder_of("/") is None
