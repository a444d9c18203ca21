# SPDX-License-Identifier: Apache-2.0
"""Turn user-facing names (packaged pairs, .gguf files, local directories) into a loaded target, drafter and tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import CheckpointError, UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModels:
    target_dir: Path
    drafter_dir: Path | None
    name: str  # what the user typed


def resolve_models(target: str, drafter: str | None = None) -> ResolvedModels:
    """A packaged pair's name (pairs.py: `tiny`, `smollm2-135m`) -> its target and default drafter; a
    `.gguf` file -> its converted checkpoint; a directory -> itself. `drafter` overrides the default
    drafter: a packaged drafter's name (`tiny-dflash2`, `smollm2-135m-dflash2`, ...) or a directory."""
    from dflash_trt import pairs

    default_drafter: Path | None = None
    if pairs.is_packaged(target):
        pair = pairs.packaged_pair(target)
        target_dir, default_drafter = pair.target, pairs.default_drafter(pair)
    else:
        target_dir = pairs.resolve_target_path(target) or Path(target).expanduser()
        if not target_dir.is_dir():
            raise UsageError(
                f"--target={target!r} is neither a known model name, a .gguf file nor a directory",
                hint=f"use one of {', '.join(pairs.pair_names())}, a .gguf file, or a directory written by "
                "transformers save_pretrained",
            )
    if pairs.is_packaged_drafter(drafter):
        assert drafter is not None
        drafter_dir: Path | None = pairs.packaged_drafter(drafter)
    else:
        drafter_dir = Path(drafter).expanduser() if drafter else default_drafter
    if drafter_dir is not None and not drafter_dir.is_dir():
        raise UsageError(
            f"--drafter={str(drafter_dir)!r} is not a directory", hint="pass a z-lab DFlash drafter directory"
        )
    return ResolvedModels(target_dir=target_dir, drafter_dir=drafter_dir, name=target)


def target_dtype(dtype: str | None, device: Any, target_dir: Path) -> Any:
    """The dtype the target runs in: an explicit name, or utils/device.resolve_dtype's auto policy fed with
    the checkpoint's dtype and the weights a step reads (config.json); a config the native engine cannot
    parse gives the policy without them."""
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.checkpoint import read_json
    from dflash_trt.models.target_config import parse_target_config
    from dflash_trt.utils.device import resolve_dtype

    try:
        tcfg = parse_target_config(read_json(target_dir / "config.json", what="target config"))
    except ConfigError:
        return resolve_dtype(dtype, device)
    return dtype_for(dtype, device, tcfg)


def dtype_for(dtype: str | None, device: Any, tcfg: Any) -> Any:
    """target_dtype for a parsed TargetConfig (models/target_config.py)."""
    from dflash_trt.utils.device import DTYPES, resolve_dtype

    return resolve_dtype(
        dtype, device, checkpoint_dtype=DTYPES.get(tcfg.checkpoint_dtype or ""),
        num_step_parameters=tcfg.num_step_parameters(),
    )  # fmt: skip


def load_tokenizer(target_dir: Path) -> Any | None:
    """The target's tokenizer, or None when the directory has none."""
    if not any(
        (target_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load the tokenizer in {target_dir}: {exc}", hint="re-save the tokenizer"
        ) from exc


def chat_prompt_ids(tokenizer: Any, messages: Any, *, generation_prompt: bool = True) -> list[int]:
    """The tokenised chat template of `messages` (thinking off), with the assistant's generation
    prompt after them unless generation_prompt=False: how `generate --chat`, training data and
    regeneration all put a conversation into ids."""
    return list(
        tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=generation_prompt,
            tokenize=True,
            enable_thinking=False,
            return_dict=False,
        )
    )


def default_stop_token_ids(target_dir: Path, tokenizer: Any | None) -> list[int]:
    """eos ids from generation_config.json, then config.json, then the tokenizer."""
    import json

    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            try:
                eos = json.loads(path.read_text()).get("eos_token_id")
            except (OSError, json.JSONDecodeError):
                eos = None
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return []


def resolve_mask_token_id(drafter_dir: Path, tokenizer: Any | None) -> int | None:
    """Older checkpoints lack dflash_config.mask_token_id: fall back to the tokenizer's <|MASK|>."""
    from dflash_trt.models.checkpoint import read_json

    cfg = read_json(drafter_dir / "config.json", what="drafter config")
    if (cfg.get("dflash_config") or {}).get("mask_token_id") is not None or cfg.get(
        "mask_token_id"
    ) is not None:
        return None
    if tokenizer is None:
        return None
    mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    if mask is None or mask == tokenizer.unk_token_id:
        return None
    log.warning("drafter config has no mask_token_id; using the tokenizer's <|MASK|> id %s", mask)
    return int(mask)
