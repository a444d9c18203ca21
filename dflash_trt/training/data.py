# SPDX-License-Identifier: Apache-2.0
"""Training data for `train-drafter`: records, tokenisation, loss masks, the held-out split.

Inputs (`--data`):
  *.jsonl / *.json   one JSON object per line: {"messages": [{"role", "content"}, ...]} (chat:
                     loss on assistant turns, rendered with the tokenizer's chat template) or
                     {"text": "..."} (loss on every token).
  any other file     one text document (loss on every token).
  a directory        every file below it, recursively, in sorted order (hidden files skipped;
                     files that are not UTF-8 are skipped with a warning).
Text documents are tokenised (end-of-text appended) and cut into `seq_len` windows; chat samples
are truncated to `seq_len`. Nothing is packed across documents: the target would see the
neighbouring document as context, which inference never does.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import UsageError
from dflash_trt.models.sources import chat_prompt_ids
from dflash_trt.utils.jsonl import iter_jsonl

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Record:
    """One input document: chat messages or plain text."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    source: str = ""  # file[:line], for error messages


@dataclass
class Sample:
    """One training sequence."""

    input_ids: list[int]  # [S_i <= seq_len]
    loss_mask: list[int]  # [S_i]: 1 where the drafter is trained (anchors and labels)
    prompt_ids: list[int] = field(default_factory=list)  # what the target is prompted with (regeneration)
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "source": self.source}


def _iter_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            yield path


def _jsonl_records(path: Path) -> Iterator[Record]:
    name = f"--data={str(path)!r}"
    hint = 'write one object per line: {"messages": [...]} or {"text": "..."}'
    for lineno, obj in iter_jsonl(path, name=name, hint=hint):
        where = f"{path}:{lineno}"
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            msgs = obj["messages"]
            if not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            ):
                raise UsageError(
                    f"{name}: line {lineno}: every message needs string 'role' and 'content'",
                    hint='e.g. {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}',
                )
            yield Record(
                messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs), source=where
            )
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            yield Record(text=obj["text"], source=where)
        else:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise UsageError(
                f"{name}: line {lineno} has neither 'messages' (a list) nor 'text' (a string): {keys}",
                hint='write {"messages": [{"role": ..., "content": ...}, ...]} or {"text": "..."} per line',
            )


def load_records(data: str | Path) -> list[Record]:
    """Read `--data` (a JSONL file, a text file or a directory) into records."""
    root = Path(data).expanduser()
    if not root.exists():
        raise UsageError(
            f"--data={str(data)!r} does not exist", hint="pass a JSONL file, a text file or a directory"
        )
    files = list(_iter_files(root)) if root.is_dir() else [root]
    records: list[Record] = []
    skipped = 0
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            records.extend(_jsonl_records(path))
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if text.strip():
            records.append(Record(text=text, source=str(path)))
    if skipped:
        log.warning("--data: skipped %d file(s) that are not UTF-8 text", skipped)
    if not records:
        raise UsageError(
            f"--data={str(data)!r} holds no usable records", hint="check the path and the file format"
        )
    return records


def require_chat_template(tokenizer: Any, source: str) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f"chat record {source} needs the target tokenizer's chat template, and it has none",
            hint='use {"text": ...} records, or save a tokenizer with a chat_template into the target directory',
        )


def tokenize_chat(tokenizer: Any, record: Record, *, seq_len: int) -> Sample | None:
    """Loss on the assistant turns: each assistant message's tokens are the difference between the
    template rendered through it and the template rendered up to its generation prompt."""
    assert record.messages is not None
    require_chat_template(tokenizer, record.source)
    msgs = list(record.messages)
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = chat_prompt_ids(tokenizer, msgs[:i])
        full = chat_prompt_ids(tokenizer, msgs[: i + 1], generation_prompt=False)
        if full[: len(prefix)] != prefix or full[: len(ids)] != ids or len(prefix) < len(ids):
            raise UsageError(
                f"{record.source}: the chat template does not render turn {i} as a continuation of the "
                "earlier turns, so the assistant tokens cannot be located",
                hint="use a template whose rendering of a conversation extends the rendering of its prefix",
            )
        mask.extend([0] * (len(prefix) - len(ids)))
        mask.extend([1] * (len(full) - len(prefix)))
        ids = full
    if not ids:
        return None
    return Sample(input_ids=ids[:seq_len], loss_mask=mask[:seq_len], source=record.source)


def tokenize_text(tokenizer: Any, record: Record, *, seq_len: int, eos_id: int | None) -> list[Sample]:
    """A text document as consecutive `seq_len` windows, loss on every token."""
    assert record.text is not None
    ids = list(tokenizer(record.text, add_special_tokens=False)["input_ids"])
    if eos_id is not None:
        ids.append(eos_id)
    return [
        Sample(
            input_ids=ids[i : i + seq_len], loss_mask=[1] * len(ids[i : i + seq_len]), source=record.source
        )
        for i in range(0, len(ids), seq_len)
    ]


def build_samples(
    records: Sequence[Record], tokenizer: Any, *, seq_len: int, eos_id: int | None, min_len: int
) -> list[Sample]:
    samples: list[Sample] = []
    for rec in records:
        if rec.messages is not None:
            s = tokenize_chat(tokenizer, rec, seq_len=seq_len)
            out = [s] if s is not None else []
        else:
            out = tokenize_text(tokenizer, rec, seq_len=seq_len, eos_id=eos_id)
        samples.extend(s for s in out if len(s.input_ids) >= min_len and any(s.loss_mask))
    return samples


def split_heldout(
    records: Sequence[Record], *, num_heldout: int, seed: int
) -> tuple[list[Record], list[Record]]:
    """Shuffle records (seeded) and hold out `num_heldout` of them, never trained on. With too few
    records to spare (fewer than 2 * num_heldout), nothing is held out here (see `split_samples`)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    if num_heldout <= 0 or len(records) < 2 * num_heldout:
        return [records[i] for i in order], []
    keep = sorted(order[:-num_heldout])
    held = sorted(order[-num_heldout:])
    return [records[i] for i in keep], [records[i] for i in held]


def eval_prompt_ids(
    tokenizer: Any, record: Record, *, max_len: int, text_prefix: int | None
) -> list[int] | None:
    """A held-out record as a prompt: chat -> the conversation before its last assistant turn, with
    the generation prompt; text -> its first `text_prefix` tokens (all of it when None), at most
    `max_len` tokens either way (the tail is kept)."""
    if record.messages is not None:
        require_chat_template(tokenizer, record.source)
        msgs = list(record.messages)
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
        ids = chat_prompt_ids(tokenizer, msgs[:last])
    else:
        assert record.text is not None
        ids = list(tokenizer(record.text, add_special_tokens=False)["input_ids"])
        if text_prefix is not None:
            ids = ids[:text_prefix]
    ids = ids[-max_len:]
    return ids or None
