# SPDX-License-Identifier: Apache-2.0
"""The one place a request is checked: prompt ids, lengths against max_seq_len and the KV cache,
sampling ranges, min_tokens and seed, stop ids and strings, the number of sequences. A request that
passes becomes the engine's `Request` (stop ids resolved, a seed drawn when none was given, a
detokenizer when the model has a tokenizer), with n > 1 the leader of n (`sequence_seed` keys each
sequence's randomness). Every refusal is a RequestError naming the field, the value and the fix.
Thread-safe: it reads only what is fixed once the engine is built.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash_trt.engine.config import PAGE_SIZE, EngineConfig
from dflash_trt.engine.request import Request, RequestParams
from dflash_trt.engine.round import MAX_LOGPROBS
from dflash_trt.errors import ConfigError, RequestError
from dflash_trt.spec.penalties import validate_bad_words, validate_penalties
from dflash_trt.spec.prompt import check_prompt_ids
from dflash_trt.spec.sampling import validate_sampling

if TYPE_CHECKING:
    from dflash_trt.engine.grammar import GrammarCompiler


class Admission:
    def __init__(self, config: EngineConfig, *, vocab_size: int, eos_token_ids: tuple[int, ...], tokenizer: Any,
                 kv_pages: int, pages_needed: Callable[[int, int], int], scratch_tokens: int) -> None:  # fmt: skip
        """kv_pages: the KV cache's pages; pages_needed(prompt_len, max_tokens): the pages a request
        reserves (the scheduler's rule), scratch_tokens of them a DDTree's scratch."""
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.kv_pages = kv_pages
        self.pages_needed = pages_needed
        self.scratch_tokens = scratch_tokens
        self._grammars: GrammarCompiler | None = None  # made for the first guided request
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()

    def admit(self, prompt_ids: list[int], params: RequestParams, *, owner: Any = None) -> Request:
        """The checked request. `owner` is stored on it untouched (the LLM API keeps its handle there)."""
        check_prompt_ids(prompt_ids, self.vocab_size)
        self._check_lengths(len(prompt_ids), params.max_tokens, scoring=params.prompt_logprobs is not None)
        self._check_sampling(params)
        self._check_sequences(params.n, self.pages_needed(len(prompt_ids), params.max_tokens))
        compiled = self._compile_guide(params)
        leader = self.make_request(prompt_ids, params, owner=owner)
        leader.siblings = [
            self.make_request(prompt_ids, params, owner=owner, index=i, seed=sequence_seed(leader.seed, i))
            for i in range(1, params.n)
        ]  # fmt: skip
        if compiled is not None:
            assert self._grammars is not None
            for member in leader.group:
                member.guide = self._grammars.guide(compiled)
        return leader

    def _compile_guide(self, params: RequestParams) -> Any:
        """A guided request's compiled grammar (None for a free one), from the engine's compiler (made
        for the first guided request: loading xgrammar costs ~1 s)."""
        if params.guide is None:
            return None
        if self.config.guided_decoding_backend is None:
            raise RequestError("guided_decoding: this engine runs without a guided-decoding backend",
                               field="guided_decoding", hint="start the LLM with guided_decoding_backend='xgrammar'")  # fmt: skip
        if self.tokenizer is None:
            raise RequestError("guided_decoding needs a tokenizer, and this model has none",
                               field="guided_decoding", hint="serve a model with a tokenizer")  # fmt: skip
        for name, off in (("ignore_eos", False), ("min_tokens", 0)):
            if getattr(params, name) != off:
                raise RequestError(f"{name}={getattr(params, name)!r}: a guided request ends where its guide does",
                                   field=name, hint=f"omit {name} with guided decoding")  # fmt: skip
        if params.end_id is not None and params.end_id not in self.eos_token_ids:
            raise RequestError(f"end_id={params.end_id}: a guide ends at the model's end ids {list(self.eos_token_ids)}",
                               field="end_id", hint="omit end_id with guided decoding")  # fmt: skip
        with self._grammar_lock:
            if self._grammars is None:
                from dflash_trt.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        kind, text = params.guide
        return self._grammars.compile(kind, text)

    def _check_sequences(self, n: Any, pages: int) -> None:
        """n sequences run side by side: each holds a batch row and its own pages from the start."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"n={n!r} must be an integer >= 1", field="n", hint="send n >= 1")
        rows = self.config.max_batch_size
        if n > rows:
            raise RequestError(f"n={n}: more sequences than the engine's max_batch_size={rows}", field="n",
                               hint=f"send n <= {rows}, or raise max_batch_size")  # fmt: skip
        if n * pages > self.kv_pages:
            raise RequestError(
                f"n={n}: {n} sequences need {n * pages * PAGE_SIZE} KV tokens but the whole cache holds "
                f"{self.kv_pages * PAGE_SIZE}",
                field="n",
                hint="lower n or max_tokens, or raise kv_cache_config.max_tokens",
            )

    def _check_lengths(self, n: int, max_tokens: Any, *, scoring: bool = False) -> None:
        """max_tokens against the prompt's `n` tokens, max_seq_len and the KV cache (0 only to score
        the prompt: prompt_logprobs)."""
        least = 0 if scoring else 1
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
            raise RequestError(f"max_tokens={max_tokens!r} must be an integer >= 1", field="max_tokens",
                               hint="send max_tokens >= 1 (0 only with prompt_logprobs)")  # fmt: skip
        limit = self.config.max_seq_len
        if n >= limit:
            raise RequestError(f"prompt has {n} tokens, not below max_seq_len={limit}", field="prompt",
                               hint="shorten the prompt or raise max_seq_len")  # fmt: skip
        if n + max_tokens > limit:
            raise RequestError(
                f"max_tokens={max_tokens}: prompt ({n} tokens) + max_tokens exceeds max_seq_len={limit}",
                field="max_tokens",
                hint=f"use max_tokens <= {limit - n}",
            )
        need = self.pages_needed(n, max_tokens)
        if need > self.kv_pages:
            scratch = self.scratch_tokens
            raise RequestError(
                f"request needs {need * PAGE_SIZE} KV tokens (prompt {n} + max_tokens {max_tokens}"
                + (f" + DDTree scratch {scratch}" if scratch else "")
                + f") but the whole cache holds {self.kv_pages * PAGE_SIZE}",
                field="max_tokens",
                hint="lower max_tokens or raise kv_cache_config.max_tokens",
            )

    def _check_sampling(self, params: RequestParams) -> None:
        """Sampling ranges, min_tokens and seed, stop ids against the vocabulary, stop strings."""
        try:
            validate_sampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            validate_penalties(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                               repetition_penalty=params.repetition_penalty, min_p=params.min_p,
                               logit_bias=params.logit_bias, vocab_size=self.vocab_size)  # fmt: skip
            validate_bad_words(params.bad_words, self.vocab_size)
        except ConfigError as exc:
            raise RequestError(exc.message, field=exc.field, hint=exc.hint) from None
        for name in ("min_tokens", "seed"):
            value = getattr(params, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise RequestError(
                    f"{name}={value!r} must be an integer >= 0", field=name, hint=f"send {name} >= 0"
                )
        for i, tok in enumerate(params.stop_token_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise RequestError(
                    f"stop_token_ids[{i}]={tok!r}: out of range for vocab_size={self.vocab_size}",
                    field="stop_token_ids",
                    hint=f"use token ids in [0, {self.vocab_size})",
                )
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(params, name)
            if lp is not None and (
                isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS
            ):
                raise RequestError(f"{name}={lp!r} must be an integer in [0, {MAX_LOGPROBS}]", field=name,
                                   hint=f"send 0 (the token's own) to {MAX_LOGPROBS} alternatives, or omit it")  # fmt: skip
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model has none", field="stop",
                               hint="use stop_token_ids")  # fmt: skip

    def make_request(self, prompt_ids: list[int], params: RequestParams, *, owner: Any = None, index: int = 0,
                     seed: int | None = None) -> Request:  # fmt: skip
        """The request as the engine keeps it (checked already, or the warm-up's own): sequence `index`
        of its group, keyed by `seed` (default: the request's seed, or a fresh one)."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= {params.end_id} if params.end_id is not None else set(self.eos_token_ids)
        if seed is None:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        detokenizer = None
        if self.tokenizer is not None:
            from dflash_trt.engine.detokenizer import IncrementalDetokenizer

            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
            )
        return Request(
            request_id=next(self._ids),
            prompt_ids=[int(t) for t in prompt_ids],
            max_len=len(prompt_ids) + params.max_tokens,
            temperature=float(params.temperature),
            top_k=int(params.top_k),
            top_p=float(params.top_p),
            seed=seed & ((1 << 63) - 1),
            greedy_draft=params.greedy_draft,
            stop_token_ids=frozenset(stop_ids),
            stop_strings=tuple(params.stop),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            reproducible=params.seed is not None and params.temperature > 0,
            detokenizer=detokenizer,
            owner=owner,
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty),
            logit_bias=tuple((int(t), float(b)) for t, b in params.logit_bias),
            min_p=float(params.min_p),
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
            bad_words=tuple(tuple(int(t) for t in w) for w in params.bad_words),
            index=index,
        )


_MASK64 = (1 << 64) - 1


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of a request seeded `seed`: sequence 0 keeps it (so n = 1 and the
    first of n sample alike), the others get a splitmix64 mix of (seed, index), which is reproducible
    and keeps their random streams apart."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)
