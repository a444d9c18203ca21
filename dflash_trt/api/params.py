# SPDX-License-Identifier: Apache-2.0
"""LLM-API parameters with TensorRT-LLM's names: SamplingParams, KvCacheConfig, CudaGraphConfig."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.engine.request import DEFAULT_MAX_TOKENS
from dflash_trt.errors import ConfigError, RequestError


@dataclass
class GuidedDecodingParams:
    """TensorRT-LLM's guided decoding: at most one of `json` (a JSON schema: a dict or its text; a
    boolean true or {} means any JSON value), `regex`, `grammar` (xgrammar's EBNF), `json_object`
    (any JSON object) and `structural_tag` (xgrammar's structural tag, as JSON text). Every generated
    token is masked to what the guide still allows (engine/grammar.py); with DFlash the drafts are
    masked too and the target's distribution at each verified position, so output is distributed as
    plain constrained decoding's."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def guide(self) -> tuple[str, str]:
        """(guide type, guide text) in engine/request.py GUIDE_TYPES terms; RequestError naming `guided_decoding` unless
        exactly one guide is set."""
        import json as _json

        set_ = [(k, v) for k, v in (("json_schema", self.json), ("regex", self.regex),
                                    ("ebnf_grammar", self.grammar), ("structural_tag", self.structural_tag))
                if v is not None]  # fmt: skip
        if self.json_object:
            set_.append(("json", ""))
        if len(set_) != 1:
            names = [k for k, _ in set_] or ["none"]
            raise RequestError(f"guided_decoding sets {', '.join(names)}: exactly one guide is needed",
                               field="guided_decoding", hint="set one of json, regex, grammar, json_object, structural_tag")  # fmt: skip
        kind, value = set_[0]
        if kind == "json_schema" and not isinstance(value, str):
            value = _json.dumps(value)
        if not isinstance(value, str):
            raise RequestError(f"guided_decoding.{kind}={value!r} must be text", field="guided_decoding",
                               hint="send the guide as a string")  # fmt: skip
        return kind, value


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request parameters, with TensorRT-LLM's names and defaults.

    temperature/top_k/top_p all None means greedy (TensorRT-LLM's rule); temperature 0 is greedy.
    `stop` strings are excluded from the text unless include_stop_str_in_output. `ignore_eos`
    ignores the end id but keeps explicit stop_token_ids. `min_tokens` defers stopping (it does not
    mask the end token's probability: output stays distributed as the target's).
    `greedy_draft` (dflash-trt extension): at T > 0 propose greedy drafts (one-hot rule): the drafter's
    argmax, or a DFlash 2 selector's best-scoring candidate.
    `pad_id` is refused: outputs are never padded (each request's tokens come back at their own length).
    `n` sequences are sampled from one prefill of the prompt, each keyed by its own seed (sequence 0 by
    `seed` itself); `best_of` >= n runs that many and returns the n with the highest cumulative
    log-probability (not with streaming: the best are known only at the end).
    `frequency_penalty`, `presence_penalty`, `repetition_penalty`, `logit_bias` (token id -> bias) and
    `min_p` change the target's distribution as spec/penalties.py says, with DFlash as without it.
    `logprobs` = k returns each output token's log-probability and rank with the k most likely tokens'
    (k in [0, 20]; the distribution after penalties and bias, before temperature/top-k/top-p): the
    verify pass's distribution for accepted drafts and the bonus token, equal to plain decoding's.
    `prompt_logprobs` = k scores the prompt: each prompt token's log-probability and rank with the k most
    likely tokens' at its position (the target's raw distribution), in CompletionOutput.prompt_logprobs;
    with it, max_tokens may be 0 (score only, as lm-eval's loglikelihood requests do).
    `bad` (strings, each tokenized alone) and `bad_token_ids` are never generated: a word's last token is
    banned wherever the sequence ends with its others (spec/penalties.py; with DFlash as without).
    `guided_decoding` (GuidedDecodingParams) constrains the output to a JSON schema, regex or grammar.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    min_tokens: int | None = None
    n: int = 1
    best_of: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    greedy_draft: bool = False
    guided_decoding: GuidedDecodingParams | None = None

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine runs: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    def check_supported(self, *, streaming: bool = False) -> None:
        """Refuse what the embedded engine does not implement (padding, streamed best_of) and what does
        not fit together (best_of < n). Every other field is validated by the engine when the request
        is added."""
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n={self.n!r} must be an integer >= 1", field="n", hint="send n >= 1")
        best = self.best_of
        if best is not None and (isinstance(best, bool) or not isinstance(best, int) or best < self.n):
            raise RequestError(f"best_of={best!r} must be an integer >= n={self.n}", field="best_of",
                               hint="send best_of >= n, or omit it")  # fmt: skip
        if streaming and best is not None and best > self.n:
            raise RequestError(
                f"best_of={best} > n={self.n} cannot stream: the best sequences are known only when all end",
                field="best_of",
                hint="omit best_of, or do not stream",
            )
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias={self.logit_bias!r} must map token ids to biases", field="logit_bias",
                               hint="send a dict such as {50256: -100}")  # fmt: skip
        if self.pad_id is not None:
            raise RequestError(
                f"pad_id={self.pad_id!r}: the embedded engine never pads outputs (each request's tokens "
                "come back at their own length)",
                field="pad_id",
                hint="omit pad_id",
            )


@dataclass
class KvCacheConfig:
    """Mirror of the KV-cache fields the embedded engine honours."""

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool | None = None  # prefix caching (engine/prefix_cache.py): on unless false
    dtype: str = "auto"


@dataclass
class CudaGraphConfig:
    """TensorRT-LLM's CUDA-graph settings, as the embedded engine honours them.

    The engine runs every decode round in the graph of the smallest captured batch size that holds
    the batch (padding the rest), so no batch runs outside a graph: `enable_padding` must stay true,
    and graphs go up to the LLM's max_batch_size (a smaller `max_batch_size` here is refused).
    `batch_sizes` sets the capture ladder (max_batch_size is appended); None keeps the engine's.
    """

    batch_sizes: list[int] | None = None
    max_batch_size: int | None = None  # None or 0 (TensorRT-LLM's default): the LLM's max_batch_size
    enable_padding: bool = True

    def graph_batch_sizes(self, llm_max_batch_size: int) -> tuple[int, ...] | None:
        """The batch sizes to capture (None: the engine's default ladder), or ConfigError for a
        setting the engine cannot honour."""
        if self.enable_padding is not True:
            raise ConfigError(
                "cuda_graph_config.enable_padding",
                self.enable_padding,
                "the embedded engine always pads a batch up to the next captured size",
                hint="omit enable_padding or pass true",
            )
        sizes = sorted(set(self.batch_sizes)) if self.batch_sizes else None
        if sizes and any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(
                "cuda_graph_config.batch_sizes",
                self.batch_sizes,
                "must be integers >= 1",
                hint="e.g. [1, 2, 4, 8]",
            )
        top = self.max_batch_size or None
        if top is None:
            return tuple(sizes) if sizes else None
        if sizes and top != sizes[-1]:
            raise ConfigError(
                "cuda_graph_config.max_batch_size",
                top,
                f"differs from max(batch_sizes)={sizes[-1]}",
                hint="set one of the two (TensorRT-LLM's rule)",
            )
        if isinstance(top, bool) or not isinstance(top, int) or top < llm_max_batch_size:
            raise ConfigError(
                "cuda_graph_config.max_batch_size",
                top,
                f"is below max_batch_size={llm_max_batch_size}: the embedded engine runs every batch in a "
                "captured graph, so it captures up to max_batch_size",
                hint=f"omit it, or set it to {llm_max_batch_size} or more",
            )
        return tuple(sizes) if sizes else None
