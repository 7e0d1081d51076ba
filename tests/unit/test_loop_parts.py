"""The training loop's pure parts: seeds, prompt sets, batches, metrics, run
folder bookkeeping (the nodes' markers too)."""

import gzip
import json
import math

import pytest
import torch

from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.data.batching import batch_from_rollouts
from cwgrpo_megatron.data.prompt_set import build_prompt_sets
from cwgrpo_megatron.data.prompts import PromptFormat
from cwgrpo_megatron.reward.scoring import ScoredGroup
from cwgrpo_megatron.rollout.base import Completion, RolloutGroup, rollout_seed
from cwgrpo_megatron.run.run_dir import (
    RunDir,
    checkpoint_to_resume,
    mark_node,
    rewind_metrics,
    wait_for_nodes,
    write_samples,
)
from cwgrpo_megatron.run.step_metrics import rollout_metrics, step_tokens, timing_metrics
from cwgrpo_megatron.run.tracking import _json_value


def test_mask_truncated_drops_the_loss_of_cut_completions_only():
    group = RolloutGroup(
        [1, 2],
        [
            Completion([5, 0], [-1.0, -1.0], "stop"),
            Completion([6, 7], [-1.0, -1.0], "length"),
        ],
        0,
    )
    rewards = torch.tensor([[1.0, 0.0]])
    plain = batch_from_rollouts([group], rewards)
    masked = batch_from_rollouts([group], rewards, mask_truncated=True)
    assert masked.loss_mask[0].equal(plain.loss_mask[0]) and masked.loss_mask[1].sum() == 0
    # the cut completion's reward still sets the baseline: advantages are those of [1, 0]
    assert masked.advantages[0].equal(plain.advantages[0])


def test_rollout_seeds_depend_on_seed_step_and_prompt_only():
    n = 4
    seeds = [rollout_seed(7, 3, j, n) for j in range(6)]
    assert seeds == [rollout_seed(7, 3, j, n) for j in range(6)]
    samples = {s + i for s in seeds for i in range(n)}
    assert len(samples) == 6 * n  # the samples of a step never share a seed
    assert seeds != [rollout_seed(7, 4, j, n) for j in range(6)]
    assert seeds != [rollout_seed(8, 3, j, n) for j in range(6)]
    assert all(0 <= s < 2**31 - n for s in seeds)


class WordTokenizer:
    """One token per character, enough for length limits."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def _data_cfg(path, **overrides):
    items = [f"data.train_files=[{path}]", *(f"data.{k}={v}" for k, v in overrides.items())]
    return load_config(overrides=items).data


def test_prompt_sets_filter_by_length_and_hold_out_a_seeded_draw(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"problem": "x" * n, "answer": str(n)} for n in range(1, 31)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fmt = PromptFormat(template="plain")  # "{problem}\n": n + 1 tokens
    train, held, report = build_prompt_sets(
        _data_cfg(path, max_prompt_tokens=21, heldout_size=5), WordTokenizer(), fmt
    )
    assert (report.rows, report.too_long, report.train, report.heldout) == (30, 10, 15, 5)
    assert all(len(ids) <= 21 for ids in train.token_ids + held.token_ids)
    assert not {p.id for p in train.problems} & {p.id for p in held.problems}
    again, held_again, _ = build_prompt_sets(
        _data_cfg(path, max_prompt_tokens=21, heldout_size=5), WordTokenizer(), fmt
    )
    assert held_again.problems == held.problems and again.problems == train.problems
    _, other, _ = build_prompt_sets(
        _data_cfg(path, max_prompt_tokens=21, heldout_size=5, seed=1), WordTokenizer(), fmt
    )
    assert other.problems != held.problems
    with pytest.raises(ValueError, match="all 30 prompts are longer than data.max_prompt_tokens=1"):
        build_prompt_sets(_data_cfg(path, max_prompt_tokens=1), WordTokenizer(), fmt)
    with pytest.raises(ValueError, match="leaves no training prompts"):
        build_prompt_sets(_data_cfg(path, heldout_size=30), WordTokenizer(), fmt)


def test_prompt_sets_report_bad_rows_by_line_or_count_them(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "p", "answer": "1"}\n{"problem": "q"}\nnot json\n')
    fmt = PromptFormat(template="plain")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*skip_bad_rows=true"):
        build_prompt_sets(_data_cfg(path), WordTokenizer(), fmt)
    train, _, report = build_prompt_sets(_data_cfg(path, skip_bad_rows=True), WordTokenizer(), fmt)
    assert (len(train), report.skipped_rows) == (1, 2)
    with pytest.raises(ValueError, match="data.train_files is empty"):
        build_prompt_sets(load_config().data, WordTokenizer(), fmt)


def _scored(position, rewards, lengths, finish, texts=None):
    completions = [Completion([1] * n, [-1.0] * n, f) for n, f in zip(lengths, finish, strict=True)]
    return ScoredGroup(
        position=position,
        problem_id=str(position),
        answer="1",
        prompt_ids=[9, 9, 9],
        completions=completions,
        texts=texts or ["a b c d"] * len(rewards),
        rewards=rewards,
        parts={"format": [r / 2 for r in rewards]},
        correct=[float(r > 0) for r in rewards],
    )


def test_rollout_metrics_of_a_known_step():
    groups = [
        _scored(0, [1.0, 0.0], [2, 4], ["stop", "length"]),
        _scored(1, [1.0, 1.0], [3, 3], ["stop", "stop"], texts=["a b c d a b c d", "x"]),
    ]
    m = rollout_metrics(groups)
    assert m["reward/mean"] == pytest.approx(0.75)
    assert m["reward/std"] == pytest.approx(math.sqrt(0.1875))
    assert m["reward/format"] == pytest.approx(0.375)
    assert m["accuracy/mean"] == pytest.approx(0.75)
    assert m["response_length/mean"] == 3.0 and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == 0.25
    assert m["groups/frac_zero_std"] == 0.5
    # 5 four-grams of "a b c d a b c d", one repeated: 1/5, among 4 completions
    assert m["response/repetition_4gram"] == pytest.approx(0.2 / 4)
    assert step_tokens(groups) == 4 * 3 + 12
    t = timing_metrics({"step": 2.0, "rollout": 0.5}, tokens=24)
    assert t["timing_s/eval"] == 0.0 and t["perf/tokens_per_s"] == 12.0


def test_json_values_keep_non_finite_as_text():
    assert [_json_value(v) for v in (1.5, float("nan"), float("inf"))] == [1.5, "nan", "inf"]


def test_rewind_metrics_keeps_the_checkpointed_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": k, "x": k}) for k in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "x"')  # the last line was cut by a kill
    rewind_metrics(path, step=2, saved_line={"step": 2, "x": -1})
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "x": 1},
        {"step": 2, "x": 2},  # the file's own line wins over the checkpoint's copy
    ]
    path.write_text(lines[0] + "\n")  # killed after the save of step 2, before its line
    rewind_metrics(path, step=2, saved_line={"step": 2, "x": -1})
    assert [json.loads(x)["x"] for x in path.read_text().splitlines()] == [1, -1]
    rewind_metrics(path, step=0, saved_line=None)
    assert path.read_text() == ""


def test_checkpoint_to_resume(tmp_path):
    run = RunDir(tmp_path)
    done = run.checkpoints / "step_00000002"
    done.mkdir(parents=True)
    (done / "train_state.json").write_text("{}")
    (run.checkpoints / ".step_00000003.partial").mkdir()  # a kill in the middle of a save
    (run.checkpoints / "step_00000004").mkdir()  # no train_state.json: never complete

    def cfg(resume):
        return load_config(overrides=[f"run.resume={resume}"])

    assert checkpoint_to_resume(cfg("auto"), run) == done
    assert checkpoint_to_resume(cfg(str(done)), run) == done
    with pytest.raises(ValueError, match="set run.resume=auto to continue it"):
        checkpoint_to_resume(cfg("none"), run)
    with pytest.raises(ValueError, match="not a complete training checkpoint"):
        checkpoint_to_resume(cfg(str(run.checkpoints / "step_00000004")), run)
    assert checkpoint_to_resume(cfg("none"), RunDir(tmp_path / "fresh")) is None


def test_samples_are_gzipped_jsonl(tmp_path):
    path = write_samples(RunDir(tmp_path).samples(3, gzipped=True), [{"a": 1}, {"b": "é"}])
    assert path.name == "step_00000003.jsonl.gz"
    rows = [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().splitlines()]
    assert rows == [{"a": 1}, {"b": "é"}]


def test_node_markers_in_the_run_folder(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError, match=r"run\.out_dir=.*run does not exist on this node 0\.2 s"):
        mark_node(run, "t0", 1, wait_s=0.2)  # this node does not see rank 0's folder
    assert not run.root.exists()  # and does not create it
    run.root.mkdir()
    marker = mark_node(run, "t0", 0, wait_s=0)
    assert marker.name == ".node-t0-0" and marker.read_text()
    missing = r"after 0\.3 s rank 0 sees no marker from node 1 \(b\) \(each"
    with pytest.raises(ValueError, match=missing):
        wait_for_nodes(run, "t0", {0: "node 0 (a)", 1: "node 1 (b)"}, wait_s=0.3)
    with pytest.raises(ValueError, match="sees no marker from node 0"):
        wait_for_nodes(run, "t1", {0: "node 0"}, wait_s=0)  # another start's markers
    mark_node(run, "t0", 1, wait_s=0)
    wait_for_nodes(run, "t0", {0: "node 0 (a)", 1: "node 1 (b)"}, wait_s=0)
