# SPDX-License-Identifier: Apache-2.0
"""The embedded `tiny` default: a small Qwen3 target, its DFlash drafter and a byte-level tokenizer.

It is created deterministically (fixed seeds, no network) into the user cache on first use and
then loaded through exactly the same checkpoint code as real models.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TINY_NAME = "tiny"
TINY_VERSION = "random-v1"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")

# Shapes of the tiny pair (the target is Qwen3-architecture).
TINY_TARGET: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
TINY_DRAFTER: dict[str, Any] = {"num_hidden_layers": 2, "block_size": 8, "target_layer_ids": [1, 4]}


@dataclass(frozen=True)
class TinyPaths:
    root: Path
    target: Path
    drafter: Path


def cache_home() -> Path:
    base = os.environ.get("DFLASH_TRT_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash-trt"
    )
    return Path(base)


def ensure_tiny(home: Path | None = None) -> TinyPaths:
    """Return the tiny pair's directories, creating them (atomically) on first use."""
    root = (home or cache_home()) / f"tiny-{TINY_VERSION}"
    paths = TinyPaths(root=root, target=root / "target", drafter=root / "drafter")
    if (root / "COMPLETE").is_file():
        return paths
    from dflash_trt.utils.io import atomic_dir

    log.info("creating the tiny model pair in %s", root)
    with atomic_dir(root, overwrite=True) as tmp:
        _create(tmp)
        (tmp / "COMPLETE").write_text(TINY_VERSION + "\n")
    return paths


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


def _create(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from dflash_trt.engine.checkpoint import parse_dflash_config, save_drafter
    from dflash_trt.engine.drafter import DFlashDrafter

    tokenizer = build_byte_tokenizer()
    vocab = 264  # 256 bytes + 4 specials, padded to a multiple of 8
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    torch.manual_seed(1234)
    cfg = Qwen3Config(
        vocab_size=vocab, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=None, **TINY_TARGET
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    target = Qwen3ForCausalLM(cfg).eval()
    target.generation_config = GenerationConfig(eos_token_id=eos)
    target.save_pretrained(out / "target")
    tokenizer.save_pretrained(out / "target")

    dcfg = parse_dflash_config(
        hf_config={
            "architectures": ["DFlashDraftModel"],
            "hidden_size": TINY_TARGET["hidden_size"],
            "intermediate_size": TINY_TARGET["intermediate_size"],
            "num_hidden_layers": TINY_DRAFTER["num_hidden_layers"],
            "num_attention_heads": TINY_TARGET["num_attention_heads"],
            "num_key_value_heads": TINY_TARGET["num_key_value_heads"],
            "head_dim": TINY_TARGET["head_dim"],
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": TINY_TARGET["max_position_embeddings"],
            "block_size": TINY_DRAFTER["block_size"],
            "num_target_layers": TINY_TARGET["num_hidden_layers"],
            "vocab_size": vocab,
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": TINY_DRAFTER["target_layer_ids"]},
        }
    )
    save_drafter(DFlashDrafter.random(dcfg, seed=4321), out / "drafter", dtype=torch.float32)
