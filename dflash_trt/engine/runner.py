# SPDX-License-Identifier: Apache-2.0
"""Model runner: batched prefill and one DFlash round for every running sequence.

A round, for bs sequences at anchor positions start_i with block length B_i <= Bq = g + 1:
  1. inject the pending context (target features of the previous round's committed tokens) into
     the draft cache — always, even when this round does not draft, so the draft cache never
     falls behind;
  2. draft g tokens per sequence in one block pass (block positions >= B_i hidden, which reproduces a
     block of size B_i exactly);
  3. verify [anchor, drafts] with the target in one pass, writing K/V for the B_i valid tokens and
     keeping the layer taps as the next round's pending context;
  4. accept on device (greedy or lossless rejection sampling; randomness keyed by position).
The host reads back only (accepted, emitted, drafts): one synchronisation per round.

Every tensor of the round has a static shape given (bs, g, context pages), so on CUDA the round
is captured once per (padded batch size, g, page bucket) and replayed from static buffers.
Padding rows point at page 0, which no sequence owns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflash_trt.layers.kv_cache import PagedKVCache, context_index, pages_for, slot_mapping
from dflash_trt.plugins import default_enabled
from dflash_trt.spec.accept import greedy_accept, rejection_accept
from dflash_trt.spec.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_EMIT,
    logits_to_probs,
    sample_from_probs,
    uniform,
)

if TYPE_CHECKING:
    from dflash_trt.engine.request import Request
    from dflash_trt.models.decoder import NativeTarget
    from dflash_trt.models.drafter import DFlashDrafter

log = logging.getLogger(__name__)

# Padded batch sizes for captured rounds; a batch replays the smallest graph that fits.
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class RoundOutput:
    accepted: list[int]  # drafts accepted per sequence (before length/stop truncation)
    emitted: list[int]  # the target's token after the accepted drafts
    drafts: list[list[int]]  # g proposed tokens per sequence


@dataclass
class _Sampling:
    """A round's per-request sampling tensors ([bs] each) and the batch's static flags."""

    seeds: torch.Tensor
    temps: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy_draft: torch.Tensor
    flags: tuple[bool, bool, bool]  # (all greedy, any greedy, any top-k/top-p filter)

    @property
    def all_greedy(self) -> bool:
        return self.flags[0]

    def probs(self, logits: torch.Tensor, *, per_row: int) -> torch.Tensor:
        """logits [bs * per_row, V] -> processed probabilities (each request's row repeated)."""
        _, any_greedy, needs_filter = self.flags
        return logits_to_probs(
            logits,
            self.temps.repeat_interleave(per_row),
            self.top_k.repeat_interleave(per_row),
            self.top_p.repeat_interleave(per_row),
            needs_filter=needs_filter,
            any_greedy=any_greedy,
        )


@dataclass
class PhaseTimes:
    """Wall time per phase, accumulated (seconds). Only synchronised when profiling is on."""

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    round_s: float = 0.0
    rounds: int = 0


def _round_flags(reqs: list[Request]) -> tuple[bool, bool, bool]:
    """(all greedy, any greedy, any top-k/top-p): a round's compile-time sampling mode. Three modes
    only, so that compiled and captured rounds need three variants at most: all-greedy batches take
    the argmax path; every other batch takes the sampling path, which handles greedy rows exactly
    (one-hot distributions), with the sorting filter only when a request asks for it."""
    if all(s.temperature == 0 for s in reqs):
        return True, True, False
    return False, True, any(s.needs_filter for s in reqs)


class ModelRunner:
    def __init__(
        self,
        target: NativeTarget,
        drafter: DFlashDrafter | None,
        *,
        max_batch_size: int,
        num_pages: int,
        page_size: int,
        block_size: int,
        cuda_graphs: bool = False,
        graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES,
        profile: bool = False,
        static_rounds: bool = False,
        use_plugins: bool | None = None,
        compile: bool = False,
    ) -> None:
        """static_rounds: run rounds from padded static buffers even without CUDA graphs (on CPU this
        exercises exactly the padding a captured round sees; tests use it). use_plugins: run KV
        injection, block attention and acceptance on the dflash:: custom ops (Triton kernels on CUDA,
        PyTorch references on CPU); None = on for CUDA when triton is installed. compile: run the round
        through torch.compile (inductor) with dynamic batch and context sizes: one compilation per
        (g, sampling flags, batch 1 or more), then fused kernels instead of hundreds of dispatches."""
        self.target = target
        self.drafter = drafter
        self.device = target.model.embed_tokens.weight.device
        self.max_batch_size = max_batch_size
        self.page_size = page_size
        self.num_pages = num_pages
        self.block_size = block_size if drafter is not None else 1
        self.profile = profile
        self.times = PhaseTimes()
        self.target_cache: PagedKVCache = target.make_cache(num_pages=num_pages, page_size=page_size)
        self.draft_cache: PagedKVCache | None = None
        self.tap_layers: list[int] | None = None
        self.feature_dim = 0
        if drafter is not None:
            self.draft_cache = drafter.make_cache(num_pages=num_pages, page_size=page_size)
            drafter.bind_target(target.model.embed_tokens.weight, target.lm_head.weight, None)
            self.tap_layers = list(drafter.config.target_layer_ids)
            self.feature_dim = drafter.config.num_target_features * drafter.config.hidden_size
            # Pending context per request row: target taps of the last round's tokens [rows + 1, B, K*D].
            # The extra last row belongs to padding rows of captured rounds.
            self.pending_feats = torch.zeros(
                max_batch_size + 1,
                self.block_size,
                self.feature_dim,
                dtype=drafter.fc.weight.dtype,
                device=self.device,
            )
        self.mask_token_id = drafter.mask_token_id if drafter is not None else 0
        self._setup_graphs(cuda_graphs, graph_batch_sizes, static_rounds)
        self.plugins: Any = None  # dflash_trt.plugins.drafting.DrafterPlugins when on
        self._greedy_accept, self._rejection_accept = greedy_accept, rejection_accept
        if use_plugins if use_plugins is not None else default_enabled(self.device):
            from dflash_trt.plugins.drafting import enable_plugins

            self.plugins, self._greedy_accept, self._rejection_accept = enable_plugins(drafter, self.device)
        self._round_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._round_core
        self.compiled = False
        self._no_recompile = False
        if compile:
            self.enable_compile()

    def _setup_graphs(
        self, cuda_graphs: bool, graph_batch_sizes: tuple[int, ...], static_rounds: bool
    ) -> None:
        """CUDA graphs (CUDA only, not for MoE targets) and the batch sizes they are captured at."""
        moe = self.target.config.moe is not None
        self.cuda_graphs = bool(cuda_graphs and self.device.type == "cuda" and not moe)
        if cuda_graphs and self.device.type == "cuda" and moe:
            log.warning("CUDA graphs are off for MoE targets (their expert routing is data dependent)")
        max_b = self.max_batch_size
        self.graph_batch_sizes = tuple(b for b in graph_batch_sizes if b <= max_b) or (max_b,)
        if self.graph_batch_sizes[-1] < max_b:
            self.graph_batch_sizes = (*self.graph_batch_sizes, max_b)
        self.static_rounds = static_rounds or self.cuda_graphs
        self._graphs: dict[tuple, Any] = {}
        self._graph_failed = False

    def enable_compile(self) -> None:
        """Run rounds through torch.compile from now on (engine/compile.py has the options). The
        first round of each new shape class compiles; `LLMEngine.warm_up` does that before traffic."""
        from dflash_trt.engine.compile import compile_round

        self._round_fn = compile_round(self._round_core, self.device)
        self.compiled = True
        self._no_recompile = False

    def freeze_compiled(self) -> None:
        """From now on a round of a shape class no graph covers runs eagerly instead of compiling:
        a compilation takes minutes on a small CPU, and serving must never stall for one (nor trip
        the engine's wedge watchdog). `LLMEngine.warm_up` compiles the usual classes first."""
        self._no_recompile = True

    def disable_compile(self) -> None:
        """Back to eager rounds (after a failed compilation)."""
        self._round_fn = self._round_core
        self.compiled = self._no_recompile = False

    # ------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.profile and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)

    def _phase_clock(self) -> float:
        """A phase boundary inside the round: with profiling, synchronise and read the clock; without
        it, nothing (so the round stays free of host calls for CUDA graphs and torch.compile)."""
        if not self.profile:
            return 0.0
        self._sync()
        return time.perf_counter()

    def _tables(self, reqs: list[Request], width: int) -> torch.Tensor:
        rows = [s.pages[:width] + [0] * (width - min(width, len(s.pages))) for s in reqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], chunks: list[tuple[int, int]]) -> list[int | None]:
        """Run prompt chunks [lo, hi) of several sequences in one padded pass.

        Writes target K/V, injects the chunk's context into the draft cache, and returns the first
        generated token for sequences whose prompt is now complete (None for the others).
        """
        t0 = time.perf_counter()
        bs = len(reqs)
        t = max(hi - lo for lo, hi in chunks)
        dev = self.device
        ids = torch.zeros(bs, t, dtype=torch.long)
        pos = torch.zeros(bs, t, dtype=torch.long)
        valid = torch.zeros(bs, t, dtype=torch.bool)
        for i, (s, (lo, hi)) in enumerate(zip(reqs, chunks)):
            ids[i, : hi - lo] = torch.tensor(s.prompt_ids[lo:hi])
            pos[i, : hi - lo] = torch.arange(lo, hi)
            pos[i, hi - lo :] = hi  # padding rows sit after the chunk, masked as keys
            valid[i, : hi - lo] = True
        ids, pos, valid = ids.to(dev), pos.to(dev), valid.to(dev)
        width = pages_for(max(hi for _, hi in chunks), self.page_size)
        tables = self._tables(reqs, width)
        kv_slots = torch.where(
            valid, slot_mapping(tables, pos.clamp(max=width * self.page_size - 1), self.page_size), 0
        )
        seq_lens = torch.tensor([hi for _, hi in chunks], device=dev)
        last = torch.tensor([hi - lo - 1 for lo, hi in chunks], device=dev)
        logits, taps = self.target(
            ids,
            pos,
            seq_lens,
            self.target_cache,
            kv_slots,
            context_index(tables, self.page_size),
            tap_layers=self.tap_layers,
            logits_index=last,
        )  # logits [bs, V]; taps [bs, t, K*D]
        if self.drafter is not None and taps is not None:
            assert self.draft_cache is not None
            drafting = self.plugins or self.drafter
            drafting.inject_context(self.draft_cache, taps[valid], pos[valid], kv_slots[valid])
        done = [hi == len(s.prompt_ids) for s, (_, hi) in zip(reqs, chunks)]
        firsts: list[int | None] = [None] * bs
        if any(done):
            temps = torch.tensor([s.temperature for s in reqs], device=dev)
            probs = logits_to_probs(
                logits,
                temps,
                torch.tensor([s.top_k for s in reqs], device=dev),
                torch.tensor([s.top_p for s in reqs], device=dev),
                needs_filter=any(s.needs_filter for s in reqs),
                any_greedy=any(s.temperature == 0 for s in reqs),
            )
            seeds = torch.tensor([s.seed for s in reqs], dtype=torch.long, device=dev)
            u = uniform(seeds, seq_lens[:, None], PURPOSE_EMIT)[:, 0]
            tokens = sample_from_probs(probs, u).tolist()
            firsts = [tok if d else None for tok, d in zip(tokens, done)]
        self._sync()
        self.times.prefill_s += time.perf_counter() - t0
        return firsts

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_round(self, reqs: list[Request], draft_len: int) -> RoundOutput:
        """One round for `reqs` (all running) with g = draft_len drafts each (0 = plain decoding)."""
        t0 = time.perf_counter()
        g = draft_len if self.drafter is not None else 0
        bq = g + 1
        bs = len(reqs)
        width = pages_for(max(s.start + min(bq, s.max_len - s.start) for s in reqs), self.page_size)
        inputs: dict[str, list[Any]] = {
            "anchors": [s.last_token for s in reqs],
            "starts": [s.start for s in reqs],
            "block_lens": [min(bq, s.max_len - s.start) for s in reqs],
            "num_pending": [s.num_pending for s in reqs],
            "rows": [s.row for s in reqs],
            "seeds": [s.seed for s in reqs],
            "temps": [s.temperature for s in reqs],
            "top_k": [s.top_k for s in reqs],
            "top_p": [s.top_p for s in reqs],
            "greedy_draft": [s.greedy_draft or s.temperature == 0 for s in reqs],
        }
        flags = _round_flags(reqs)
        tables = [s.pages for s in reqs]
        if self.static_rounds and not self._graph_failed:
            try:
                acc, emit, drafts = self._replay(inputs, tables, bs, g, width, flags)
            except Exception as exc:  # pragma: no cover - GPU only
                if not self.cuda_graphs:
                    raise
                log.warning("CUDA graph capture failed (%s); falling back to eager rounds", exc)
                self._graph_failed = True
                self._graphs.clear()
                acc, emit, drafts = self._eager(inputs, tables, g, width, flags)
        else:
            acc, emit, drafts = self._eager(inputs, tables, g, width, flags)
        out = RoundOutput(accepted=acc.tolist(), emitted=emit.tolist(), drafts=drafts.tolist())
        self.times.round_s += time.perf_counter() - t0
        self.times.rounds += 1
        return out

    def _eager(self, inputs: dict[str, list], tables: list[list[int]], g: int, width: int, flags: tuple):
        dev = self.device
        t = {k: torch.tensor(v, device=dev) for k, v in inputs.items()}
        rows = torch.tensor([p[:width] + [0] * (width - min(width, len(p))) for p in tables], device=dev)
        if self.compiled:  # the page width grows with the context: one graph for every width
            torch._dynamo.mark_dynamic(rows, 1)
        if not self.compiled:
            return self._round_fn(*self._round_args(t, rows), g=g, flags=flags)
        from dflash_trt.engine.compile import shape_rules

        stance = "eager_on_recompile" if self._no_recompile else "default"
        with torch.compiler.set_stance(stance), shape_rules():
            return self._round_fn(*self._round_args(t, rows), g=g, flags=flags)

    @staticmethod
    def _round_args(t: dict[str, torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The round's tensor arguments, in `_round_core`'s order."""
        return (t["anchors"], t["starts"], t["block_lens"], rows, t["num_pending"], t["rows"], t["seeds"],
                t["temps"].float(), t["top_k"], t["top_p"].float(), t["greedy_draft"])  # fmt: skip

    def _round_core(
        self,
        anchors: torch.Tensor,  # [bs] last emitted token (the block's anchor)
        starts: torch.Tensor,  # [bs] anchor positions (= tokens in the target cache)
        block_lens: torch.Tensor,  # [bs] B_i <= g + 1
        tables: torch.Tensor,  # [bs, W] block tables, padded with page 0
        num_pending: torch.Tensor,  # [bs] valid rows of each request's pending context
        rows: torch.Tensor,  # [bs] each request's row in the per-request buffers (self.pending_feats)
        seeds: torch.Tensor,  # [bs] int64
        temps: torch.Tensor,  # [bs]
        top_k: torch.Tensor,  # [bs]
        top_p: torch.Tensor,  # [bs]
        greedy_draft: torch.Tensor,  # [bs] bool: propose argmax drafts
        *,
        g: int,
        flags: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round as four named steps: inject, draft, verify, accept. Pure tensor code (no host
        reads) so that torch.compile and CUDA graphs can take it whole."""
        bs, dev = anchors.shape[0], anchors.device
        ctx_idx = context_index(tables, self.page_size)  # [bs, W * P]
        cap = tables.shape[1] * self.page_size - 1  # last position the tables cover
        block_pos = starts[:, None] + torch.arange(g + 1, device=dev)  # [bs, Bq]
        sampling = _Sampling(seeds, temps, top_k, top_p, greedy_draft, flags)
        t_draft = self._phase_clock()
        drafts = torch.zeros(bs, g, dtype=torch.long, device=dev)
        q_probs = None
        if self.drafter is not None:
            self._inject(tables, starts, num_pending, rows, cap)
            if g > 0:
                drafts, q_probs = self._draft(anchors, block_pos, block_lens, ctx_idx, sampling)
        t_verify = self._phase_clock()
        logits = self._verify(anchors, drafts, block_pos, block_lens, starts, tables, ctx_idx, rows, cap)
        t_accept = self._phase_clock()
        acc, emit = self._accept(drafts, q_probs, logits, block_pos, block_lens, sampling)
        if self.profile:
            t_end = self._phase_clock()
            self.times.draft_s += t_verify - t_draft
            self.times.verify_s += t_accept - t_verify
            self.times.accept_s += t_end - t_accept
        return acc, emit, drafts

    def _inject(
        self,
        tables: torch.Tensor,
        starts: torch.Tensor,
        num_pending: torch.Tensor,
        rows: torch.Tensor,
        cap: int,
    ) -> None:
        """KV injection: the previous round's committed tokens (their target taps, kept in
        pending_feats) become draft-cache context. Rows >= num_pending go to the padding page."""
        assert self.draft_cache is not None and self.drafter is not None
        bs, w = starts.shape[0], self.pending_feats.shape[1]
        r = torch.arange(w, device=starts.device)
        ctx_pos = starts[:, None] - num_pending[:, None] + r  # [bs, w]
        ctx_ok = r[None, :] < num_pending[:, None]
        ctx_slots = torch.where(ctx_ok, slot_mapping(tables, ctx_pos.clamp(0, cap), self.page_size), 0)
        feats = self.pending_feats[rows]  # [bs, w, K*D]
        (self.plugins or self.drafter).inject_context(
            self.draft_cache,
            feats.reshape(bs * w, -1),
            ctx_pos.clamp(min=0).reshape(-1),
            ctx_slots.reshape(-1),
        )

    def _draft(
        self,
        anchors: torch.Tensor,
        block_pos: torch.Tensor,
        block_lens: torch.Tensor,
        ctx_idx: torch.Tensor,
        sampling: _Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One non-causal block pass proposes g drafts per sequence -> (drafts [bs, g], q [bs, g, V]
        or None when every request is greedy)."""
        assert self.draft_cache is not None and self.drafter is not None
        bs, bq = block_pos.shape
        g = bq - 1
        masks = torch.full((bs, g), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block = torch.cat([anchors[:, None], masks], dim=1)  # [bs, Bq]: the anchor, then g mask tokens
        ctx_lens = block_pos[:, 0].contiguous()  # the anchors' positions; kernels index it flat
        hidden = (self.plugins or self.drafter).forward_block(
            self.draft_cache, self.drafter.embed_block(block), block_pos, ctx_idx, ctx_lens, block_lens
        )  # [bs, Bq, D]
        # A copy, not a view of rows 1.. (a view's reshape would depend on whether bs is 1).
        d_logits = self.drafter.compute_logits(hidden[:, 1:].clone(memory_format=torch.contiguous_format))
        argmax = d_logits.argmax(dim=-1)
        if sampling.all_greedy:
            return argmax, None
        vocab = d_logits.shape[-1]
        q_probs = sampling.probs(d_logits.reshape(bs * g, vocab), per_row=g).reshape(bs, g, vocab)
        u = uniform(sampling.seeds, block_pos[:, 1:], PURPOSE_DRAFT)  # [bs, g]
        sampled = sample_from_probs(q_probs.reshape(bs * g, vocab), u.reshape(-1)).reshape(bs, g)
        greedy = sampling.greedy_draft
        drafts = torch.where(greedy[:, None], argmax, sampled)
        one_hot = torch.zeros_like(q_probs).scatter_(-1, drafts[..., None], 1.0)
        return drafts, torch.where(greedy[:, None, None], one_hot, q_probs)

    def _verify(
        self,
        anchors: torch.Tensor,
        drafts: torch.Tensor,
        block_pos: torch.Tensor,
        block_lens: torch.Tensor,
        starts: torch.Tensor,
        tables: torch.Tensor,
        ctx_idx: torch.Tensor,
        rows: torch.Tensor,
        cap: int,
    ) -> torch.Tensor:
        """One target pass over [anchor, drafts] writes the B_i valid tokens' K/V and keeps the layer
        taps as the next round's pending context -> logits [bs, Bq, V]."""
        bq = block_pos.shape[1]
        tokens = torch.cat([anchors[:, None], drafts], dim=1)  # [bs, Bq]
        blk_valid = torch.arange(bq, device=anchors.device)[None, :] < block_lens[:, None]  # [bs, Bq]
        kv_slots = torch.where(blk_valid, slot_mapping(tables, block_pos.clamp(max=cap), self.page_size), 0)
        logits, taps = self.target(
            tokens,
            block_pos,
            starts + block_lens,
            self.target_cache,
            kv_slots,
            ctx_idx,
            tap_layers=self.tap_layers,
        )  # logits [bs, Bq, V]; taps [bs, Bq, K*D]
        if taps is not None:
            self.pending_feats[:, :bq].index_copy_(0, rows, taps.to(self.pending_feats.dtype))
        return logits

    def _accept(
        self,
        drafts: torch.Tensor,
        q_probs: torch.Tensor | None,
        logits: torch.Tensor,
        block_pos: torch.Tensor,
        block_lens: torch.Tensor,
        sampling: _Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy or lossless rejection sampling -> (accepted drafts [bs], emitted token [bs])."""
        bs, bq, vocab = logits.shape
        g = bq - 1
        d_valid = torch.arange(1, bq, device=drafts.device)[None, :] < block_lens[:, None]  # [bs, g]
        if sampling.all_greedy:
            return self._greedy_accept(drafts, logits, d_valid)
        p = sampling.probs(logits.reshape(bs * bq, vocab), per_row=bq).reshape(bs, bq, vocab)
        if q_probs is None:
            q_probs = p.new_zeros(bs, g, vocab)
        return self._rejection_accept(
            drafts,
            q_probs,
            p,
            uniform(sampling.seeds, block_pos[:, 1:], PURPOSE_ACCEPT),
            uniform(sampling.seeds, block_pos + 1, PURPOSE_EMIT),
            d_valid,
        )

    # --- static rounds and CUDA graphs -----------------------------------------------------------
    def _replay(self, inputs, tables, bs, g, width, flags):
        """Pad the batch to the graph ladder and the pages to a power of two, then replay."""
        bs_pad = next(b for b in self.graph_batch_sizes if b >= bs)
        w_pad = 1 << max(0, (width - 1).bit_length())
        w_pad = min(w_pad, self.num_pages - 1)
        key = (bs_pad, g, w_pad, flags)
        graph = self._graphs.get(key)
        if graph is None:
            graph = _StaticRound(self, bs_pad, g, w_pad, flags, capture=self.cuda_graphs)
            self._graphs[key] = graph
        return graph.run(inputs, tables, bs)


class _StaticRound:
    """Static input buffers for one (padded batch, g, pages, flags) shape, and the copy-in / run /
    copy-out protocol. With `capture` (CUDA) the round is recorded once as a CUDA graph and
    replayed; without it the same buffers are run eagerly (CPU tests of the padding)."""

    def __init__(
        self,
        runner: ModelRunner,
        bs: int,
        g: int,
        width: int,
        flags: tuple[bool, bool, bool],
        *,
        capture: bool,
    ):
        dev = runner.device
        self.runner, self.bs, self.g, self.width, self.flags = runner, bs, g, width, flags
        self.capture = capture
        i64 = torch.long
        self.buf = {
            "anchors": torch.zeros(bs, dtype=i64, device=dev),
            "starts": torch.ones(bs, dtype=i64, device=dev),  # padding rows: one garbage token at position 0
            "block_lens": torch.ones(bs, dtype=i64, device=dev),
            "tables": torch.zeros(bs, width, dtype=i64, device=dev),
            "num_pending": torch.zeros(bs, dtype=i64, device=dev),
            "rows": torch.zeros(bs, dtype=i64, device=dev),
            "seeds": torch.zeros(bs, dtype=i64, device=dev),
            "temps": torch.zeros(bs, dtype=torch.float32, device=dev),
            "top_k": torch.zeros(bs, dtype=i64, device=dev),
            "top_p": torch.ones(bs, dtype=torch.float32, device=dev),
            "greedy_draft": torch.ones(bs, dtype=torch.bool, device=dev),
        }
        self._fill_padding()
        if capture:  # pragma: no cover - GPU only
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm up (allocations, autotuning) outside the graph
                runner._round_core(**self._args(), g=g, flags=flags)
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = runner._round_core(**self._args(), g=g, flags=flags)

    def _args(self) -> dict[str, torch.Tensor]:
        return dict(self.buf)

    def _fill_padding(self) -> None:
        self.buf["starts"].fill_(1)
        self.buf["block_lens"].fill_(1)
        self.buf["num_pending"].zero_()
        self.buf["tables"].zero_()
        self.buf["rows"].fill_(self.runner.max_batch_size)  # the spare pending row

    def run(self, inputs: dict[str, list], tables: list[list[int]], bs: int):
        dev = self.runner.device
        self._fill_padding()
        for name, values in inputs.items():
            src = torch.tensor(values, device=dev, dtype=self.buf[name].dtype)
            self.buf[name][:bs].copy_(src)
        rows = [p[: self.width] + [0] * (self.width - min(self.width, len(p))) for p in tables]
        self.buf["tables"][:bs].copy_(torch.tensor(rows, dtype=torch.long, device=dev))
        if self.capture:  # pragma: no cover - GPU only
            self.graph.replay()
            acc, emit, drafts = self.out
        else:
            acc, emit, drafts = self.runner._round_core(**self._args(), g=self.g, flags=self.flags)
        return acc[:bs], emit[:bs], drafts[:bs]
