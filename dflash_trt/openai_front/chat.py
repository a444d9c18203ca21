# SPDX-License-Identifier: Apache-2.0
"""The bundle tokenizer's chat template: messages -> the prompt text the Triton model receives.

The model tokenises text prompts without adding special tokens again, so the rendered template
(which carries its own BOS / role markers) reaches the engine exactly as `dflash-trt generate
--chat` builds it. The template's text also tells how its model writes reasoning and tool calls
(`parsers.OutputFormat`): a template that takes `tools` gets them (apply_chat_template's `tools`),
any other gets the conversation in the Hermes convention (tool_prompt.hermes_messages). The tokenizer is used for nothing else but counting the rendered prompt when a
chat request leaves out max_tokens (the default is what the context leaves).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from dflash_trt.bundle import bundle_path
from dflash_trt.errors import UsageError
from dflash_trt.openai_front.parsers import OutputFormat
from dflash_trt.openai_front.protocol import OpenAIError
from dflash_trt.openai_front.tool_prompt import hermes_messages


def tokenizer_source(bundle: Path, manifest: dict[str, Any]) -> str:
    """The tokenizer the bundle serves with: the LLM-API `tokenizer` (else `model`), a directory
    relative to the bundle root or a Hugging Face id."""
    llm_api = bundle_path(bundle, manifest, "llm_api")
    try:
        args = yaml.safe_load(llm_api.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(
            f"{llm_api}: cannot read the LLM-API arguments ({exc})", hint="rebuild the bundle"
        ) from exc
    ref = args.get("tokenizer") or args.get("model")
    if not isinstance(ref, str) or not ref:
        raise UsageError(f"{llm_api}: names no tokenizer or model", hint="rebuild the bundle")
    local = Path(ref) if Path(ref).is_absolute() else bundle / ref
    return str(local) if local.is_dir() else ref


class ChatTemplate:
    def __init__(self, tokenizer: Any, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        template = getattr(tokenizer, "chat_template", None)
        self.available = bool(template)
        text = "\n".join(template.values()) if isinstance(template, dict) else template
        self.format = OutputFormat.of(text if isinstance(text, str) else None)

    @classmethod
    def load(cls, source: str) -> ChatTemplate:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers is in the torch extra
            raise UsageError(
                "the OpenAI front needs `transformers` for the chat template",
                hint="pip install 'dflash-trt[torch]'",
            ) from exc
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise UsageError(
                f"tokenizer={source!r}: cannot load it for the chat template ({type(exc).__name__}: {first})",
                hint="make the bundle's tokenizer reachable (HF_HOME / network), or run without --openai-port",
            ) from exc
        chat = cls(tok, source)
        if chat.available:  # compile the template now, not on the first request
            with contextlib.suppress(OpenAIError):
                chat.render([{"role": "user", "content": "warm-up"}], {})
        return chat

    def render(
        self,
        messages: list[dict[str, Any]],
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; `tools`: the functions offered ({name, description, parameters})."""
        if not self.available:
            raise OpenAIError(
                f"the served model's tokenizer ({self.source}) has no chat template; fix: use /v1/completions, "
                "or build the bundle from a tokenizer whose tokenizer_config.json has a chat_template",
                param="messages",
                code="chat_template_missing",
            )
        extra: dict[str, Any] = {}
        if self.format.renders_tools:
            if tools:
                extra["tools"] = [{"type": "function", "function": f} for f in tools]
        elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = hermes_messages(messages, tools or [])
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                **{"enable_thinking": False, **kwargs},
                **extra,
            )
        except Exception as exc:  # jinja's raise_exception (e.g. "roles must alternate") or a bad kwarg
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise OpenAIError(
                f"messages: the chat template refused them ({first}); fix: send messages the model's template accepts",
                param="messages",
            ) from None
        if not isinstance(text, str) or not text:
            raise OpenAIError("messages: the chat template rendered nothing; fix: send non-empty messages",
                              param="messages")  # fmt: skip
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
