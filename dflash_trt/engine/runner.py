# SPDX-License-Identifier: Apache-2.0
"""Model runner: batched prefill and one DFlash round for every running sequence.

A round, for bs sequences at anchor positions start_i with block length B_i <= Bq = g + 1:
  1. inject the pending context (target features of the previous round's committed tokens) into
     the draft cache — always, even when this round does not draft, so the draft cache never
     falls behind;
  2. draft g tokens per sequence in one block pass (block positions >= B_i hidden, which reproduces a
     block of size B_i exactly); a DFlash 2 drafter's candidate selector walks its top-k candidates
     instead of taking each slot's argmax;
  3. verify [anchor, drafts] with the target in one pass, writing K/V for the B_i valid tokens and
     keeping the layer taps as the next round's pending context;
  4. accept on device (greedy or lossless rejection sampling, DFlash 2's with q over the selector's
     candidates; randomness keyed by position).
The host reads back only (accepted, emitted, overturned, drafts, ...) as one tensor: one synchronisation
per round.

A DDTree round (tree_budget N > 0; spec/tree.py) drafts the same way, then:
  2b. builds each request's tree of N drafted nodes from the drafter's distributions (depth <= B_i - 1);
  3.  verifies the N + 1 nodes in one target pass under the ancestor-only mask, their K/V written to
      the scratch slots of cache columns start .. start + N (the scheduler reserves them);
  4.  picks the target's token at every node (argmax, or a sample keyed by the node's position) and
      walks the accepted path;
  5.  commits: the path's K/V move to the slots of positions start .. start + a (compaction), and the
      path's layer taps become the next round's pending context.

Every tensor of the round has a static shape given (bs, g, tree budget, context pages), so on CUDA
the round is captured once per (padded batch size, g, budget, page bucket) and replayed from static
buffers. Padding rows point at page 0, which no sequence owns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_trt.engine.compile import PREFILL, ROUND, Core, RoundCache
from dflash_trt.layers.kv_cache import PagedKVCache, context_index, pages_for, slot_mapping
from dflash_trt.plugins import default_enabled
from dflash_trt.spec import native_tree, native_uniform
from dflash_trt.spec.accept import greedy_accept, rejection_accept, rejection_accept_candidates
from dflash_trt.spec.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_EMIT,
    logits_to_probs,
    sample_from_probs,
    uniform,
)
from dflash_trt.spec.selector import Proposal, WalkFn, propose, selector_walk
from dflash_trt.spec.tree import (
    DraftTree,
    TreeWalk,
    build_tree,
    build_tree_host,
    build_tree_native,
    commit_slots,
    gather_path,
    target_tokens,
    tree_positions,
    walk_tree,
)

if TYPE_CHECKING:
    from dflash_trt.engine.request import Request
    from dflash_trt.models.decoder import NativeTarget
    from dflash_trt.models.drafter import DFlashDrafter

log = logging.getLogger(__name__)

# Padded batch sizes for captured rounds; a batch replays the smallest graph that fits.
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Eager CPU rounds build DDTrees on the host (heap, `build_tree_host`) up to this many nodes per
# batch: cheaper than the batched builder's per-depth dispatches there (bench/README.md, DDTree).
HOST_TREE_MAX_NODES = 256


@dataclass
class RoundOutput:
    accepted: list[int]  # drafts accepted per sequence (before length/stop truncation)
    emitted: list[int]  # the target's token after the accepted drafts
    drafts: list[list[int]]  # g tokens per sequence: the proposals (linear), the accepted path's (tree)
    drafted: list[int]  # draft tokens proposed per sequence (linear: B_i - 1; tree: its drafted nodes)
    path: list[list[int]]  # node index at depth 0..g along the accepted path (the chain: 0..g)
    overturned: list[int]  # DFlash 2: valid draft slots whose selector pick is not the drafter's argmax
    tree_budget: int = 0  # the round's DDTree budget (0 = linear DFlash)


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
class _Drafted:
    """A round's drafts and what acceptance needs to judge them."""

    tokens: torch.Tensor  # [bs, g]
    q: torch.Tensor | None = None  # [bs, g, V] the draft distribution (v1, sampling batches)
    proposal: Proposal | None = None  # DFlash 2: q over each slot's candidates, the overturned picks


@dataclass
class PhaseTimes:
    """Wall time per phase, accumulated (seconds). Only synchronised when profiling is on."""

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    round_s: float = 0.0
    rounds: int = 0


def round_flags(reqs: list[Request]) -> tuple[bool, bool, bool]:
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
        compile_dir: str | None = None,
        trees: bool = False,
    ) -> None:
        """static_rounds: run rounds from padded static buffers even without CUDA graphs (on CPU this
        exercises exactly the padding a captured round sees; tests use it). use_plugins: run KV
        injection, block attention and acceptance on the dflash:: custom ops (Triton kernels on CUDA,
        PyTorch references on CPU); None = on for CUDA when triton is installed. compile: run the round
        through torch.compile (inductor) with dynamic batch and context sizes: one compilation per
        (g, tree budget, sampling flags, batch 1 or more), then fused kernels instead of hundreds of
        dispatches. compile_dir: where compiled rounds are saved and looked for (engine/compile.py);
        None keeps them in memory only. trees: rounds may verify DDTrees (on CPU their trees then come
        from dflash_tree::best_first, built at start-up where it can be: spec/native_tree.py)."""
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
            head = target.lm_head
            head_weight = head.weight if head.packed is None else head.packed
            drafter.bind_target(target.model.embed_tokens.weight, head_weight, head.bias)
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
        # sampled rounds' uniforms from dflash_rng::uniform on CPU (spec/native_uniform.py): same values
        self.native_uniform = self.device.type == "cpu" and native_uniform.available()
        # DDTree rounds' trees from dflash_tree::best_first on CPU (spec/native_tree.py): eager or compiled
        self.native_tree = trees and self.device.type == "cpu" and native_tree.available()
        self._setup_graphs(cuda_graphs, graph_batch_sizes, static_rounds)
        self.plugins: Any = None  # dflash_trt.plugins.drafting.DrafterPlugins when on
        self._greedy_accept, self._rejection_accept = greedy_accept, rejection_accept
        # DFlash 2 (drafter.selector): the walk, and acceptance with q over the candidates
        self._walk: WalkFn = selector_walk
        self._candidate_accept = rejection_accept_candidates
        if use_plugins if use_plugins is not None else default_enabled(self.device):
            from dflash_trt.plugins import drafting

            self.plugins, self._greedy_accept, self._rejection_accept = drafting.enable_plugins(
                drafter, self.device
            )
            if self.plugins is not None:
                self._walk = drafting.selector_walk
                self._candidate_accept = drafting.rejection_accept_candidates
        self.rounds: RoundCache | None = None  # compiled rounds per shape class, when compiling
        # whether a prefill without a compiled pass compiles one (the warm-up compiles the rounds first)
        self.compile_prefill = True
        self.compile_dir = compile_dir
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

    @property
    def compiled(self) -> bool:
        return self.rounds is not None

    def enable_compile(self) -> None:
        """Run rounds compiled from now on (engine/compile.py): the first round of each shape class
        loads its saved compilation or compiles it; `LLMEngine.warm_up` does that before traffic."""
        from dflash_trt.engine.compile import ROUNDS_DIR, round_fingerprint

        directory = None
        if self.compile_dir is not None:
            directory = Path(self.compile_dir) / ROUNDS_DIR / round_fingerprint(self._compile_facts())
        cores = {
            ROUND: Core(self._round_core, dynamic=((3, 1),)),  # the tables' page width
            # the chunk's length (ids, pos, valid) and the tables' page width
            PREFILL: Core(self._prefill_core, dynamic=((0, 1), (1, 1), (2, 1), (3, 1))),
        }
        self.rounds = RoundCache(cores, directory)

    def _compile_facts(self) -> dict[str, Any]:
        """What a compiled round depends on besides the source code (engine/compile.py)."""
        return {
            "device": self.device.type,
            "dtype": str(self.target.model.embed_tokens.weight.dtype),
            "target": repr(self.target.config),
            "drafter": None if self.drafter is None else repr(self.drafter.config),
            "sizes": (self.max_batch_size, self.num_pages, self.page_size, self.block_size),
            "plugins": self.plugins is not None,
            # which linears run on packed fp32 weights (3-D): the switch DFLASH_TRT_CPU_GEMM changes them
            "packed_f32": sum(
                b.dim() == 3 for m in (self.target, self.drafter) if m is not None for b in m.buffers()
            ),
            # whether sampled rounds hash their uniforms in dflash_rng::uniform: DFLASH_TRT_CPU_UNIFORM
            "native_uniform": self.native_uniform,
            # whether tree rounds build their trees in dflash_tree::best_first: DFLASH_TRT_CPU_TREE
            "native_tree": self.native_tree,
            # which attention modules read the paged caches in place: DFLASH_TRT_CPU_ATTENTION changes them
            "paged_attention": sum(
                bool(getattr(a, "paged_kernel", False))
                for m in (self.target, self.drafter)
                if m is not None
                for a in m.modules()
            ),
        }

    def freeze_compiled(self) -> None:
        """From now on a round of a shape class no compiled round covers runs eagerly instead of
        compiling: a compilation takes minutes on a small CPU, and serving must never stall for one
        (nor trip the engine's wedge watchdog). `LLMEngine.warm_up` compiles the usual classes first."""
        if self.rounds is not None:
            self.rounds.frozen = True

    def disable_compile(self) -> None:
        """Back to eager rounds (after a failed compilation); CUDA graphs are captured again from them."""
        self.rounds = None
        self._graphs.clear()
        self._graph_failed = False

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
        t = max(2, *(hi - lo for lo, hi in chunks))  # a compiled prefill guards on chunks of 2 or more
        dev = self.device
        ids = torch.zeros(bs, t, dtype=torch.long)
        pos = torch.zeros(bs, t, dtype=torch.long)
        valid = torch.zeros(bs, t, dtype=torch.bool)
        for i, (s, (lo, hi)) in enumerate(zip(reqs, chunks)):
            ids[i, : hi - lo] = torch.tensor(s.prompt_ids[lo:hi])
            pos[i, : hi - lo] = torch.arange(lo, hi)
            pos[i, hi - lo :] = hi  # padding rows sit after the chunk, masked as keys
            valid[i, : hi - lo] = True
        width = pages_for(max(hi for _, hi in chunks), self.page_size)
        seq_lens = torch.tensor([hi for _, hi in chunks], device=dev)
        last = torch.tensor([hi - lo - 1 for lo, hi in chunks], device=dev)
        args = (ids.to(dev), pos.to(dev), valid.to(dev), self._tables(reqs, width), seq_lens, last)
        if self.rounds is None:
            logits = self._prefill_core(*args)
        else:
            logits = self._compiled_round(self.rounds, args, {}, kind=PREFILL, compile=self.compile_prefill)
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
            u = uniform(seeds, seq_lens[:, None], PURPOSE_EMIT, native=self.native_uniform)[:, 0]
            tokens = sample_from_probs(probs, u).tolist()
            firsts = [tok if d else None for tok, d in zip(tokens, done)]
        self._sync()
        self.times.prefill_s += time.perf_counter() - t0
        return firsts

    def _prefill_core(
        self,
        ids: torch.Tensor,  # [bs, t] the chunks' tokens, padded
        pos: torch.Tensor,  # [bs, t] their positions (padding: just past the chunk)
        valid: torch.Tensor,  # [bs, t] bool: real tokens
        tables: torch.Tensor,  # [bs, W] block tables
        seq_lens: torch.Tensor,  # [bs] tokens in the cache after the chunk
        last: torch.Tensor,  # [bs] index of each chunk's last token
    ) -> torch.Tensor:
        """The prompt chunks' pass: writes the target's K/V, injects the chunks' context into the
        draft cache and returns the logits at each chunk's last token [bs, V]. Pure tensor code with
        no data-dependent shapes, so that it compiles (for every chunk length in one graph):
        padding tokens write their K/V, target and draft, to slot 0 of the padding page, which no
        sequence reads."""
        cap = tables.shape[1] * self.page_size - 1
        kv_slots = torch.where(valid, slot_mapping(tables, pos.clamp(max=cap), self.page_size), 0)
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
            drafting.inject_context(self.draft_cache, taps.flatten(0, 1), pos.flatten(), kv_slots.flatten())
        return logits

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_round(self, reqs: list[Request], draft_len: int, tree_budget: int = 0) -> RoundOutput:
        """One round for `reqs` (all running) with g = draft_len drafts each (0 = plain decoding);
        tree_budget > 0 verifies a DDTree of that many drafted nodes per request instead of the chain."""
        t0 = time.perf_counter()
        g = draft_len if self.drafter is not None else 0
        budget = tree_budget if g > 0 else 0
        bq = g + 1
        bs = len(reqs)
        block_lens = [min(bq, s.max_len - s.start) for s in reqs]
        # cache columns the round writes past each anchor: the block, or every node of the tree
        spans = [budget + 1] * bs if budget else block_lens
        self._check_scratch(reqs, spans)
        width = pages_for(max(s.start + n for s, n in zip(reqs, spans)), self.page_size)
        inputs: dict[str, list[Any]] = {
            "anchors": [s.last_token for s in reqs],
            "starts": [s.start for s in reqs],
            "block_lens": block_lens,
            "num_pending": [s.num_pending for s in reqs],
            "rows": [s.row for s in reqs],
            "seeds": [s.seed for s in reqs],
            "temps": [s.temperature for s in reqs],
            "top_k": [s.top_k for s in reqs],
            "top_p": [s.top_p for s in reqs],
            "greedy_draft": [s.greedy_draft or s.temperature == 0 for s in reqs],
        }
        shape = RoundShape(g, budget, round_flags(reqs))
        tables = [s.pages for s in reqs]
        if self.static_rounds and not self._graph_failed:
            try:
                stacked = self._replay(inputs, tables, bs, width, shape)
            except Exception as exc:  # pragma: no cover - GPU only
                if not self.cuda_graphs or (self.rounds is not None and not self.rounds.frozen):
                    raise  # or a compilation failed: the warm-up's caller turns compiling off instead
                log.warning("CUDA graph capture failed (%s); falling back to eager rounds", exc)
                self._graph_failed = True
                self._graphs.clear()
                stacked = self._eager(inputs, tables, width, shape)
        else:
            stacked = self._eager(inputs, tables, width, shape)
        out = _unstack(stacked.tolist(), g, budget)  # the round's one read-back
        self.times.round_s += time.perf_counter() - t0
        self.times.rounds += 1
        return out

    def _check_scratch(self, reqs: list[Request], spans: list[int]) -> None:
        """A round writes K/V to cache columns start .. start + span - 1 of each request: they must be
        its own pages (the scheduler reserves the tree's scratch columns). Never write past them."""
        for s, n in zip(reqs, spans):
            if s.start + n > len(s.pages) * self.page_size:
                raise RuntimeError(
                    f"request {s.request_id}: a round needs cache columns up to {s.start + n} but it holds "
                    f"{len(s.pages)} pages of {self.page_size} (the scheduler reserves the tree's scratch)"
                )

    def _eager(self, inputs: dict[str, list], tables: list[list[int]], width: int, shape: RoundShape):
        dev = self.device
        t = {k: torch.tensor(v, device=dev) for k, v in inputs.items()}
        rows = torch.tensor([p[:width] + [0] * (width - min(width, len(p))) for p in tables], device=dev)
        args = self._round_args(t, rows)
        if self.rounds is None:
            return self._round_core(*args, **shape.kwargs())
        return self._compiled_round(self.rounds, args, shape.kwargs())

    def _compiled_round(
        self,
        rounds: RoundCache,
        args: tuple[torch.Tensor, ...],
        kwargs: dict[str, Any],
        kind: str = ROUND,
        *,
        compile: bool = True,
    ):
        """The round (or, kind="prefill", the prefill pass) through its shape class's compiled code,
        or eagerly where there is none. A loaded compilation whose guards refuse the arguments (made
        for other sizes) is never run: it is dropped and compiled again (before the engine is frozen)
        or the call runs eagerly. compile=False: load a saved compilation, never compile one."""
        from dflash_trt.engine.compile import is_guard_failure, shape_rules

        rounds.refresh()
        with shape_rules():
            for _ in range(2):
                fn = rounds.get(args, kwargs, kind, compile=compile)
                if fn is None:
                    break
                try:
                    return fn(self, *args, **kwargs)
                except RuntimeError as exc:
                    if not is_guard_failure(exc):
                        raise
                    log.warning(
                        "a compiled %s refused this batch (%s)", kind, str(exc).splitlines()[-1][:200]
                    )
                    rounds.forget(args, kwargs, kind)
        return rounds.core(kind)(*args, **kwargs)

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
        budget: int = 0,
    ) -> torch.Tensor:
        """One round as named steps: inject, draft, verify, accept (a DDTree round: inject, draft, build
        the tree, verify it, walk it, commit the path). Pure tensor code (no host reads) so that
        torch.compile and CUDA graphs can take it whole. Returns the results stacked for one read-back
        ([bs, 2g + 5]: see `_unstack`)."""
        ctx_idx = context_index(tables, self.page_size)  # [bs, W * P]
        cap = tables.shape[1] * self.page_size - 1  # last position the tables cover
        block_pos = starts[:, None] + torch.arange(g + 1, device=anchors.device)  # [bs, Bq]
        sampling = _Sampling(seeds, temps, top_k, top_p, greedy_draft, flags)
        t_draft = self._phase_clock()
        if self.drafter is not None:
            self._inject(tables, starts, num_pending, rows, cap)
        ctx = _RoundContext(anchors, starts, block_pos, block_lens, tables, ctx_idx, rows, cap, sampling)
        if budget > 0 and g > 0:
            return self._tree_steps(ctx, budget, t_draft)
        return self._chain_steps(ctx, t_draft)

    def _chain_steps(self, c: _RoundContext, t_draft: float) -> torch.Tensor:
        """Linear DFlash (or plain decoding, g = 0): draft the chain, verify it, accept a prefix."""
        bs, bq = c.block_pos.shape
        g, dev = bq - 1, c.anchors.device
        drafted = _Drafted(torch.zeros(bs, g, dtype=torch.long, device=dev))
        d_valid = torch.arange(1, bq, device=dev)[None, :] < c.block_lens[:, None]  # [bs, g] real slots
        overturned = torch.zeros(bs, dtype=torch.long, device=dev)
        if self.drafter is not None and g > 0:
            drafted = self._draft(c.anchors, c.block_pos, c.block_lens, c.ctx_idx, c.sampling)
            if drafted.proposal is not None:
                overturned = (drafted.proposal.overturned & d_valid).sum(dim=1)
        t_verify = self._phase_clock()
        drafts = drafted.tokens
        logits = self._verify(c.anchors, drafts, c.block_pos, c.block_lens, c.starts, c.tables, c.ctx_idx,
                              c.rows, c.cap)  # fmt: skip
        t_accept = self._phase_clock()
        acc, emit = self._accept(drafted, logits, c.block_pos, d_valid, c.sampling)
        self._add_phases(t_draft, t_verify, t_accept)
        chain = torch.arange(bq, device=dev).expand(bs, bq)  # node j sits at depth j
        return _stack(acc, emit, c.block_lens - 1, overturned, drafts, chain)

    def _tree_steps(self, c: _RoundContext, budget: int, t_draft: float) -> torch.Tensor:
        """DDTree: draft, build each request's tree of `budget` nodes, verify it, walk it, commit."""
        g = c.block_pos.shape[1] - 1
        d_logits = self._draft_logits(c.anchors, c.block_pos, c.block_lens, c.ctx_idx)  # [bs, g, V]
        if self.native_tree:
            build = build_tree_native
        else:
            build = build_tree_host if self._host_trees(c.anchors.shape[0] * budget) else build_tree
        tree = build(d_logits, c.anchors, budget=budget, max_depth=c.block_lens - 1)
        t_verify = self._phase_clock()
        logits, taps, node_slots = self._verify_tree(tree, c.starts, c.tables, c.ctx_idx, c.cap)
        t_accept = self._phase_clock()
        walk = self._accept_tree(tree, logits, c.starts, c.sampling, g)
        self._commit_tree(walk, node_slots, taps, c.starts, c.tables, c.rows, c.cap)
        self._add_phases(t_draft, t_verify, t_accept)
        drafted = tree.valid.sum(dim=1) - 1  # [bs] real nodes below the root
        none = torch.zeros_like(drafted)  # trees are never built from a DFlash 2 selector (refused)
        return _stack(walk.accepted, walk.emitted, drafted, none, walk.path_tokens, walk.path_nodes)

    def _host_trees(self, nodes: int) -> bool:
        """Build trees with the host's heap: eager CPU rounds of at most HOST_TREE_MAX_NODES nodes.
        Compiled and static (graph) rounds keep the batched builder: no host reads inside them."""
        return (
            self.device.type == "cpu"
            and not (self.compiled or self.static_rounds)
            and nodes <= HOST_TREE_MAX_NODES
        )

    def _add_phases(self, t_draft: float, t_verify: float, t_accept: float) -> None:
        if self.profile:
            t_end = self._phase_clock()
            self.times.draft_s += t_verify - t_draft
            self.times.verify_s += t_accept - t_verify
            self.times.accept_s += t_end - t_accept

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

    def _draft_logits(
        self, anchors: torch.Tensor, block_pos: torch.Tensor, block_lens: torch.Tensor, ctx_idx: torch.Tensor
    ) -> torch.Tensor:
        """The drafter's logits [bs, g, V] for depths 1..g (raw: no temperature)."""
        assert self.drafter is not None
        return self.drafter.compute_logits(self._draft_hidden(anchors, block_pos, block_lens, ctx_idx))

    def _draft_hidden(
        self, anchors: torch.Tensor, block_pos: torch.Tensor, block_lens: torch.Tensor, ctx_idx: torch.Tensor
    ) -> torch.Tensor:
        """One non-causal block pass over [anchor, g masks] -> the final hidden states [bs, g, D] of
        depths 1..g."""
        assert self.draft_cache is not None and self.drafter is not None
        bs, bq = block_pos.shape
        masks = torch.full((bs, bq - 1), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block = torch.cat([anchors[:, None], masks], dim=1)  # [bs, Bq]: the anchor, then g mask tokens
        ctx_lens = block_pos[:, 0].contiguous()  # the anchors' positions; kernels index it flat
        hidden = (self.plugins or self.drafter).forward_block(
            self.draft_cache, self.drafter.embed_block(block), block_pos, ctx_idx, ctx_lens, block_lens
        )  # [bs, Bq, D]
        # A copy, not a view of rows 1.. (a view's reshape would depend on whether bs is 1).
        return hidden[:, 1:].clone(memory_format=torch.contiguous_format)

    def _draft(
        self,
        anchors: torch.Tensor,
        block_pos: torch.Tensor,
        block_lens: torch.Tensor,
        ctx_idx: torch.Tensor,
        sampling: _Sampling,
    ) -> _Drafted:
        """One non-causal block pass proposes g drafts per sequence (drafts [bs, g]; q [bs, g, V], None
        when every request is greedy). A DFlash 2 drafter's selector proposes instead (`_select`)."""
        assert self.drafter is not None
        bs, bq = block_pos.shape
        g = bq - 1
        slots = self._draft_hidden(anchors, block_pos, block_lens, ctx_idx)  # [bs, g, D]
        d_logits = self.drafter.compute_logits(slots)  # [bs, g, V]
        if self.drafter.selector is not None:
            return self._select(anchors, block_pos, slots, d_logits, sampling)
        argmax = d_logits.argmax(dim=-1)
        if sampling.all_greedy:
            return _Drafted(argmax)
        vocab = d_logits.shape[-1]
        q_probs = sampling.probs(d_logits.reshape(bs * g, vocab), per_row=g).reshape(bs, g, vocab)
        u = uniform(sampling.seeds, block_pos[:, 1:], PURPOSE_DRAFT, native=self.native_uniform)
        sampled = sample_from_probs(q_probs.reshape(bs * g, vocab), u.reshape(-1)).reshape(bs, g)
        greedy = sampling.greedy_draft
        drafts = torch.where(greedy[:, None], argmax, sampled)
        one_hot = torch.zeros_like(q_probs).scatter_(-1, drafts[..., None], 1.0)
        return _Drafted(drafts, q=torch.where(greedy[:, None, None], one_hot, q_probs))

    def _select(
        self,
        anchors: torch.Tensor,
        block_pos: torch.Tensor,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        sampling: _Sampling,
    ) -> _Drafted:
        """DFlash 2: the selector's walk over each slot's top-k candidates (hidden [bs, g, D], logits
        [bs, g, V]) proposes the drafts. Greedy rows (T = 0 or greedy drafts) take the best
        score, sampled rows draw from softmax(score / T) with the slot's PURPOSE_DRAFT uniform: exactly the
        reference loop's rule, batched."""
        assert self.drafter is not None and self.drafter.selector is not None
        if sampling.all_greedy:  # no draws: skip hashing the uniforms
            u = torch.zeros(block_pos.shape[0], block_pos.shape[1] - 1, device=block_pos.device)
        else:
            u = uniform(sampling.seeds, block_pos[:, 1:], PURPOSE_DRAFT, native=self.native_uniform)
        proposal = propose(
            hidden=hidden, logits=logits, anchors=anchors, selector=self.drafter.selector,
            temperature=sampling.temps, greedy=sampling.greedy_draft, u=u, any_sampled=not sampling.all_greedy,
            walk=self._walk,
        )  # fmt: skip
        return _Drafted(proposal.drafts, proposal=proposal)

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
            paged=True,
        )  # logits [bs, Bq, V]; taps [bs, Bq, K*D]
        self._keep_pending(taps, rows)
        return logits

    def _keep_pending(self, taps: torch.Tensor | None, rows: torch.Tensor) -> None:
        """taps [bs, n, K*D] of the round's committed positions (anchor first) -> the requests' rows of
        pending_feats, injected into the draft cache next round (rows beyond the committed count are
        never read: num_pending says how many are)."""
        if taps is not None:
            # One index_put_ over (row, column), not a copy into the slice pending_feats[:, :n]: inductor
            # in torch 2.11 cannot match that slice's size against the taps' (the round failed to compile).
            cols = torch.arange(taps.shape[1], device=taps.device)
            self.pending_feats.index_put_((rows[:, None], cols[None, :]), taps.to(self.pending_feats.dtype))

    def _verify_tree(
        self, tree: DraftTree, starts: torch.Tensor, tables: torch.Tensor, ctx_idx: torch.Tensor, cap: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One target pass over every tree's N nodes under the ancestor-only mask (past context fully
        visible). Node i's K/V goes to the scratch slot of cache column start + i. Returns logits
        [bs, N, V], layer taps [bs, N, K*D] (or None) and the nodes' slots [bs, N]."""
        n1 = tree.tokens.shape[1]
        cols = starts[:, None] + torch.arange(n1, device=starts.device)  # [bs, N]
        node_slots = slot_mapping(tables, cols.clamp(max=cap), self.page_size)
        logits, taps = self.target(
            tree.tokens,
            tree_positions(starts, tree),
            starts + n1,
            self.target_cache,
            node_slots,
            ctx_idx,
            tap_layers=self.tap_layers,
            block_mask=tree.visibility,
            paged=True,
        )
        return logits, taps, node_slots

    def _accept_tree(
        self, tree: DraftTree, logits: torch.Tensor, starts: torch.Tensor, sampling: _Sampling, g: int
    ) -> TreeWalk:
        """The target's own token at every node (argmax, or a sample with the uniform of the position
        it fills), then the walk from the root along those choices."""
        all_greedy, any_greedy, needs_filter = sampling.flags
        chosen = target_tokens(
            logits, tree, starts, sampling.seeds, sampling.temps, sampling.top_k, sampling.top_p,
            all_greedy=all_greedy, any_greedy=any_greedy, needs_filter=needs_filter, native=self.native_uniform,
        )  # fmt: skip
        return walk_tree(tree, chosen, max_depth=g)

    def _commit_tree(
        self,
        walk: TreeWalk,
        node_slots: torch.Tensor,
        taps: torch.Tensor | None,
        starts: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor,
        cap: int,
    ) -> None:
        """Compaction: the accepted path's K/V move from their scratch slots to the slots of positions
        start .. start + a; the path's taps become the pending context (as the chain's would)."""
        g1 = walk.path_nodes.shape[1]
        dest = slot_mapping(
            tables, (starts[:, None] + torch.arange(g1, device=starts.device)).clamp(max=cap), self.page_size
        )  # [bs, g + 1]
        src, dst = commit_slots(walk, node_slots, dest)
        self.target_cache.copy_slots(src.reshape(-1), dst.reshape(-1))
        if taps is not None:
            self._keep_pending(gather_path(taps, walk.path_nodes), rows)

    def _accept(
        self,
        drafted: _Drafted,
        logits: torch.Tensor,
        block_pos: torch.Tensor,
        d_valid: torch.Tensor,
        sampling: _Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy or lossless rejection sampling (d_valid [bs, g]: slots inside each block; DFlash 2: q
        over the selector's candidates) -> (accepted drafts [bs], emitted token [bs])."""
        bs, bq, vocab = logits.shape
        g, drafts = bq - 1, drafted.tokens
        if sampling.all_greedy:
            return self._greedy_accept(drafts, logits, d_valid)
        p = sampling.probs(logits.reshape(bs * bq, vocab), per_row=bq).reshape(bs, bq, vocab)
        native = self.native_uniform
        u_accept = uniform(sampling.seeds, block_pos[:, 1:], PURPOSE_ACCEPT, native=native)  # [bs, g]
        u_emit = uniform(sampling.seeds, block_pos + 1, PURPOSE_EMIT, native=native)  # [bs, g + 1]
        if drafted.proposal is not None:
            cands, cand_q = drafted.proposal.candidates, drafted.proposal.cand_probs  # [bs, g, K] each
            return self._candidate_accept(drafts, cands, cand_q, p, u_accept, u_emit, d_valid)
        q_probs = drafted.q if drafted.q is not None else p.new_zeros(bs, g, vocab)
        return self._rejection_accept(drafts, q_probs, p, u_accept, u_emit, d_valid)

    # --- static rounds and CUDA graphs -----------------------------------------------------------
    def _replay(
        self, inputs: dict[str, list], tables: list[list[int]], bs: int, width: int, shape: RoundShape
    ):
        """Pad the batch to the graph ladder and the pages to a power of two, then replay."""
        bs_pad = next(b for b in self.graph_batch_sizes if b >= bs)
        w_pad = 1 << max(0, (width - 1).bit_length())
        w_pad = min(w_pad, self.num_pages - 1)
        key = (bs_pad, w_pad, shape)
        if (
            self.cuda_graphs and self.rounds is not None
        ):  # uncaptured static rounds refresh in _compiled_round
            self.rounds.refresh()  # compiled rounds of a background process, when they are ready
        graph = self._graphs.get(key)
        if graph is None or graph.stale():
            graph = _StaticRound(self, bs_pad, w_pad, shape, capture=self.cuda_graphs)
            self._graphs[key] = graph
        return graph.run(inputs, tables, bs)


@dataclass(frozen=True)
class RoundShape:
    """What makes one round's graph differ from another's besides the batch and context sizes."""

    g: int  # drafts per request (block - 1; 0 = plain decoding)
    budget: int  # DDTree nodes per request (0 = linear)
    flags: tuple[bool, bool, bool]  # the batch's sampling mode (`round_flags`)

    def kwargs(self) -> dict[str, Any]:
        return {"g": self.g, "flags": self.flags, "budget": self.budget}


@dataclass
class _RoundContext:
    """The tensors every step of a round reads (see `_round_core`'s arguments)."""

    anchors: torch.Tensor  # [bs]
    starts: torch.Tensor  # [bs]
    block_pos: torch.Tensor  # [bs, Bq] positions start .. start + g
    block_lens: torch.Tensor  # [bs]
    tables: torch.Tensor  # [bs, W]
    ctx_idx: torch.Tensor  # [bs, W * P]
    rows: torch.Tensor  # [bs]
    cap: int  # last cache column the tables cover
    sampling: _Sampling


def _stack(
    accepted: torch.Tensor,
    emitted: torch.Tensor,
    drafted: torch.Tensor,
    overturned: torch.Tensor,
    drafts: torch.Tensor,
    path: torch.Tensor,
) -> torch.Tensor:
    """[bs] x 4, drafts [bs, g], path [bs, g + 1] -> [bs, 2g + 5] long: one tensor, one read-back."""
    columns = (accepted[:, None], emitted[:, None], drafted[:, None], overturned[:, None], drafts, path)
    return torch.cat([c.long() for c in columns], dim=1)


def _unstack(rows: list[list[int]], g: int, budget: int) -> RoundOutput:
    """`_stack`'s rows (read back as lists) -> RoundOutput."""
    return RoundOutput(
        accepted=[r[0] for r in rows],
        emitted=[r[1] for r in rows],
        drafted=[r[2] for r in rows],
        overturned=[r[3] for r in rows],
        drafts=[r[4 : 4 + g] for r in rows],
        path=[r[4 + g :] for r in rows],
        tree_budget=budget,
    )


class _StaticRound:
    """Static input buffers for one (padded batch, pages, round shape), and the copy-in / run /
    copy-out protocol. With `capture` (CUDA) the round is recorded once as a CUDA graph and
    replayed; without it the same buffers are run eagerly (CPU tests of the padding).

    With compiled rounds on, what is run (and captured) is the shape class's compiled round: inductor
    fuses the round's elementwise work into a few kernels and the graph removes their launches. The
    warm-up run before the capture loads or compiles it; a class that had no compiled round then
    (frozen, or compiled later by a background process) is captured eagerly and captured again
    once its compiled round is loaded (`stale`)."""

    def __init__(self, runner: ModelRunner, bs: int, width: int, shape: RoundShape, *, capture: bool):
        dev = runner.device
        self.runner, self.bs, self.width, self.shape = runner, bs, width, shape
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
        self.compiled_fn: Any = None  # the compiled round this graph runs (None: the eager round)
        if capture:  # pragma: no cover - GPU only
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # compile, allocate and autotune outside the graph
                self._warm_call()
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._call()

    def _args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.buf.values())  # `_round_core`'s positional order

    def _warm_call(self) -> torch.Tensor:
        """Run the round once through the runner's compiled path (load or compile its class; eager
        where there is none) and remember which compiled round that was."""
        runner, kwargs = self.runner, self.shape.kwargs()
        if runner.rounds is None:
            return runner._round_core(*self._args(), **kwargs)
        out = runner._compiled_round(runner.rounds, self._args(), kwargs)
        self.compiled_fn = runner.rounds.loaded_fn(self._args(), kwargs)
        return out

    def _call(self) -> torch.Tensor:
        """The round as `_warm_call` found it: no loading, compiling or guard retries (inside a capture)."""
        if self.compiled_fn is None:
            return self.runner._round_core(*self._args(), **self.shape.kwargs())
        from dflash_trt.engine.compile import shape_rules

        with shape_rules():
            return self.compiled_fn(self.runner, *self._args(), **self.shape.kwargs())

    def stale(self) -> bool:
        """Captured eagerly, but its class now has a compiled round (loaded after the capture)."""
        rounds = self.runner.rounds
        return (
            self.capture
            and self.compiled_fn is None
            and rounds is not None
            and rounds.loaded_fn(self._args(), self.shape.kwargs()) is not None
        )

    def _fill_padding(self) -> None:
        self.buf["starts"].fill_(1)
        self.buf["block_lens"].fill_(1)
        self.buf["num_pending"].zero_()
        self.buf["tables"].zero_()
        self.buf["rows"].fill_(self.runner.max_batch_size)  # the spare pending row

    def run(self, inputs: dict[str, list], tables: list[list[int]], bs: int) -> torch.Tensor:
        dev = self.runner.device
        self._fill_padding()
        for name, values in inputs.items():
            src = torch.tensor(values, device=dev, dtype=self.buf[name].dtype)
            self.buf[name][:bs].copy_(src)
        rows = [p[: self.width] + [0] * (self.width - min(self.width, len(p))) for p in tables]
        self.buf["tables"][:bs].copy_(torch.tensor(rows, dtype=torch.long, device=dev))
        if self.capture:  # pragma: no cover - GPU only
            self.graph.replay()
            out = self.out
        else:
            out = self._warm_call()
        return out[:bs]
