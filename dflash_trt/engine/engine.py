# SPDX-License-Identifier: Apache-2.0
"""The embedded serving engine: admission, continuous batching, rounds, stop conditions.

Each `step()`:
  1. admits waiting requests in arrival order while a batch slot and enough KV pages are free
     (pages for prompt + max_tokens are reserved up front, so a running request never runs out;
     a request that could never fit is refused when it is added);
  2. prefills newcomers, chunked so that prefill and decode tokens stay within max_num_tokens;
  3. runs one DFlash round for every running request (the draft length follows the
     draft_len_schedule for the current batch size) — requests join and leave every step, and
     every request accepts its own number of drafts;
  4. applies per-request stop token ids, stop strings, max_tokens and max_seq_len, and frees the
     pages and slot of finished requests.
Not thread-safe: `dflash_trt.llmapi.LLM` drives it from one background thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trt.engine.checkpoint import TargetInfo, load_drafter, validate_pair
from dflash_trt.engine.kv_cache import PageAllocator, pages_for
from dflash_trt.engine.runner import ModelRunner
from dflash_trt.engine.sampling import validate_sampling
from dflash_trt.engine.sequence import Sequence, Status
from dflash_trt.engine.spec_config import DFlashDecodingConfig
from dflash_trt.errors import ConfigError, RequestError

log = logging.getLogger(__name__)

PAGE_SIZE = 16


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    max_num_tokens: int = 2048
    max_seq_len: int = 2048
    kv_max_tokens: int | None = None  # KV budget in tokens (target and draft caches share pages)
    kv_free_memory_fraction: float = 0.9  # CUDA: fraction of free memory after weights
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] | None = None
    profile: bool = False
    static_rounds: bool = False  # padded static-buffer rounds without graphs (CPU tests)
    use_plugins: bool | None = None  # dflash:: Triton ops for the drafter/accept; None = on for CUDA

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be a positive integer")
        if self.kv_max_tokens is not None and self.kv_max_tokens < PAGE_SIZE:
            raise ConfigError("kv_cache_config.max_tokens", self.kv_max_tokens, f"must be >= {PAGE_SIZE}")
        if not 0 < self.kv_free_memory_fraction <= 1:
            raise ConfigError(
                "kv_cache_config.free_gpu_memory_fraction", self.kv_free_memory_fraction, "must be in (0, 1]"
            )


@dataclass
class RequestParams:
    """Resolved per-request parameters (the engine's view of SamplingParams)."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    greedy_draft: bool = False
    skip_special_tokens: bool = True


@dataclass
class StepUpdate:
    """One change to a request, with the request's state *as of this change* (a step can commit a
    request twice: its prefill token and its first round)."""

    seq: Sequence
    new_token_ids: list[int]
    text_delta: str
    num_tokens: int = 0
    text_len: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    finished: bool = False


class LLMEngine:
    def __init__(
        self,
        *,
        target_dir: str | Path,
        drafter_dir: str | Path | None,
        spec: DFlashDecodingConfig | None,
        tokenizer: Any | None,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        from dflash_trt.models.loader import load_native_target

        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.target = load_native_target(target_dir, device=device, dtype=dtype)
        tcfg = self.target.config
        self.vocab_size = tcfg.vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or tcfg.eos_token_ids
        self.spec = spec
        self.drafter = None
        block = 1
        if drafter_dir is not None and spec is not None:
            mask = spec.mask_token_id
            self.drafter = load_drafter(drafter_dir, device=device, dtype=dtype, mask_token_id=mask)
            if spec.target_layer_ids is not None and list(spec.target_layer_ids) != list(
                self.drafter.config.target_layer_ids
            ):
                raise ConfigError(
                    "speculative_config.target_layer_ids",
                    spec.target_layer_ids,
                    f"differs from the drafter's {list(self.drafter.config.target_layer_ids)}",
                    hint="omit it; the drafter's config is authoritative",
                )
            validate_pair(
                self.drafter.config,
                TargetInfo(tcfg.hidden_size, tcfg.num_hidden_layers, tcfg.vocab_size, tcfg.model_type),
            )
            spec.validate(block_size=self.drafter.config.block_size)
            assert spec.max_draft_len is not None
            block = spec.max_draft_len + 1
        self.block_size = block
        num_pages = self._plan_pages(dtype)
        self.allocator = PageAllocator(num_pages)
        self.runner = ModelRunner(
            self.target,
            self.drafter,
            max_batch_size=config.max_batch_size,
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            block_size=block,
            cuda_graphs=config.cuda_graphs,
            profile=config.profile,
            static_rounds=config.static_rounds,
            use_plugins=config.use_plugins,
            **({"graph_batch_sizes": config.graph_batch_sizes} if config.graph_batch_sizes else {}),
        )
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.by_id: dict[int, Sequence] = {}
        self._next_id = 0
        self.num_steps = 0
        self.peak_active = 0  # most requests ever in flight in one step (prefill + decode)
        log.info(
            "engine: %s target, drafter=%s, block=%d, %d KV pages of %d tokens, device=%s %s",
            tcfg.model_type,
            drafter_dir,
            block,
            num_pages - 1,
            PAGE_SIZE,
            device,
            dtype,
        )

    # --- memory ---------------------------------------------------------------------------------
    def _bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per = self.target.config.kv_bytes_per_token(size)
        if self.drafter is not None:
            c = self.drafter.config
            per += 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * size
        return per

    def _plan_pages(self, dtype: torch.dtype) -> int:
        cfg = self.config
        # Enough for max_batch_size requests of max_seq_len tokens each (reservations are per page).
        full = cfg.max_batch_size * pages_for(cfg.max_seq_len, PAGE_SIZE) * PAGE_SIZE
        if cfg.kv_max_tokens is not None:
            tokens = cfg.kv_max_tokens
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            tokens = min(full, int(free * cfg.kv_free_memory_fraction) // self._bytes_per_token(dtype))
        else:
            tokens = full
        pages = tokens // PAGE_SIZE
        if pages < 1:
            raise ConfigError(
                "kv_cache_config.max_tokens", tokens, f"leaves no room for one {PAGE_SIZE}-token page"
            )
        return pages + 1  # + the padding page

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.allocator.num_pages - 1) * PAGE_SIZE

    def _pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        return pages_for(prompt_len + max_tokens, PAGE_SIZE)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: RequestParams) -> Sequence:
        """Validate and queue a request. Raises RequestError (naming the field) on bad input."""
        if not prompt_ids:
            raise RequestError("prompt is empty", hint="send at least one token or character")
        bad = next((i for i, t in enumerate(prompt_ids) if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"prompt_ids[{bad}]={prompt_ids[bad]}: out of range for vocab_size={self.vocab_size}"
            )
        n = len(prompt_ids)
        if (
            isinstance(params.max_tokens, bool)
            or not isinstance(params.max_tokens, int)
            or params.max_tokens < 1
        ):
            raise RequestError(f"max_tokens={params.max_tokens!r} must be an integer >= 1")
        if n >= self.config.max_seq_len:
            raise RequestError(
                f"prompt has {n} tokens, not below max_seq_len={self.config.max_seq_len}",
                hint="shorten the prompt or raise max_seq_len",
            )
        if n + params.max_tokens > self.config.max_seq_len:
            raise RequestError(
                f"max_tokens={params.max_tokens}: prompt ({n} tokens) + max_tokens exceeds "
                f"max_seq_len={self.config.max_seq_len}",
                hint=f"use max_tokens <= {self.config.max_seq_len - n}",
            )
        try:
            validate_sampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        except ConfigError as exc:
            raise RequestError(exc.message, hint=exc.hint) from None
        if params.min_tokens < 0:
            raise RequestError(f"min_tokens={params.min_tokens} must be >= 0")
        check_stop_token_ids(params.stop_token_ids, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer, and this model has none", hint="use stop_token_ids"
            )
        need = self._pages_needed(n, params.max_tokens)
        if need > self.allocator.num_pages - 1:
            raise RequestError(
                f"request needs {need * PAGE_SIZE} KV tokens (prompt {n} + max_tokens {params.max_tokens}) "
                f"but the whole cache holds {self.kv_capacity_tokens}",
                hint="lower max_tokens or raise kv_cache_config.max_tokens",
            )
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        detok = None
        if self.tokenizer is not None:
            from dflash_trt.engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
            )
        seq = Sequence(
            request_id=self._next_id,
            prompt_ids=[int(t) for t in prompt_ids],
            max_len=n + params.max_tokens,
            temperature=float(params.temperature),
            top_k=int(params.top_k),
            top_p=float(params.top_p),
            seed=seed & ((1 << 63) - 1),
            greedy_draft=params.greedy_draft,
            stop_token_ids=frozenset(int(t) for t in params.stop_token_ids),
            stop_strings=tuple(params.stop),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            detokenizer=detok,
        )
        self._next_id += 1
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: int) -> Sequence | None:
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished:
            return None
        self._finish(seq, "cancelled")
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepUpdate]:
        updates: list[StepUpdate] = []
        self._admit()
        bq = self.block_size
        budget = self.config.max_num_tokens - len(self.running) * bq
        if self.prefilling:
            budget = max(budget, min(self.config.max_num_tokens, PAGE_SIZE))
            group: list[Sequence] = []
            chunks: list[tuple[int, int]] = []
            for seq in self.prefilling:
                if budget <= 0:
                    break
                lo = seq.prefilled
                hi = min(len(seq.prompt_ids), lo + budget)
                group.append(seq)
                chunks.append((lo, hi))
                budget -= hi - lo
            firsts = self.runner.prefill(group, chunks)
            now = time.perf_counter()
            for seq, (_, hi), tok in zip(group, chunks, firsts):
                seq.prefilled = hi
                if tok is None:
                    continue
                self.prefilling.remove(seq)
                seq.status = Status.RUNNING
                seq.first_token_time = seq.last_token_time = now
                self.running.append(seq)
                updates.append(self._commit(seq, [tok], first=True))
        live = [s for s in self.running if not s.finished]
        if live:
            g = (
                self.spec.draft_len_for(len(live))
                if self.spec is not None and self.drafter is not None
                else 0
            )
            out = self.runner.decode_round(live, g)
            now = time.perf_counter()
            for i, seq in enumerate(live):
                a = out.accepted[i]
                block_len = min(g + 1, seq.max_len - seq.start)
                new = [*out.drafts[i][:a], out.emitted[i]]
                seq.num_draft_tokens += block_len - 1
                seq.last_token_time = now
                updates.append(self._commit(seq, new, accepted=a))
        self.running = [s for s in self.running if not s.finished]
        self.num_steps += 1
        self.peak_active = max(self.peak_active, len(live) + len(self.prefilling))
        return updates

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            need = self._pages_needed(len(seq.prompt_ids), seq.max_len - len(seq.prompt_ids))
            if need > self.allocator.num_free:
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            seq.pages = self.allocator.allocate(need)
            seq.slot = self.free_slots.pop()
            seq.status = Status.PREFILL
            seq.first_scheduled_time = time.perf_counter()
            self.prefilling.append(seq)

    def _commit(self, seq: Sequence, new: list[int], *, first: bool = False, accepted: int = 0) -> StepUpdate:
        """Append tokens (truncated by max length and stop conditions) and emit an update."""
        produced = len(new) if first else min(len(new), seq.max_len - seq.start - 1)
        finish: str | None = None
        stop_reason: int | str | None = None
        base = len(seq.output_ids)
        for idx, tok in enumerate(new[:produced]):
            if tok in seq.stop_token_ids and base + idx + 1 >= seq.min_tokens:
                produced, finish, stop_reason = idx + 1, "stop", tok
                break
        tokens = new[:produced]
        seq.output_ids.extend(tokens)
        if not first:
            seq.pending = produced
            seq.acceptance_lengths.append(produced)
            seq.num_accepted_draft_tokens += min(accepted, produced)
        old_text = seq.text
        if seq.detokenizer is not None:
            seq.detokenizer.add(tokens)
            seq.text = seq.detokenizer.text
            if seq.stop_strings and len(seq.output_ids) >= seq.min_tokens:
                cut = self._find_stop(seq, len(old_text))
                if cut is not None:
                    finish, (stop_reason, pos) = "stop", cut
                    end = pos + (len(stop_reason) if seq.include_stop_str_in_output else 0)
                    seq.text = seq.text[:end]
                    seq.output_ids = seq.output_ids[: self._tokens_covering(seq, pos + len(stop_reason))]
                    tokens = seq.output_ids[base:]
        if finish is None and (seq.start + 1 >= seq.max_len):
            finish = "length"
        if finish is not None:
            if seq.detokenizer is not None and finish == "length":
                seq.detokenizer.flush()
                seq.text = seq.detokenizer.text
            self._finish(seq, finish, stop_reason)
        return StepUpdate(
            seq=seq,
            new_token_ids=tokens,
            text_delta=seq.text[len(old_text) :],
            num_tokens=len(seq.output_ids),
            text_len=len(seq.text),
            num_rounds=len(seq.acceptance_lengths),
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_draft_tokens,
            finished=seq.finished,
        )

    @staticmethod
    def _find_stop(seq: Sequence, old_len: int) -> tuple[str, int] | None:
        best: tuple[str, int] | None = None
        for stop in seq.stop_strings:
            pos = seq.text.find(stop, max(0, old_len - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[1]):
                best = (stop, pos)
        return best

    def _tokens_covering(self, seq: Sequence, chars: int) -> int:
        """Smallest number of output tokens whose decoded text reaches `chars` characters."""
        assert self.tokenizer is not None
        lo, hi = 1, len(seq.output_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tokenizer.decode(seq.output_ids[:mid], skip_special_tokens=True)
            if len(text) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.PREFILL:
            self.prefilling.remove(seq)
        seq.status = Status.FINISHED
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        self.by_id.pop(seq.request_id, None)

    # --- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t = self.runner.times
        return {
            "waiting": len(self.waiting),
            "active": self.num_active,
            "peak_active": self.peak_active,
            "steps": self.num_steps,
            "kv_free_tokens": self.allocator.num_free * PAGE_SIZE,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "rounds": t.rounds,
            "round_s": t.round_s,
            "draft_s": t.draft_s,
            "verify_s": t.verify_s,
            "accept_s": t.accept_s,
            "prefill_s": t.prefill_s,
        }


def check_stop_token_ids(ids: list[int] | tuple[int, ...] | None, vocab_size: int) -> None:
    """stop_token_ids must be token ids of this vocabulary (an id outside it can never stop anything)."""
    bad = sorted({int(t) for t in ids or () if not 0 <= int(t) < vocab_size})
    if bad:
        raise RequestError(f"stop_token_ids={bad}: out of range for vocab_size={vocab_size}",
                           hint=f"use ids in [0, {vocab_size})")  # fmt: skip


def default_page_budget(max_batch_size: int, max_seq_len: int) -> int:
    return math.ceil(max_batch_size * max_seq_len / PAGE_SIZE)
