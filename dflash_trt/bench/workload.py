# SPDX-License-Identifier: Apache-2.0
"""Workloads: prompts with exact input token counts, prepared before the timed phase.

- **Synthetic**: random in-vocabulary token ids, decoded to text and re-encoded until the
  prompt (after the chat template, when one is used) is exactly the requested number of tokens
  for the model's tokenizer. Random prompts make drafters guess badly: such runs are labelled
  `sd_realistic: false` in summary.json.
- **JSONL**: one object per line with `prompt` (or `text`) or `messages`, and optionally
  `output_tokens` (or `max_tokens`, `osl`).
- **Chat**: `--chat` wraps each prompt in the tokenizer's chat template (thinking off unless
  `--thinking`); `openai-chat` always sends messages and counts the templated prompt.
- **Shared system prompt** (`--system-prompt-tokens N`): every chat starts with the same system message
  of about N tokens (random in-vocabulary tokens, seeded), so a prefix cache can serve it; with `--isl`
  the whole templated prompt, system included, is still exactly ISL tokens.
- **Multi-turn** (`--turns T`): requests come in conversations of T; turn k resends turns 0..k-1 (each
  user message, then a synthetic assistant reply of OSL tokens) and adds its own user message (of ISL
  tokens with `--isl`, else the next dataset prompt). A conversation's turns are sent one after another.

Token counts: a plain prompt is counted as the server would tokenise it (special tokens such as
BOS added); a chat-templated prompt is counted without adding special tokens again.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError, UsageError
from dflash_trt.utils.io import file_sha256
from dflash_trt.utils.jsonl import iter_jsonl

_MAX_FIT_ITERS = 40
_MAX_FIT_RESTARTS = 8


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prepared request body's content."""

    index: int
    text: str | None  # what completion-style endpoints get (chat template applied when --chat)
    messages: tuple[dict[str, str], ...] | None  # what openai-chat gets
    input_tokens: int | None  # the client's count (None without a tokenizer)
    output_tokens: int  # max tokens requested


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    isl: int | None = None
    osl: int | None = None
    range_ratio: float = 1.0  # per-request ISL/OSL drawn uniformly from [ratio * n, n]
    dataset: str | None = None
    chat: bool = False
    thinking: bool = False
    seed: int = 0
    system_prompt_tokens: int | None = None
    turns: int = 1

    def describe(self, tokenizer_name: str | None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": "jsonl" if self.dataset else "synthetic",
            "isl": self.isl,
            "osl": self.osl,
            "range_ratio": self.range_ratio,
            "dataset": self.dataset,
            "chat_template": self.chat,
            "thinking": self.thinking if self.chat else None,
            "seed": self.seed,
            "tokenizer": tokenizer_name,
            "system_prompt_tokens": self.system_prompt_tokens,
            "turns": self.turns,
        }
        if self.dataset:
            d["dataset_sha256"] = file_sha256(Path(self.dataset))
            d["sd_realistic"] = None  # depends on the prompts
        else:
            d["sd_realistic"] = False  # random token ids: acceptance is unrepresentative
        return d


def load_tokenizer(name_or_dir: str) -> Any:
    """A Hugging Face tokenizer by hub name or directory; a packaged pair's name (`tiny`, `smollm2-135m`)
    or a .gguf file gives its target's."""
    from dflash_trt import pairs

    name_or_dir = str(pairs.resolve_target_path(name_or_dir) or name_or_dir)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is in the torch extra
        raise UsageError(
            "--tokenizer needs the `transformers` package", hint="pip install 'dflash-trt[torch]'"
        ) from exc
    try:
        return AutoTokenizer.from_pretrained(name_or_dir)
    except Exception as exc:
        raise UsageError(
            f"--tokenizer={name_or_dir!r}: cannot load a tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            hint="pass a local tokenizer directory or a Hugging Face model name that is reachable",
        ) from exc


def _content_ids(tokenizer: Any) -> list[int]:
    """Non-special ids that survive decode -> encode on their own (no partial UTF-8 pieces).

    Sampling only these makes the decode/encode fitting loop converge quickly.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode(
        [[i] for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    clean = [i for i, t, e in zip(ids, texts, encoded) if t and "\ufffd" not in t and list(e) == [i]]
    if not clean:
        raise UsageError(
            "the tokenizer has no token that round-trips through decode/encode",
            hint="pass a real --tokenizer",
        )
    return clean


class PromptSource:
    """Deterministic prompt i for every i (same seed, same prompts: DFlash and AR see one workload)."""

    def __init__(self, spec: WorkloadSpec, tokenizer: Any | None, *, protocol: str) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.chat = (
            spec.chat or protocol == "openai-chat" or spec.turns > 1 or bool(spec.system_prompt_tokens)
        )
        self.send_messages = protocol == "openai-chat"
        self._cache: dict[tuple[str, int], Prompt] = {}
        self._records: list[dict[str, Any]] | None = None
        self._vocab: list[int] | None = None
        self._system: list[dict[str, str]] | None = None
        if (spec.turns > 1 or spec.system_prompt_tokens) and tokenizer is None:
            raise UsageError("--turns and --system-prompt-tokens need --tokenizer (they build chats)",
                             hint="pass --tokenizer of the served model")  # fmt: skip
        if spec.dataset is not None:
            self._records = _read_jsonl(Path(spec.dataset))
        elif tokenizer is None:
            raise UsageError(
                "synthetic prompts (--isl) need --tokenizer", hint="pass --tokenizer NAME_OR_DIR"
            )
        if self.chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                "--chat (or --protocol openai-chat) needs a tokenizer with a chat template, and this one has none",
                hint="pass --tokenizer of the served model (its tokenizer_config.json has chat_template), or drop --chat",
            )

    # ------------------------------------------------------------------ counting
    def _render(self, content: str) -> str:
        if not self.chat:
            return content
        return self._render_messages([*self._head(), {"role": "user", "content": content}])

    def _head(self) -> list[dict[str, str]]:
        """The shared system message every chat starts with ([] without --system-prompt-tokens)."""
        if self._system is None:
            n = self.spec.system_prompt_tokens
            rng = random.Random(f"dflash-trt-bench:{self.spec.seed}:system")
            self._system = [{"role": "system", "content": self._text(n, rng)}] if n else []
        return self._system

    def _text(self, n: int, rng: random.Random) -> str:
        """About n tokens of random in-vocabulary text (exact lengths are `fit`'s)."""
        assert self.tokenizer is not None
        if self._vocab is None:
            self._vocab = _content_ids(self.tokenizer)
        ids = rng.choices(self._vocab, k=n)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _render_messages(self, messages: list[dict[str, str]]) -> str:
        assert self.tokenizer is not None
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=self.spec.thinking
            )
        )

    def count(self, text: str) -> int:
        """Tokens of the prompt as the server sees it (see the module docstring)."""
        assert self.tokenizer is not None
        return len(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])

    # ------------------------------------------------------------------ prompts
    def get(self, i: int, *, stream: str = "") -> Prompt:
        """Prompt i of a named stream (each stream is its own deterministic sequence)."""
        p = self._cache.get((stream, i))
        if p is None:
            if self.spec.turns > 1:
                p = self._turn(i, stream)
            elif self._records is not None:
                p = self._records_prompt(i, stream)
            else:
                p = self._synthetic(i, stream)
            self._cache[(stream, i)] = p
        return p

    def _turn(self, i: int, stream: str) -> Prompt:
        """Turn i % T of conversation i // T: the turns before it (user, then a synthetic assistant reply
        of OSL tokens), then its own user message."""
        turns, c = self.spec.turns, i // self.spec.turns
        messages = list(self._head())
        osl = self.spec.osl
        for j in range(c * turns, i + 1):
            rng = random.Random(f"dflash-trt-bench:{self.spec.seed}:{stream}:turn:{j}")
            if self._records is not None:
                rec = self._records[j % len(self._records)]
                user = str(rec.get("prompt", rec.get("text", "")))
                osl = osl or rec.get("output_tokens", rec.get("max_tokens", rec.get("osl")))
            else:
                user = self._text(self.spec.isl or 1, rng)
            messages.append({"role": "user", "content": user})
            if j < i:
                messages.append({"role": "assistant", "content": self._text(self.spec.osl or 64, rng)})
        text = self._render_messages(messages)
        return Prompt(index=i, text=text, messages=tuple(messages) if self.send_messages else None,
                      input_tokens=self.count(text), output_tokens=int(osl or 64))  # fmt: skip

    def _lengths(self, rng: random.Random) -> tuple[int | None, int | None]:
        def draw(n: int | None) -> int | None:
            if n is None or self.spec.range_ratio >= 1.0:
                return n
            return rng.randint(max(1, math.ceil(self.spec.range_ratio * n)), n)

        return draw(self.spec.isl), draw(self.spec.osl)

    def _synthetic(self, i: int, stream: str) -> Prompt:
        rng = random.Random(f"dflash-trt-bench:{self.spec.seed}:{stream}:{i}")
        isl, osl = self._lengths(rng)
        assert isl is not None and osl is not None
        content = self.fit(isl, rng)
        text = self._render(content)
        messages = (*self._head(), {"role": "user", "content": content}) if self.send_messages else None
        return Prompt(index=i, text=text, messages=messages, input_tokens=isl, output_tokens=osl)

    def fit(self, n: int, rng: random.Random) -> str:
        """Content whose rendered prompt is exactly n tokens (decode/encode until it holds)."""
        tok = self.tokenizer
        assert tok is not None
        if self._vocab is None:
            self._vocab = _content_ids(tok)
        overhead = self.count(self._render(""))
        if n <= overhead:
            raise UsageError(
                f"--isl={n}: the prompt template alone takes {overhead} tokens",
                hint=f"pass --isl larger than {overhead}",
            )
        for _ in range(_MAX_FIT_RESTARTS):
            ids = rng.choices(self._vocab, k=n - overhead)
            for _ in range(_MAX_FIT_ITERS):
                content = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                diff = n - self.count(self._render(content))
                if diff == 0:
                    return content
                ids = list(tok(content, add_special_tokens=False)["input_ids"])
                if diff > 0:
                    ids += rng.choices(self._vocab, k=diff)
                else:
                    ids = ids[: max(0, len(ids) + diff)]
        raise DFlashTrtError(
            f"could not build a prompt of exactly {n} tokens with this tokenizer",
            hint="use a --dataset of real prompts, or another --isl",
        )

    def _records_prompt(self, i: int, stream: str) -> Prompt:
        assert self._records is not None
        # each stream starts at its own deterministic offset into the file
        offset = (
            int(hashlib.sha256(f"{self.spec.seed}:{stream}".encode()).hexdigest()[:8], 16) if stream else 0
        )
        rec = self._records[(offset + i) % len(self._records)]
        osl = self.spec.osl
        if osl is None:
            osl = rec.get("output_tokens", rec.get("max_tokens", rec.get("osl")))
        if osl is None:
            raise UsageError(
                f"--dataset={self.spec.dataset}: line {rec['_line']} has no output_tokens and --osl is not set",
                hint="pass --osl N, or add output_tokens to every line",
            )
        if self.spec.osl is not None and self.spec.range_ratio < 1.0:
            _, osl = self._lengths(random.Random(f"dflash-trt-bench:{self.spec.seed}:{stream}:{i}"))
        messages: list[dict[str, str]] | None = rec.get("messages")
        prompt: str | None = rec.get("prompt", rec.get("text"))
        if messages is None:
            assert prompt is not None
            if self.chat:
                messages = [{"role": "user", "content": prompt}]
        if messages is not None and self.spec.system_prompt_tokens:
            messages = [*self._head(), *messages]
        if messages is not None:
            if self.tokenizer is None:
                if not self.send_messages:
                    raise UsageError(
                        f"--dataset={self.spec.dataset}: chat messages need --tokenizer to apply the chat template",
                        hint="pass --tokenizer, or use --protocol openai-chat",
                    )
                text = None
            else:
                text = self._render_messages(messages)
        else:
            text = prompt
        count = self.count(text) if (self.tokenizer is not None and text is not None) else None
        return Prompt(
            index=i,
            text=text,
            messages=tuple(messages) if (messages is not None and self.send_messages) else None,
            input_tokens=count,
            output_tokens=int(osl or 0),
        )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UsageError(f"--dataset={path}: no such file", hint="pass a JSONL file of prompts")
    records: list[dict[str, Any]] = []
    for lineno, rec in iter_jsonl(path, name=f"--dataset={path}", hint="one JSON object per line"):
        if not isinstance(rec, dict) or not (
            isinstance(rec.get("prompt", rec.get("text")), str) or isinstance(rec.get("messages"), list)
        ):
            raise UsageError(
                f"--dataset={path}: line {lineno} has neither a string `prompt`/`text` nor a `messages` list",
                hint='each line looks like {"prompt": "...", "output_tokens": 256}',
            )
        rec["_line"] = lineno
        records.append(rec)
    if not records:
        raise UsageError(f"--dataset={path}: the file holds no prompts", hint="add one JSON object per line")
    return records
