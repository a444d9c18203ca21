# SPDX-License-Identifier: Apache-2.0
"""The embedded `tiny` default: a trained pair shipped inside the package (a few MB).

The target is a byte-level Qwen3-architecture LM trained on the Python standard library's source;
the drafter is a DFlash drafter trained for it with `dflash-trt train-drafter` on the target's own
greedy continuations. Both were made by one command, `make tiny-pair`
(build/recipes/tiny_pair.py), and live in `dflash_trt/assets/tiny/` in the z-lab/Hugging Face
layout, so they load through exactly the same checkpoint code as real models. The held-out
prompts (from stdlib files neither model saw) that the recipe measured tau on ship with them.
Beside the v1 drafter ships a DFlash 2 drafter for the same target (`drafter-dflash2`, trained with the
same data and budget; `--drafter tiny-dflash2`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashTrtError

TINY_NAME = "tiny"
TINY_DFLASH2_NAME = "tiny-dflash2"  # --drafter name of the packaged DFlash 2 drafter for the tiny target
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "tiny"
# ChatML over the tiny tokenizer's own special tokens, shipped as target/chat_template.jinja (the
# pair never saw chat data: the template exists so chat paths -- `generate --chat`, the OpenAI
# front, openai-chat sweeps -- run on tiny). build_byte_tokenizer() itself has no template.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What must be present for the pair to load.
_REQUIRED = {
    "target": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"),
    "drafter": ("config.json", "model.safetensors"),
    "drafter-dflash2": ("config.json", "model.safetensors"),
}


@dataclass(frozen=True)
class TinyPaths:
    target: Path
    drafter: Path  # the v1 DFlash drafter (the default)
    drafter_dflash2: Path  # the DFlash 2 drafter


def ensure_tiny() -> TinyPaths:
    """The packaged tiny pair's directories (read-only; nothing is created or downloaded)."""
    paths = TinyPaths(
        target=ASSETS_DIR / "target",
        drafter=ASSETS_DIR / "drafter",
        drafter_dflash2=ASSETS_DIR / "drafter-dflash2",
    )
    missing = [f"{part}/{name}" for part, names in _REQUIRED.items() for name in names
               if not (ASSETS_DIR / part / name).is_file()]  # fmt: skip
    if missing:
        raise DFlashTrtError(
            f"tiny: the packaged pair is incomplete in {ASSETS_DIR} (missing {', '.join(missing)})",
            hint="reinstall dflash-trt, or rebuild the pair with `make tiny-pair`",
        )
    return paths


def heldout_prompts() -> list[str]:
    """Python code prompts from stdlib files that neither tiny model was trained on."""
    return list(json.loads((ASSETS_DIR / "heldout_prompts.json").read_text())["prompts"])


def build_byte_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins
    table = _bytes_to_unicode()
    assert set(table.values()) == set(byte_to_char)
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))
