# SPDX-License-Identifier: Apache-2.0
"""The speculative configuration, with TensorRT-LLM's `DFlashDecodingConfig` field names and rules.

- `max_draft_len` (K) must be set, > 0, and <= the drafter's block_size - 1 (TRT-LLM checks this at
  its first draft forward; we check it at load).
- `draft_len_schedule` {batch-size threshold: draft length}: for a batch of n running requests
  the draft length is the value at the first key >= n; above the largest key speculation is
  off (draft length 0). Keys >= 1, values in [0, K], the value at the smallest key == K.
- `max_concurrency` N is shorthand for {N: K}; it is mutually exclusive with the schedule.
- `tree_budget` (a dflash-trt extension; TensorRT-LLM has no such field): verify a DDTree of that many
  drafted nodes per round instead of the argmax chain (spec/tree.py). 0 or absent = linear DFlash;
  "auto" = a budget the engine picks per step from measured round cost and acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from dflash_trt.errors import ConfigError
from dflash_trt.models.dflash_config import max_draft_len_for

DECODING_TYPE = "DFlash"
TREE_BUDGET_AUTO = "auto"
MAX_TREE_BUDGET = 1024  # nodes per request and round; the verify pass grows with it


def parse_tree_budget(value: Any, *, field_name: str = "speculative_config.tree_budget") -> int | str:
    """0 (linear DFlash), a node budget in [1, MAX_TREE_BUDGET], or "auto"; None reads as 0.
    Digit strings (CLI flags, environment) are accepted. Raises ConfigError naming `field_name`."""
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().lower() == TREE_BUDGET_AUTO:
        return TREE_BUDGET_AUTO
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TREE_BUDGET:
        raise ConfigError(
            field_name,
            value,
            f"must be an integer in [0, {MAX_TREE_BUDGET}] or 'auto'",
            hint="0 = linear DFlash; 16-64 nodes suit small batches; 'auto' lets the engine choose",
        )
    return value


@dataclass
class DFlashDecodingConfig:
    """Mirror of `tensorrt_llm.llmapi.DFlashDecodingConfig` (the subset the embedded engine uses)."""

    max_draft_len: int | None = None
    speculative_model: str | None = None
    draft_len_schedule: dict[int, int] | None = None
    max_concurrency: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    tree_budget: int | str | None = None  # dflash-trt extension: DDTree nodes, 0/None = linear, "auto"
    decoding_type: str = field(default=DECODING_TYPE)

    @classmethod
    def from_any(cls, value: Any) -> DFlashDecodingConfig:
        """Accept a dict (YAML `speculative_config`), an instance, or any object with the fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            data = dict(value)
        else:
            data = {f.name: getattr(value, f.name) for f in fields(cls) if hasattr(value, f.name)}
        if "speculative_model_dir" in data:  # TensorRT-LLM's accepted alias
            data.setdefault("speculative_model", data.pop("speculative_model_dir"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"speculative_config.{unknown[0]}",
                data[unknown[0]],
                "is not a DFlashDecodingConfig field supported by the embedded engine",
                hint=f"supported: {', '.join(sorted(known))}",
            )
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self, *, block_size: int | None = None) -> None:
        if self.decoding_type != DECODING_TYPE:
            raise ConfigError(
                "speculative_config.decoding_type", self.decoding_type, "must be 'DFlash' in dflash-trt"
            )
        k = self.max_draft_len
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ConfigError(
                "speculative_config.max_draft_len",
                k,
                "must be an integer > 0",
                hint="set it to block_size - 1",
            )
        if block_size is not None and k > max_draft_len_for(block_size):
            most = max_draft_len_for(block_size)
            raise ConfigError(
                "speculative_config.max_draft_len",
                k,
                f"exceeds the drafter's block_size - 1 = {most}",
                hint=f"lower max_draft_len to at most {most}",
            )
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ConfigError(
                "speculative_config.max_concurrency",
                self.max_concurrency,
                "and draft_len_schedule are mutually exclusive",
                hint="keep one",
            )
        if self.max_concurrency is not None and (
            isinstance(self.max_concurrency, bool)
            or not isinstance(self.max_concurrency, int)
            or self.max_concurrency < 1
        ):
            raise ConfigError(
                "speculative_config.max_concurrency", self.max_concurrency, "must be an integer >= 1"
            )
        if self.draft_len_schedule is not None:
            sched = {int(a): int(b) for a, b in dict(self.draft_len_schedule).items()}
            if not sched:
                raise ConfigError("speculative_config.draft_len_schedule", sched, "must not be empty")
            for key, val in sched.items():
                if key < 1 or val < 0 or val > k:
                    raise ConfigError(
                        f"speculative_config.draft_len_schedule[{key}]",
                        val,
                        f"keys must be >= 1 and values in [0, max_draft_len={k}]",
                    )
            first = sched[min(sched)]
            if first != k:
                raise ConfigError(
                    f"speculative_config.draft_len_schedule[{min(sched)}]",
                    first,
                    f"the value at the smallest batch size must equal max_draft_len={k}",
                )
            self.draft_len_schedule = dict(sorted(sched.items()))
        if self.tree_budget is not None:
            self.tree_budget = parse_tree_budget(self.tree_budget)

    @property
    def uses_tree(self) -> bool:
        """True when rounds verify a DDTree (a fixed budget or "auto") rather than the argmax chain."""
        return self.tree_budget not in (None, 0)

    def schedule(self) -> dict[int, int] | None:
        assert self.max_draft_len is not None
        if self.draft_len_schedule is not None:
            return self.draft_len_schedule
        if self.max_concurrency is not None:
            return {self.max_concurrency: self.max_draft_len}
        return None

    def draft_len_for(self, batch_size: int) -> int:
        """Draft length for `batch_size` running requests (0 = speculation off)."""
        assert self.max_draft_len is not None
        sched = self.schedule()
        if sched is None:
            return self.max_draft_len
        for threshold, draft_len in sched.items():
            if batch_size <= threshold:
                return draft_len
        return 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"decoding_type": self.decoding_type, "max_draft_len": self.max_draft_len}
        for name in (
            "speculative_model",
            "draft_len_schedule",
            "max_concurrency",
            "mask_token_id",
            "target_layer_ids",
            "tree_budget",
        ):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out
