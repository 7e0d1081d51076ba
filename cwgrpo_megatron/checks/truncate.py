"""The first N decoder layers of an HF checkpoint, as a checkpoint of its own.

The self-checks (`tools/check_layout.py`, `tools/check_weight_sync.py`) take `--num-layers N`
to run on a real model's real weights in a fraction of the time: embedding, final norm and
output layer are kept, layers >= N are dropped, `num_hidden_layers` becomes N. Every component a
check exercises (attention with its GQA layout, MLP, norms, tied or untied output, the full
vocabulary) is still there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from cwgrpo_megatron.common.files import atomic_folder
from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint, iter_tensors, write_sharded

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_KEEP = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
         "special_tokens_map.json", "chat_template.jinja", "generation_config.json")  # fmt: skip


def truncate_checkpoint(hf_dir: str | os.PathLike, num_layers: int, out: str | os.PathLike) -> Path:
    """Write the first `num_layers` layers of `hf_dir` (and everything outside the layers) to
    `out`, built in a temporary folder beside it and renamed into place (`files.atomic_folder`)."""
    src, dst = Path(hf_dir), Path(out)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers {num_layers}: {src} has layers 1..{total}")
    ckpt = HFCheckpoint(src)
    names = [n for n in ckpt.names() if not (m := _LAYER.match(n)) or int(m.group(1)) < num_layers]
    with atomic_folder(dst) as tmp:
        write_sharded(iter_tensors(ckpt, names), tmp)
        config["num_hidden_layers"] = num_layers
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _KEEP:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
    return dst
