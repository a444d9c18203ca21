# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt import`: a GGUF file (llama.cpp's format) converted into a checkpoint directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command("import")
@click.argument("gguf_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="The checkpoint's dtype (every quantized tensor is dequantized into it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
def import_gguf(gguf_file: Path, dtype: str, as_json: bool) -> None:
    """Convert a Llama or Qwen GGUF file once into a checkpoint directory the engine loads (config,
    safetensors, tokenizer and chat template from the file's metadata), cached under
    $DFLASH_TRT_MODEL_CACHE (default ~/.cache/dflash-trt/models); prints the directory. Every command
    also takes the .gguf file itself as --target and converts it the same way.

    \b
    Examples:
      dflash-trt import ./Qwen3-0.6B-Q8_0.gguf
      dflash-trt generate --target ./Qwen3-0.6B-Q8_0.gguf --chat --prompt "Hi" --no-draft
    """
    from dflash_trt.utils.gguf import converted_dir, read_metadata

    out = converted_dir(gguf_file, dtype=dtype)
    if as_json:
        meta = read_metadata(gguf_file.expanduser().resolve())
        sys.stdout.write(json.dumps({"checkpoint": str(out), "dtype": dtype,
                                     "architecture": meta.get("general.architecture")}) + "\n")  # fmt: skip
    else:
        click.echo(str(out))
