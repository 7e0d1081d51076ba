"""HF <-> Megatron conversion: bit-identical round trips, resharding, CLIs and bad input."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cwgrpo_megatron.megatron.conversion import hf_to_megatron
from tests.distributed.harness import run_distributed, run_tool
from tests.distributed.qwen_fixtures import make_hf_model

REPO = Path(__file__).resolve().parents[2]


TOKENIZER_FILES = {"tokenizer_config.json": '{"model_max_length": 64}', "merges.txt": "#v\n"}


def save_hf(name: str, path: Path, seed: int = 0, dtype=torch.float32) -> Path:
    make_hf_model(name, seed=seed).to(dtype).save_pretrained(path)
    for file, text in TOKENIZER_FILES.items():  # stand-ins: the tools copy them verbatim
        (path / file).write_text(text)
    return path


def read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _convert(rank, world, hf_dir, out, tp, pp, dtype=None, ep=1, expert_tp=1):
    hf_to_megatron(hf_dir, out, tp=tp, pp=pp, ep=ep, expert_tp=expert_tp, dtype=dtype)


def _export(rank, world, ckpt, out):
    from cwgrpo_megatron.megatron.conversion import megatron_to_hf

    megatron_to_hf(ckpt, out, max_shard_bytes=200_000)  # small shards: exercise the index


def _compare_params(rank, world, hf_dir, ckpt, tp, pp):
    """Max |param difference| between the checkpoint loaded at tp x pp and HF loaded directly."""
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.conversion import load_checkpoint_model
    from cwgrpo_megatron.megatron.model import build_model, load_hf_weights

    parallel.initialize(tp=tp, pp=pp)
    try:
        model, arch, _ = load_checkpoint_model(ckpt)
        ref = build_model(ModelArch.from_hf_dir(hf_dir))
        load_hf_weights(ref, arch, HFCheckpoint(hf_dir).get)
        ref_params = dict(ref.named_parameters())
        # vocab rows past the model's padding are zeros either way; compare the real rows
        return max(
            (p.detach() - ref_params[n].detach()).abs().max().item()
            for n, p in model.named_parameters()
        )
    finally:
        parallel.destroy()


@pytest.mark.parametrize(
    ("name", "tp", "pp", "dtype", "ep", "expert_tp"),
    [
        pytest.param("qwen-untied", 2, 2, torch.float32, 1, 1, id="qwen-untied-tp2xpp2"),
        pytest.param("qwen-tied", 2, 2, torch.float32, 1, 1, id="qwen-tied-tp2xpp2"),
        pytest.param("llama", 2, 1, torch.float32, 1, 1, id="llama-tp2"),
        pytest.param("qwen3-tied", 2, 2, torch.float32, 1, 1, id="qwen3-tied-tp2xpp2"),
        pytest.param("qwen-untied", 1, 2, torch.bfloat16, 1, 1, id="qwen-untied-bf16-pp2"),
        # experts split over 2 EP ranks, each expert over 2 expert-TP ranks, and 2 stages
        pytest.param("qwen3-moe", 1, 2, torch.float32, 2, 1, id="qwen3-moe-pp2xep2"),
        pytest.param("qwen3-moe", 2, 1, torch.float32, 2, 2, id="qwen3-moe-tp2xep2xetp2"),
    ],
)
def test_round_trip_is_bit_identical(tmp_path, name, tp, pp, dtype, ep, expert_tp):
    hf_dir = save_hf(name, tmp_path / "hf", dtype=dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    world = pp * math.lcm(tp, ep * expert_tp)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_convert, world, str(hf_dir), ckpt, tp, pp, dtype_name, ep, expert_tp)
    meta = json.loads((tmp_path / "ckpt" / "cwgrpo_checkpoint.json").read_text())
    assert meta["saved_layout"] == {
        "tp": tp,
        "pp": pp,
        "dp": world // (tp * pp),
        "ep": ep,
        "expert_tp": expert_tp,
    }
    assert meta["params_dtype"] == dtype_name
    for file, text in TOKENIZER_FILES.items():
        assert (tmp_path / "ckpt" / file).read_text() == text
    run_distributed(_export, 1, str(tmp_path / "ckpt"), str(tmp_path / "back"))
    original, back = read_hf_tensors(hf_dir), read_hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert tensor.dtype == back[key].dtype == dtype, key
        assert torch.equal(tensor, back[key]), key
    for file, text in TOKENIZER_FILES.items():
        assert (tmp_path / "back" / file).read_text() == text
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=dtype)
    ids = torch.randint(0, 1000, (2, 8))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)(ids).logits
        assert torch.equal(reloaded(ids).logits, want)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        pytest.param((2, 1), (1, 1), id="tp2-to-tp1"),
        pytest.param((1, 1), (2, 2), id="tp1-to-tp2xpp2"),
        pytest.param((1, 2), (2, 1), id="pp2-to-tp2"),
    ],
)
def test_checkpoint_reshards(tmp_path, saved, loaded):
    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    run_distributed(_convert, saved[0] * saved[1], str(hf_dir), str(ckpt), *saved)
    errors = run_distributed(
        _compare_params, loaded[0] * loaded[1], str(hf_dir), str(ckpt), *loaded
    )
    assert max(errors) == 0.0


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / tool), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_convert_export_and_check(tmp_path):
    """The three tools' mains in a row on the persistent world; the last check, which must fail,
    is the command as users start it (its exit code and verdict line). The bad-input test below
    starts the two conversion tools as commands too."""
    hf_dir = save_hf("qwen-tied", tmp_path / "hf")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    argv = ["--hf-dir", str(hf_dir), "--out", str(ckpt), "--tp", "2", "--pp", "2"]
    code, log = run_tool("convert_hf_to_megatron.py", 1, *argv)
    assert code == 0, log
    code, log = run_tool("convert_megatron_to_hf.py", 1, "--ckpt", str(ckpt), "--out", str(back))
    assert code == 0, log
    code, log = run_tool("check_conversion.py", 1, "--hf-dir", str(back), "--ckpt", str(ckpt))
    assert code == 0, log
    result = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    assert result["max_abs_logits"] < 1e-5 and result["max_abs_logprob"] < 1e-5
    # a different model against the same checkpoint must fail the check
    other = save_hf("qwen-tied", tmp_path / "other", seed=7)
    done = _cli("check_conversion.py", "--hf-dir", str(other), "--ckpt", str(ckpt))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stderr


# ---- bad input: a clear error, and no output folder (not even a partial one) ---------------


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created"
    assert not list(out.parent.glob(f".{out.name}*")), "a partial folder was left behind"


def edit_config(hf_dir: Path, **changes) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


BAD_INPUTS = {
    "missing-config": (lambda d: (d / "config.json").unlink(), {}, "config.json is missing"),
    "corrupt-config": (
        lambda d: (d / "config.json").write_text("{not json"),
        {},
        "is not valid JSON",
    ),
    "missing-weights": (
        lambda d: (d / "model.safetensors").unlink(),
        {},
        "holds neither model.safetensors",
    ),
    "corrupt-weights": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 10),
        {},
        "is not a readable safetensors file",
    ),
    "missing-shard": (
        lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "nope.safetensors"}})
        ),
        {},
        "shard files listed in the index are missing",
    ),
    "unsupported-arch": (
        lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]),
        {},
        "architecture 'GPT2LMHeadModel' is not supported",
    ),
    "heads-not-divisible": (lambda d: None, {"tp": 3}, "the largest valid tp at or below 3 is 2"),
    "layers-not-divisible": (lambda d: None, {"pp": 3}, "the largest valid pp at or below 3 is 2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error(tmp_path, case):
    break_it, kwargs, message = BAD_INPUTS[case]
    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    break_it(hf_dir)
    out = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        hf_to_megatron(hf_dir, out, **kwargs)
    assert_nothing_written(out)


def _convert_expect_error(rank, world, hf_dir, out):
    try:
        hf_to_megatron(hf_dir, out)
    except ValueError as err:
        return str(err)
    return None


def test_shapes_that_do_not_match_the_config(tmp_path):
    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    edit_config(hf_dir, intermediate_size=128)  # weights were saved with 96
    out = tmp_path / "ckpt"
    (message,) = run_distributed(_convert_expect_error, 1, str(hf_dir), str(out))
    assert message is not None and "checkpoint shapes do not match the config" in message
    assert "linear_fc1" in message
    assert_nothing_written(out)


def test_cli_reports_bad_input(tmp_path):
    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    done = _cli(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(tmp_path / "ckpt"),
        "--tp",
        "3",
    )
    assert done.returncode == 2
    assert "error: tp=3 does not divide num_attention_heads=4" in done.stderr
    assert_nothing_written(tmp_path / "ckpt")
    done = _cli(
        "convert_megatron_to_hf.py",
        "--ckpt",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "back"),
    )
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert_nothing_written(tmp_path / "back")


def _export_expect_error(rank, world, ckpt, out):
    from cwgrpo_megatron.megatron.conversion import megatron_to_hf

    try:
        megatron_to_hf(ckpt, out)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("tamper", ["arch", "weights"])
def test_megatron_checkpoint_that_does_not_match_its_config(tmp_path, tamper):
    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    run_distributed(_convert, 1, str(hf_dir), str(ckpt), 1, 1)
    meta_path = ckpt / "cwgrpo_checkpoint.json"
    if tamper == "arch":  # the config says a larger FFN than the saved tensors have
        meta = json.loads(meta_path.read_text())
        meta["arch"]["ffn_hidden_size"] = 128
        meta_path.write_text(json.dumps(meta))
        expected = "cannot load the dist checkpoint"
    else:
        for f in (ckpt / "model").glob("*.distcp"):
            f.write_bytes(b"broken")
        expected = "cannot load the dist checkpoint"
    out = tmp_path / "back"
    (message,) = run_distributed(_export_expect_error, 1, str(ckpt), str(out))
    assert message is not None and expected in message, message
    assert_nothing_written(out)


def test_what_the_converter_takes_and_the_errors_that_say_what_to_give(tmp_path):
    from cwgrpo_megatron.megatron.conversion import find_checkpoint

    hf_dir = save_hf("qwen-untied", tmp_path / "hf")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    run_distributed(_convert, 1, str(hf_dir), str(ckpt), 1, 1)
    assert find_checkpoint(ckpt) == ckpt
    assert find_checkpoint(ckpt / "model") == ckpt
    (ckpt / "train_state.json").write_text("{}")  # what marks a complete training checkpoint
    assert find_checkpoint(tmp_path / "run") == ckpt  # a run folder: its newest
    with pytest.raises(ValueError, match="holds no cwgrpo_checkpoint.json: give a checkpoint"):
        find_checkpoint(hf_dir)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="the run folder .*empty has no checkpoint"):
        find_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        find_checkpoint(tmp_path / "none")
