# SPDX-License-Identifier: Apache-2.0
"""GGUF files (llama.cpp's format, how CPU users keep their models) converted once into a checkpoint
directory the engine loads: config.json, model.safetensors, tokenizer files and chat template.

transformers reads the file (`gguf_file=`, with the `gguf` package) and dequantizes every tensor;
the result is saved in the dtype asked for. The conversion is cached under
$DFLASH_TRT_MODEL_CACHE (default ~/.cache/dflash-trt/models) in a directory named after the file's
SHA-256 and the dtype, written beside its final place and renamed into it, under a lock: a reader
sees a complete checkpoint or none, and two processes never convert the same file twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError, UsageError
from dflash_trt.utils.io import atomic_dir, file_sha256

log = logging.getLogger(__name__)

# Architectures whose GGUF tensors transformers maps back to a checkpoint the embedded engine runs.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = ("bfloat16", "float16", "float32")
FORMAT_VERSION = 1  # bump when the converted layout changes: old cache entries are then not reused
PROVENANCE = "dflash_trt_gguf.json"  # written last inside the converted directory


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TRT_MODEL_CACHE") or "~/.cache/dflash-trt/models").expanduser()


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF header fields that decide the conversion (no tensor is read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise UsageError(
            f"{path} is not a readable GGUF file ({exc})", hint="pass a .gguf model file"
        ) from exc
    fields = {}
    for key in ("general.architecture", "general.name", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"):  # fmt: skip
        if key in reader.fields:
            fields[key] = reader.fields[key].contents()
    return fields


def converted_dir(path: Path, *, dtype: str = "bfloat16", name: str | None = None) -> Path:
    """The checkpoint directory of GGUF file `path` in `dtype`, converting it on first use."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"GGUF file {str(path)!r} does not exist", hint="pass the path of a .gguf file")
    if dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r} is not supported for GGUF conversion", hint=f"use one of {DTYPES}")
    digest = file_sha256(path)
    done = [d for d in sorted(cache_root().glob(f"*-{digest[:16]}-{dtype}")) if _complete(d)]
    if done:  # converted before, maybe under another name (the same bytes given by another path)
        return done[0]
    out = cache_root() / f"{name or path.stem.lower()}-{digest[:16]}-{dtype}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.parent / f".{out.name}.lock"):
        if not _complete(out):  # another process may have finished it while we waited
            _convert(path, out, dtype=dtype, digest=digest)
    return out


def _complete(out: Path) -> bool:
    try:
        return json.loads((out / PROVENANCE).read_text()).get("format") == FORMAT_VERSION
    except (OSError, json.JSONDecodeError):
        return False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    import fcntl

    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(path: Path, out: Path, *, dtype: str, digest: str) -> None:
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UsageError(
            f"{path.name}: general.architecture={arch!r} is not supported",
            hint=f"convert a GGUF of one of {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    sys.stderr.write(f"converting {path.name} ({arch}) to a {dtype} checkpoint in {out} (once)\n")
    t0 = time.perf_counter()
    # An incomplete leftover (no provenance file) is replaced; under the lock nobody else writes it.
    with atomic_dir(out, overwrite=True) as tmp:
        _save_checkpoint(path, tmp, dtype=dtype, meta=meta)
        provenance = {"format": FORMAT_VERSION, "source": str(path), "sha256": digest, "dtype": dtype,
                      "architecture": arch, "name": meta.get("general.name")}  # fmt: skip
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
    log.info("converted %s in %.1f s", path.name, time.perf_counter() - t0)


def _save_checkpoint(path: Path, out: Path, *, dtype: str, meta: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise DFlashTrtError(
            f"transformers cannot convert {path.name}: {exc}",
            hint="check that `gguf` is installed and the file is a Llama/Qwen GGUF",
        ) from exc
    _fix_special_tokens(tokenizer, meta)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fix_special_tokens(tokenizer: Any, meta: dict[str, Any]) -> None:
    """The special tokens the GGUF header names: transformers' GGUF tokenizer import can take its eos
    from the wrong field (SmolLM2: `<|im_start|>` instead of the end-of-turn `<|im_end|>`), so a chat
    would never stop."""
    for field, attr in (("eos", "eos_token"), ("bos", "bos_token"), ("padding", "pad_token")):
        token_id = meta.get(f"tokenizer.ggml.{field}_token_id")
        if token_id is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    # BPE tokenizers must keep the spaces before punctuation (transformers warns on every load otherwise).
    tokenizer.clean_up_tokenization_spaces = False
