# SPDX-License-Identifier: Apache-2.0
"""The `smollm2-135m` pair as GGUF files for llama.cpp (bench/compare_llamacpp.sh PAIR=smollm2-135m): the
checkpoint `dflash-trt` converted from the installed package, and one of our drafters, through the
converter of ../shared/peers/llamacpp-setup.sh (its venv and `convert_hf_to_gguf.py`; nothing of llama.cpp
is shipped here), bf16 like the checkpoint.

One fix on the way: the checkpoint's tokenizer.json comes from transformers' GGUF reader, whose decoder
chain starts with ByteFallback. The converter reads that as a SentencePiece-style vocabulary, and llama.cpp
then tokenizes differently from us ("SPM vocabulary, but newline token not found"). The converter is given
the same files with the byte-level BPE's own decoder (ByteLevel), so it writes a GPT-2 style vocabulary
with SmolLM's pre-tokenizer; llama-server then tokenizes a chat prompt to our ids. The weights and every
other file are the checkpoint's (symbolic links). Outputs are written under a temporary name and renamed.

    .venv/bin/python bench/smollm2_gguf.py --converter /tmp/peer/llamacpp \\
        --target-gguf /tmp/peer/llamacpp/gguf/smollm2-135m-target-bf16.gguf \\
        --drafter dflash_trt/assets/smollm2-135m/drafter \\
        --drafter-gguf /tmp/peer/llamacpp/gguf/smollm2-135m-drafter-bf16.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def converter_input(checkpoint: Path, where: Path) -> Path:
    """`checkpoint`'s files linked into `where`, with tokenizer.json's decoder set to ByteLevel."""
    where.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "tokenizer.json":
            (where / f.name).symlink_to(f.resolve())
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok["decoder"] = BYTE_LEVEL_DECODER
    (where / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return where


def convert(converter: Path, source: Path, out: Path, *extra: str) -> None:
    """Run the converter on `source` into `out` (atomically), bf16."""
    python, script = converter / "venv" / "bin" / "python", converter / "llama.cpp" / "convert_hf_to_gguf.py"
    for need, fix in ((python, "run ../shared/peers/llamacpp-setup.sh"), (script, "run llamacpp-setup.sh")):
        if not need.exists():
            sys.exit(f"error: --converter {converter}: {need} is missing; fix: {fix} (or pass its directory)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    cmd = [str(python), str(script), str(source), "--outtype", "bf16", "--outfile", str(tmp), *extra]
    print(f"converting {source} -> {out}", flush=True)
    done = subprocess.run(cmd, cwd=script.parent, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: converting {source} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--converter", type=Path, required=True, help="llamacpp-setup.sh's directory")
    ap.add_argument("--target-gguf", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True, help="one of our drafters for smollm2-135m")
    ap.add_argument("--drafter-gguf", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_trt.smollm2 import ensure_smollm2

    checkpoint = Path(ensure_smollm2().target)
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as tmp:
        source = converter_input(checkpoint, Path(tmp) / "target")
        if not args.target_gguf.is_file():
            convert(args.converter, source, args.target_gguf)
        if not args.drafter_gguf.is_file():
            convert(
                args.converter, args.drafter.resolve(), args.drafter_gguf, "--target-model-dir", str(source)
            )


if __name__ == "__main__":
    main()
