"""Prompt datasets: schemas, templates, sampling, and bad rows located. The benchmark files' gold
answers are parsed in tests/distributed/test_benchmark_answers.py (a pool of workers)."""

import json

import pytest

from cwgrpo_megatron.data.prompts import (
    PromptSampler,
    filter_by_length,
    load_problems,
    render_prompt,
)


def test_schemas_and_answer_normalisation(tmp_path):
    rows = [
        {"problem": "p1", "solution": "s", "answer": "3", "level": "Level 3"},
        {"problem": "p2", "answer": 27.0},
        {"problem": "p3", "solution": "so \\boxed{\\frac{1}{2}}"},
        {"question": "p4", "final_answer": ["$x+1$"]},
        {"question": "p5", "final_answer": ["1", "2"]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems, stats = load_problems(path)
    assert [p.answer for p in problems] == ["3", "27", "\\frac{1}{2}", "x+1", "1,2"]
    assert problems[0].level == "Level 3" and stats.rows == 5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="json"),
        pytest.param("[1, 2]", "must be a JSON object", id="not-object"),
        pytest.param('{"problem": "p", "solution": "no box"}', "has no \\\\boxed", id="no-answer"),
        pytest.param('{"prompt": "p"}', "no known schema", id="unknown-schema"),
        pytest.param('{"problem": "", "answer": "1"}', "'problem' is missing", id="empty"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"problem": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"data.jsonl:2: .*{message}"):
        load_problems(path)
    problems, stats = load_problems(path, skip_bad_rows=True)
    assert len(problems) == 1 and stats.skipped == 1 and "data.jsonl:2" in stats.first_errors[0]


def test_missing_and_unsupported_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_problems(tmp_path / "none.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_problems(tmp_path / "x.csv")


def test_parquet_source(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet support needs pyarrow")
    import pyarrow as pa

    table = pa.Table.from_pylist([{"problem": "p", "answer": "2"}])
    pq.write_table(table, tmp_path / "d.parquet")
    problems, _ = load_problems(tmp_path / "d.parquet")
    assert problems[0].answer == "2"


def test_templates_and_length_filter():
    qwen = render_prompt("What is 1+1?", template="qwen2.5")
    assert qwen.startswith("<|im_start|>system\n") and qwen.endswith("<|im_start|>assistant\n")
    r1 = render_prompt("What is 1+1?", template="r1_distill")
    assert "<｜User｜>What is 1+1?<｜Assistant｜><think>\n" in r1
    with pytest.raises(ValueError, match="choose one of: r1_distill, qwen2.5"):
        render_prompt("x", template="llama")
    kept, dropped = filter_by_length([[1] * 3, [1] * 9, [1] * 5], max_prompt_length=5)
    assert kept == [0, 2] and dropped == 1


def test_sampler_is_deterministic_and_resumable():
    a = PromptSampler(size=7, seed=3)
    first = [a.next_indices(3) for _ in range(5)]  # crosses two epoch boundaries
    assert sorted(first[0] + first[1] + [first[2][0]]) == list(range(7))
    b = PromptSampler(size=7, seed=3)
    b.next_indices(3)
    b.next_indices(3)
    c = PromptSampler(size=7, seed=99)
    c.load_state_dict(b.state_dict())
    assert [c.next_indices(3) for _ in range(3)] == first[2:]
    assert PromptSampler(size=7, seed=4).next_indices(7) != first[0] + first[1][:4]
    with pytest.raises(ValueError, match="for 7 prompts, the dataset has 8"):
        PromptSampler(size=8).load_state_dict(b.state_dict())
