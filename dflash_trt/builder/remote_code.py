# SPDX-License-Identifier: Apache-2.0
"""Does a TensorRT-LLM plan need `trust_remote_code`? Only when a repository's config cannot be
read without running that repository's own Python code.

TensorRT-LLM builds the target and the DFlash drafter with its own model classes; what it loads
through transformers is the configuration (AutoConfig) and the tokenizer (AutoTokenizer). So a
repository needs its code trusted when its config.json maps one of those to its own code
(`auto_map`) and its `model_type` is not one transformers ships: then transformers cannot read it
otherwise. A native `model_type` with an `auto_map` (every z-lab drafter maps AutoModel to
`dflash.DFlashDraftModel`, for the authors' loader) loads with transformers' own classes, and
trusting the repository would only make transformers prefer the remote code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trt.builder.source import ResolvedPair
from dflash_trt.errors import UsageError

# What TensorRT-LLM loads through transformers' Auto classes (models it builds itself).
LOADED_BY_TRANSFORMERS = ("AutoConfig", "AutoTokenizer")


@dataclass(frozen=True, slots=True)
class RemoteCode:
    """The decision: `trust` goes into the LLM-API config only when True; `note` explains it."""

    trust: bool
    note: str


def native_model_types() -> frozenset[str] | None:
    """The model types the installed transformers reads without remote code (None: not installed)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return None
    return frozenset(CONFIG_MAPPING_NAMES)


def _mapped(config: dict[str, Any]) -> dict[str, Any]:
    """The classes transformers would load that the config's auto_map points at the repository's code."""
    auto_map = config.get("auto_map") or {}
    return (
        {k: v for k, v in auto_map.items() if k in LOADED_BY_TRANSFORMERS}
        if isinstance(auto_map, dict)
        else {}
    )


def _needs(role: str, ref: str, config: dict[str, Any], native: frozenset[str] | None) -> str | None:
    """Why this repository needs its code trusted, or None."""
    mapped = _mapped(config)
    if not mapped:
        return None
    model_type = config.get("model_type")
    if native is not None and model_type in native:
        return None
    classes = ", ".join(f"{k} -> {v}" for k, v in sorted(mapped.items()))
    if native is None:
        tail = f"transformers is not installed to tell whether model_type={model_type!r} is one it ships"
    else:
        tail = f"model_type={model_type!r} is not one transformers ships"
    return f"{role} {ref}: config.json maps {classes} to the repository's code and {tail}"


def decide_remote_code(pair: ResolvedPair, *, refuse: bool) -> RemoteCode:
    """Whether the plan trusts remote code, with the note that says why. With `refuse`
    (--no-remote-code) a repository that needs its code is a usage error."""
    sources = [("target", pair.target), *([("drafter", pair.drafter)] if pair.drafter is not None else [])]
    # transformers' model types only matter for a config that maps code (importing it takes seconds: torch)
    native = native_model_types() if any(_mapped(s.config) for _, s in sources) else frozenset()
    reasons = [r for role, s in sources if (r := _needs(role, s.ref, s.config, native)) is not None]
    if reasons and refuse:
        raise UsageError(
            f"--no-remote-code: {reasons[0]}, so TensorRT-LLM would have to run it",
            hint="review that code and drop --no-remote-code, or use a checkpoint of a model type transformers ships",
        )
    if reasons:
        return RemoteCode(
            True,
            "trust_remote_code: true because " + "; ".join(reasons) + " (--no-remote-code refuses this)",
        )
    mapped = [f"{role} {s.ref} (model_type={s.config.get('model_type')!r})" for role, s in sources
              if s.config.get("auto_map")]  # fmt: skip
    why = (
        f"; the auto_map of {', '.join(mapped)} serves other loaders: transformers reads these model types "
        "with its own classes"
        if mapped
        else ""
    )
    return RemoteCode(False, f"trust_remote_code is not set: no repository needs its own code{why}")
