# SPDX-License-Identifier: Apache-2.0
"""The embedded serving engine: validate and queue requests, then step.

Each `step()` runs schedule → run → postprocess:
  1. applies what other threads queued since the last step (new requests, aborts);
  2. `Scheduler.schedule()` admits waiting requests and picks the prefill chunks and the round;
  3. `ModelRunner` prefills the chunks and runs one DFlash round for every running request (the
     draft length follows the user's draft_len_schedule, or is chosen by measured cost for the
     batch size (`draft_len.DraftLenPolicy`, the default); a DDTree budget, pinned or chosen by cost
     for the batch size, comes from `tree_budget.BudgetPolicy`; every request accepts its own
     number of drafts);
  4. postprocess commits each request's tokens under its stop rules (`postprocess.py`) and
     returns finished requests' pages and rows to the scheduler.

Threading: `add_request` and `abort` may be called from any thread (they only read immutable
state and put work on thread-safe queues); everything else runs on one engine thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_trt.engine.config import PAGE_SIZE, EngineConfig
from dflash_trt.engine.draft_len import DraftLenPolicy
from dflash_trt.engine.postprocess import StepUpdate, commit_tokens
from dflash_trt.engine.request import Request, RequestParams
from dflash_trt.engine.runner import ModelRunner, RoundShape, round_flags
from dflash_trt.engine.scheduler import Scheduler
from dflash_trt.engine.tree_budget import BudgetPolicy
from dflash_trt.errors import ConfigError, RequestError
from dflash_trt.layers import cpu_attention, cpu_gemm
from dflash_trt.layers.kv_cache import PagedKVCache, pages_for
from dflash_trt.layers.linear import pack_linears
from dflash_trt.models.checkpoint import load_drafter
from dflash_trt.models.dflash_config import TargetInfo, validate_pair
from dflash_trt.models.loader import load_native_target
from dflash_trt.spec.decoding_config import DFlashDecodingConfig, check_tree_drafter
from dflash_trt.spec.prompt import check_prompt_ids
from dflash_trt.spec.sampling import validate_sampling
from dflash_trt.utils.device import streams_weights

log = logging.getLogger(__name__)

WARM_UP_BATCHES = (2, 1)  # batch sizes of the warm-up (a batch of one has a compiled round of its own)


class WarmUp(NamedTuple):
    """One throwaway batch of the warm-up: its round shape, batch size and request parameters."""

    g: int  # draft length
    budget: int  # DDTree budget
    mode: str  # "greedy" or "sampled"
    batch: int
    params: RequestParams


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
            self.drafter = self._load_drafter(drafter_dir, spec, device=device, dtype=dtype)
            assert spec.max_draft_len is not None
            block = spec.max_draft_len + 1
        self.block_size = block
        # DDTree: the budget per round (pinned, or chosen by cost); linear DFlash without a drafter
        self.budgets = BudgetPolicy.from_config(spec.tree_budget if self.drafter is not None and spec else 0)
        self._trees = self.budgets.max_budget > 0  # rounds may verify trees: record their budgets
        # The draft length per round, from the user's schedule or chosen by cost: linear DFlash, and the
        # chain of a DDTree engine whose budget is "auto" (a busy batch then drafts a short chain, as a
        # linear engine does, instead of the full block's chain or tree); a pinned budget keeps the block
        self.draft_lens: DraftLenPolicy | None = None
        if self.drafter is not None and spec is not None and (not self._trees or self.budgets.auto):
            assert spec.max_draft_len is not None
            user = spec.draft_len_for if spec.schedule() is not None else None
            self.draft_lens = DraftLenPolicy.for_spec(spec.max_draft_len, user)
        self.clock = time.perf_counter  # times rounds for the cost policies (tests inject their own)
        self._compiled_seen = 0  # compiled rounds in use at the latest round (see _round)
        # One GEMM for q/k/v and one for gate/up in both models (fewer, wider GEMMs; same weights).
        self.target.fuse_projections()
        if self.drafter is not None:
            self.drafter.fuse_projections()
        self.packed_weights = self._pack_weights(config, float32=device.type == "cpu" and dtype == torch.float32
                                                 and streams_weights(tcfg.num_step_parameters()))  # fmt: skip
        self.paged_attention = self._enable_paged_attention(config, device=device, dtype=dtype)
        num_pages = self._plan_pages(dtype)
        self.num_kv_pages = num_pages - 1  # page 0 is the padding page
        self.scheduler = Scheduler(
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            block_size=block,
            tree_budget=self.budgets.max_budget,
        )
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
            compile=config.compile,
            compile_dir=config.compile_dir,
            trees=self._trees,
            **({"graph_batch_sizes": config.graph_batch_sizes} if config.graph_batch_sizes else {}),
        )
        self._ids = itertools.count()
        self._new: queue.SimpleQueue[Request] = queue.SimpleQueue()  # from add_request
        self._aborts: queue.SimpleQueue[int] = queue.SimpleQueue()  # from abort
        self._live: dict[int, Request] = {}  # every request added and not yet finished
        self.num_steps = 0
        log.info("engine: %s target, drafter=%s, block=%d, draft length %s, tree budget %s, %d KV pages of %d "
                 "tokens, device=%s %s", tcfg.model_type, drafter_dir, block,
                 "auto" if self.draft_lens is not None and self.draft_lens.auto else "by schedule",
                 "auto" if self.budgets.auto else self.budgets.pinned, self.num_kv_pages, PAGE_SIZE, device,
                 dtype)  # fmt: skip

    def _pack_weights(self, config: EngineConfig, *, float32: bool) -> int:
        """bf16 weights on CPU prepacked (layers/linear.py: for dflash-trt's AVX512-BF16 GEMM, else for
        oneDNN); with `float32` (a model whose steps stream their weights run in fp32 on a CPU: what the
        dtype policy picks where the CPU has no native bf16, or the caller's dtype), fp32 weights that
        hold bf16 values kept as bf16 for dflash-trt's AVX2 GEMM. Not with the drafting plugin, whose
        kernels read the dense weights. Returns how many were packed."""
        if config.use_plugins:
            return 0
        count = pack_linears(self.target, float32=float32)
        if self.drafter is not None:
            count += pack_linears(self.drafter, float32=float32)
        if count and self.target.model.embed_tokens.weight.dtype == torch.float32 and not float32:
            log.info("prepacked %d fp32 weights (dflash-trt's fp32 CPU GEMM)", count)
        elif count:
            compute = torch.float32 if float32 else torch.bfloat16
            kind = "dflash-trt's CPU GEMM" if cpu_gemm.available(compute) else "oneDNN"
            log.info("prepacked %d weights as bf16 (%s, %s compute)", count, kind, str(compute)[6:])
        return count

    def _enable_paged_attention(
        self, config: EngineConfig, *, device: torch.device, dtype: torch.dtype
    ) -> int:
        """On CPU, decode rounds' attention reads the paged caches in place (layers/cpu_attention.py), in
        both models. Not with the drafting plugin, which has its own attention kernels. Returns how many
        attention modules were switched."""
        if config.use_plugins:
            return 0
        count = cpu_attention.enable(self.target, device=device, dtype=dtype)
        if self.drafter is not None:
            count += cpu_attention.enable(self.drafter, device=device, dtype=dtype)
        if count:
            log.info("decode attention reads the paged KV caches in place (%d layers, dflash_cpu::paged_attention)",
                     count)  # fmt: skip
        return count

    def _load_drafter(
        self, drafter_dir: str | Path, spec: DFlashDecodingConfig, *, device: torch.device, dtype: torch.dtype
    ) -> Any:
        """The drafter, checked against the speculative config and the target."""
        drafter = load_drafter(drafter_dir, device=device, dtype=dtype, mask_token_id=spec.mask_token_id)
        if spec.target_layer_ids is not None and list(spec.target_layer_ids) != list(
            drafter.config.target_layer_ids
        ):
            raise ConfigError(
                "speculative_config.target_layer_ids",
                spec.target_layer_ids,
                f"differs from the drafter's {list(drafter.config.target_layer_ids)}",
                hint="omit it; the drafter's config is authoritative",
            )
        tcfg = self.target.config
        validate_pair(
            drafter.config,
            TargetInfo(tcfg.hidden_size, tcfg.num_hidden_layers, tcfg.vocab_size, tcfg.model_type),
        )
        spec.validate(block_size=drafter.config.block_size)
        # DDTree with a DFlash 2 drafter: refused by name, never a silent fallback
        check_tree_drafter(spec.tree_budget, dflash2=drafter.config.is_dflash2)
        return drafter

    # --- memory ---------------------------------------------------------------------------------
    def _bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per = self.target.config.kv_bytes_per_token(size)
        if self.drafter is not None:
            c = self.drafter.config
            per += PagedKVCache.bytes_per_token(
                num_layers=c.num_hidden_layers,
                num_kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                dtype=dtype,
            )
        return per

    def _plan_pages(self, dtype: torch.dtype) -> int:
        cfg = self.config
        # Enough for max_batch_size requests of max_seq_len tokens each, plus a DDTree's scratch columns
        # (reservations are per page).
        full = (
            cfg.max_batch_size * pages_for(cfg.max_seq_len + self.budgets.max_budget, PAGE_SIZE) * PAGE_SIZE
        )
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
        return self.num_kv_pages * PAGE_SIZE

    # --- requests (any thread) ------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: RequestParams, *, owner: Any = None) -> Request:
        """Validate and queue a request: the one place a request is checked.

        Raises RequestError naming the field, the value and the fix. `owner` is stored on the
        request untouched (the LLM API keeps its handle there). Thread-safe.
        """
        check_prompt_ids(prompt_ids, self.vocab_size)
        self._check_lengths(len(prompt_ids), params.max_tokens)
        self._check_sampling(params)
        req = self._make_request(prompt_ids, params, owner=owner)
        self._new.put(req)
        return req

    def _check_lengths(self, n: int, max_tokens: Any) -> None:
        """max_tokens against the prompt's `n` tokens, max_seq_len and the KV cache."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(
                f"max_tokens={max_tokens!r} must be an integer >= 1",
                field="max_tokens",
                hint="send max_tokens >= 1",
            )
        limit = self.config.max_seq_len
        if n >= limit:
            raise RequestError(
                f"prompt has {n} tokens, not below max_seq_len={limit}",
                field="prompt",
                hint="shorten the prompt or raise max_seq_len",
            )
        if n + max_tokens > limit:
            raise RequestError(
                f"max_tokens={max_tokens}: prompt ({n} tokens) + max_tokens exceeds max_seq_len={limit}",
                field="max_tokens",
                hint=f"use max_tokens <= {limit - n}",
            )
        need = self.scheduler.pages_needed(n, max_tokens)
        if need > self.num_kv_pages:
            scratch = self.scheduler.scratch_tokens
            raise RequestError(
                f"request needs {need * PAGE_SIZE} KV tokens (prompt {n} + max_tokens {max_tokens}"
                + (f" + DDTree scratch {scratch}" if scratch else "")
                + f") but the whole cache holds {self.kv_capacity_tokens}",
                field="max_tokens",
                hint="lower max_tokens or raise kv_cache_config.max_tokens",
            )

    def _check_sampling(self, params: RequestParams) -> None:
        """Sampling ranges, min_tokens and seed, stop ids against the vocabulary, stop strings."""
        try:
            validate_sampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
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
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer, and this model has none",
                field="stop",
                hint="use stop_token_ids",
            )

    def _make_request(self, prompt_ids: list[int], params: RequestParams, *, owner: Any) -> Request:
        """The checked request as the engine keeps it: stop ids resolved, a seed drawn when none was
        given, a detokenizer when the model has a tokenizer."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= {params.end_id} if params.end_id is not None else set(self.eos_token_ids)
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
        )

    def abort(self, request_id: int) -> None:
        """Cancel a request at the next step: it ends with finish_reason 'cancelled'. Thread-safe;
        a request that already finished is left alone."""
        self._aborts.put(request_id)

    def awaits_compiled_rounds(self) -> bool:
        """Shape classes compiled in the background are still to be loaded (engine/precompile.py)."""
        rounds = self.runner.rounds
        return rounds is not None and rounds.expecting

    def load_compiled_rounds(self) -> int:
        """Load the background-compiled classes that are ready (an idle engine does it between
        requests rather than in the next round). Engine thread."""
        rounds = self.runner.rounds
        return rounds.refresh() if rounds is not None else 0

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._new.empty() or not self._aborts.empty()

    def _warm_up_variants(self) -> list[WarmUp]:
        """The warm-up's throwaway batches: greedy and sampled, at batch 2 and 1 (a batch of one has a
        compiled round of its own), at every draft length and DDTree budget the policies may choose
        for that batch. The longest draft length comes first, then the shorter ones longest first: a
        background compiler (engine/precompile.py) delivers the classes serving uses most first."""
        new_tokens = min(3 * PAGE_SIZE, self.config.max_seq_len - 2)
        if new_tokens < 1:
            return []
        greedy = RequestParams(max_tokens=new_tokens, ignore_eos=True)
        sampled = RequestParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=0)
        batches = [bs for bs in WARM_UP_BATCHES if bs <= self.config.max_batch_size]
        lens = {bs: sorted(self._draft_lens_for(bs), reverse=True) for bs in batches}
        rank = {(bs, g): 0 if g == lens[bs][0] else 1 + i for bs in batches for i, g in enumerate(lens[bs])}
        variants = [
            WarmUp(g, budget if g > 0 else 0, mode, bs, params)
            for g in sorted({g for bs in batches for g in lens[bs]}, reverse=True)
            for budget in (self.budgets.budgets() if self._tree_round(g) else (0,))
            for mode, params in (("greedy", greedy), ("sampled", sampled))
            for bs in batches
            if g in lens[bs]
        ]
        return sorted(variants, key=lambda w: rank[w.batch, w.g])  # stable: the order above within a rank

    def _draft_lens_for(self, batch_size: int) -> tuple[int, ...]:
        """Every draft length a round of `batch_size` requests may run."""
        if self.draft_lens is not None:
            return self.draft_lens.draft_lens(batch_size)
        return (self._draft_len(batch_size),)

    def warm_up_classes(self) -> list[tuple[Any, ...]]:
        """The compiled classes (engine/compile.py) that `warm_up` runs: its rounds' shape classes and
        the prefill's (a prefill class is compiled in its batch size's last warm-up batch)."""
        classes: list[tuple[Any, ...]] = []
        for keys in self._variant_classes(self._warm_up_variants()):
            classes += [k for k in keys if k not in classes]
        return classes

    def _variant_classes(self, variants: list[WarmUp]) -> list[list[tuple[Any, ...]]]:
        """The classes each warm-up batch compiles: its round's, and the prefill's where it is the last
        batch of its size."""
        from dflash_trt.engine.compile import PREFILL, RoundCache

        out = []
        for n, w in enumerate(variants):
            req = self._make_request([1, 1], w.params, owner=None)
            shape = RoundShape(w.g, w.budget, round_flags([req] * w.batch))
            keys = [RoundCache.class_key(shape.kwargs(), w.batch == 1)]
            if self._compiles_prefill(variants, n):
                keys.append(RoundCache.class_key({}, w.batch == 1, PREFILL))
            out.append(keys)
        return out

    def warm_up_size(self) -> int:
        """How many throwaway batches `warm_up` runs (the most processes worth compiling them)."""
        return len(self._warm_up_variants())

    @staticmethod
    def _compiles_prefill(variants: list[WarmUp], n: int) -> bool:
        """Whether the warm-up's batch `n` compiles the prefill of its batch size: the last batch of
        each size does (before it, prompts are prefilled eagerly unless the prefill is already
        compiled), so that a background compiler delivers the rounds, which serving runs most, first."""
        return all(w.batch != variants[n].batch for w in variants[n + 1 :])

    def warm_up(self, claim: Callable[[int], bool] | None = None) -> float:
        """Run throwaway requests to completion so that what is built on first use (the compiled
        round for batch 1 and for larger batches, across page-width growth, greedy and sampling, at
        every draft length and DDTree budget the policies may choose) is ready before real traffic.
        Returns the seconds it took. Engine thread, before serving.

        claim: one of several processes that compile the warm-up's classes side by side
        (engine/precompile.py). It runs the batch number n only if claim(n) is true (no other process
        took it), and compiles only that batch's classes; a round of another process's class runs
        eagerly here unless it is already on disk."""
        t0 = time.perf_counter()
        variants = self._warm_up_variants()
        rounds = self.runner.rounds
        owned = self._variant_classes(variants) if claim is not None else []
        try:
            for n, w in enumerate(variants, 1):
                if claim is not None:
                    if not claim(n - 1):
                        continue
                    if rounds is not None:
                        rounds.assigned = set(owned[n - 1])
                t1 = time.perf_counter()
                self.runner.compile_prefill = self._compiles_prefill(variants, n - 1)
                self.budgets.override = w.budget
                if self.draft_lens is not None:
                    self.draft_lens.override = w.g
                for i in range(w.batch):
                    self.add_request([1 + i % max(1, self.vocab_size - 1)] * 2, w.params)
                while self.has_work():
                    self.step()
                log.info("warm-up %d/%d (%s, batch %d, draft length %d%s): %.1f s", n, len(variants), w.mode,
                         w.batch, w.g, f", tree budget {w.budget}" if self._trees else "",
                         time.perf_counter() - t1)  # fmt: skip
        finally:
            if rounds is not None:
                rounds.assigned = None
            self.runner.compile_prefill = True
            self.budgets.override = None
            self.budgets.reset()  # warm-up rounds compile: their costs would mislead the choice
            if self.draft_lens is not None:
                self.draft_lens.override = None
                self.draft_lens.reset()
        return time.perf_counter() - t0

    def _tree_round(self, g: int) -> bool:
        """Whether a round drafting `g` tokens may verify a DDTree: a tree spans the full block, so with
        trees on only the full block's rounds do (shorter chains are the draft-length policy's)."""
        if not self._trees:
            return g > 0
        return g > 0 and g == self.block_size - 1

    def _draft_len(self, batch_size: int, *, reproducible: bool = False) -> int:
        """Drafts per sequence in the next round of `batch_size` sequences (0: plain decoding). A round
        with a seeded sampled request drafts the full block unless a schedule or the warm-up says
        otherwise: its samples then never depend on the load (docs/llm-api.md)."""
        if self.draft_lens is not None:
            return self.draft_lens.choose(batch_size, keep_block=reproducible)
        return self.spec.draft_len_for(batch_size) if self.spec and self.drafter else 0

    # --- the step (engine thread) -----------------------------------------------------------------
    def step(self) -> list[StepUpdate]:
        updates = self._take_queued()
        batch = self.scheduler.schedule()
        if batch.prefill:
            firsts = self.runner.prefill(batch.prefill, batch.chunks)
            now = time.perf_counter()
            for req, (_, hi), tok in zip(batch.prefill, batch.chunks, firsts):
                req.prefilled = hi
                if tok is None:
                    continue
                self.scheduler.start_decoding(req)
                req.first_token_time = req.last_token_time = now
                updates.append(self._postprocess(req, [tok], first=True))
        if batch.decode:
            updates.extend(self._round(batch.decode))
        self.num_steps += 1
        return updates

    def _round(self, reqs: list[Request]) -> list[StepUpdate]:
        """One round for the running requests: the draft length and tree budget for their number, the
        round (timed for the budget policy), then each request's tokens through its stop rules."""
        n = len(reqs)
        self._forget_costs_on_new_compiled_rounds()
        g = self._draft_len(n, reproducible=any(r.reproducible for r in reqs))
        trees = self._tree_round(g)  # the budget policy's round: a tree, or the chain it compares with
        budget = self.budgets.choose(n) if trees else 0
        t0 = self.clock()
        out = self.runner.decode_round(reqs, g, budget)
        seconds = self.clock() - t0
        if trees:
            self.budgets.record(budget, n, seconds, out.accepted, out.path)
        if self.draft_lens is not None:
            self.draft_lens.record(g, n, seconds, out.accepted)
        now = time.perf_counter()
        updates = []
        for i, req in enumerate(reqs):
            a = out.accepted[i]
            req.num_draft_tokens += out.drafted[i]
            req.num_overturned_draft_tokens += out.overturned[i]
            req.last_token_time = now
            if self._trees:
                req.tree_budgets.append(budget)
            updates.append(self._postprocess(req, [*out.drafts[i][:a], out.emitted[i]], accepted=a))
        return updates

    def _forget_costs_on_new_compiled_rounds(self) -> None:
        """Round costs measured while some shape classes ran eagerly (a background compiler was still
        at work) do not hold once their compiled rounds are in use: the cost policies start over."""
        rounds = self.runner.rounds
        count = 0 if rounds is None else rounds.loaded + rounds.compiled
        if count != self._compiled_seen:
            self._compiled_seen = count
            self.budgets.reset()
            if self.draft_lens is not None:
                self.draft_lens.reset()

    def fail_all(self) -> list[StepUpdate]:
        """End every queued and running request with finish_reason 'error' (after an engine
        failure, or at shutdown): one final update each. Engine thread."""
        self._take_queued()
        updates = []
        for req in list(self._live.values()):
            self._finish(req, "error")
            updates.append(self._update(req, [], ""))
        return updates

    def _take_queued(self) -> list[StepUpdate]:
        while not self._new.empty():
            req = self._new.get()
            self._live[req.request_id] = req
            self.scheduler.add(req)
        updates = []
        while not self._aborts.empty():
            aborted = self._live.get(self._aborts.get())
            if aborted is not None:
                self._finish(aborted, "cancelled")
                updates.append(self._update(aborted, [], ""))
        return updates

    def _postprocess(
        self, req: Request, new: list[int], *, first: bool = False, accepted: int = 0
    ) -> StepUpdate:
        finish, stop_reason, tokens, text_delta = commit_tokens(
            req, new, tokenizer=self.tokenizer, first=first, accepted=accepted
        )
        if finish is not None:
            self._finish(req, finish, stop_reason)
        return self._update(req, tokens, text_delta)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.scheduler.finish(req)
        self._live.pop(req.request_id, None)

    @staticmethod
    def _update(req: Request, tokens: list[int], text_delta: str) -> StepUpdate:
        return StepUpdate(
            req=req,
            new_token_ids=tokens,
            text_delta=text_delta,
            num_tokens=len(req.output_ids),
            text_len=len(req.text),
            num_rounds=len(req.acceptance_lengths),
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_draft_tokens=req.num_accepted_draft_tokens,
            num_overturned_draft_tokens=req.num_overturned_draft_tokens,
            finished=req.finished,
        )

    # --- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t = self.runner.times
        sched = self.scheduler
        return {
            "waiting": len(sched.waiting) + self._new.qsize(),
            "active": sched.num_active,
            "peak_active": sched.peak_active,
            "steps": self.num_steps,
            "kv_free_tokens": sched.allocator.num_free * PAGE_SIZE,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "rounds": t.rounds,
            "round_s": t.round_s,
            "draft_s": t.draft_s,
            "verify_s": t.verify_s,
            "accept_s": t.accept_s,
            "prefill_s": t.prefill_s,
            **(self.budgets.summary() if self._trees else {}),
            **(self.draft_lens.summary() if self.draft_lens is not None else {}),
        }
