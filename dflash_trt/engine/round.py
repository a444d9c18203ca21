# SPDX-License-Identifier: Apache-2.0
"""One DFlash round as a function of explicit inputs: `RoundParts` (the models, their KV caches, the
drafting backend), one `RoundInputs` (the batch, built once from the scheduled
requests) and a `RoundShape` (draft length, tree budget, sampling flags).

A chain round (`round_chain`), for bs sequences at anchor positions start_i with block length
B_i <= Bq = g + 1:
  1. draft g tokens per sequence in one block pass (block positions >= B_i hidden, which reproduces a
     block of size B_i exactly); a DFlash 2 drafter's candidate selector walks its top-k candidates
     instead of taking each slot's argmax;
  2. verify [anchor, drafts] with the target in one pass, writing K/V for the B_i valid tokens and
     keeping its layer taps;
  3. accept on device (greedy or lossless rejection sampling, DFlash 2's with q over the selector's
     candidates; randomness keyed by position);
  4. inject the committed positions (the anchor and the a accepted drafts: their taps) into the draft
     cache — always, even when the round drafts nothing, so that the draft cache never falls behind.
     Only the g + 1 positions of this round's block are projected (one a sequence in a plain round),
     not a whole block's: the injection costs what the round verifies. The emitted token's features
     come with the next round, whose anchor it is.
A DDTree round (`round_tree`, tree budget N > 0; spec/tree.py) drafts the same way, then:
  2b. builds each request's tree of N drafted nodes from the drafter's distributions (depth <= B_i - 1);
  3.  verifies the N + 1 nodes in one target pass under the ancestor-only mask, their K/V written to
      the scratch slots of cache columns start .. start + N (the scheduler reserves them);
  4.  picks the target's token at every node (argmax, or a sample keyed by the node's position) and
      walks the accepted path;
  5.  commits: the path's K/V move to the slots of positions start .. start + a (compaction), and the
      path's layer taps are injected as the chain's are.
The round returns its results stacked in one tensor (`stack`): the host reads back once per round.

Every tensor of a round has a static shape given (bs, g, tree budget, context pages), and the code has
no host reads, so torch.compile and CUDA graphs take it whole (engine/executor.py). The compiled code
traces `RoundParts.round` and `RoundParts.prefill`: the models and caches, nothing of the engine.
Padding rows point at page 0, which no sequence owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dflash_trt.engine.grammar import GuidedRound, mask_logits
from dflash_trt.layers.kv_cache import PagedKVCache, context_index, slot_mapping
from dflash_trt.spec.penalties import ANY_TOKEN, MAX_BAD_WORD_TOKENS, NO_TOKEN, ban_bad_words, penalize
from dflash_trt.spec.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_EMIT,
    logits_to_probs,
    sample_from_probs,
    uniform,
)
from dflash_trt.spec.selector import Proposal, propose
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

# a committed token's log-probability, its rank, and the most likely tokens with theirs
TokenLogprob = tuple[float, int, tuple[tuple[int, float], ...]]

if TYPE_CHECKING:
    from dflash_trt.engine.draft_backend import DraftBackend
    from dflash_trt.engine.request import Request
    from dflash_trt.models.decoder import NativeTarget
    from dflash_trt.models.drafter import DFlashDrafter


class RoundInputs(NamedTuple):
    """A round's batch: one row per request, built once (`build`), padded once for static rounds
    (engine/executor.py). The request-level extras of the sampling surface (penalties, bias, grammar
    masks, cached-prefix offsets) belong here as further [bs, ...] tensors. The field order is the
    compiled round's positional order."""

    anchors: torch.Tensor  # [bs] last emitted token (the block's anchor)
    starts: torch.Tensor  # [bs] anchor positions (= tokens in the target cache)
    block_lens: torch.Tensor  # [bs] B_i <= g + 1
    tables: torch.Tensor  # [bs, W] block tables, padded with page 0
    rows: torch.Tensor  # [bs] each request's row in the per-request buffers (RoundParts.penalties)
    seeds: torch.Tensor  # [bs] int64
    temps: torch.Tensor  # [bs] float32
    top_k: torch.Tensor  # [bs]
    top_p: torch.Tensor  # [bs] float32
    greedy_draft: torch.Tensor  # [bs] bool: propose argmax drafts
    repetition: torch.Tensor  # [bs] float32 repetition_penalty (1: off; spec/penalties.py)
    frequency: torch.Tensor  # [bs] float32 frequency_penalty
    presence: torch.Tensor  # [bs] float32 presence_penalty
    min_p: torch.Tensor  # [bs] float32

    @classmethod
    def build(
        cls, reqs: list[Request], block_lens: list[int], width: int, device: torch.device
    ) -> RoundInputs:
        """The scheduled requests' row each, their page tables padded to `width` pages."""
        return cls(
            anchors=torch.tensor([s.last_token for s in reqs], device=device),
            starts=torch.tensor([s.start for s in reqs], device=device),
            block_lens=torch.tensor(block_lens, device=device),
            tables=page_tables([s.pages for s in reqs], width, device),
            rows=torch.tensor([s.row for s in reqs], device=device),
            seeds=torch.tensor([s.seed for s in reqs], device=device),
            temps=torch.tensor([s.temperature for s in reqs], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in reqs], device=device),
            top_p=torch.tensor([s.top_p for s in reqs], dtype=torch.float32, device=device),
            greedy_draft=torch.tensor([s.greedy_draft or s.temperature == 0 for s in reqs], device=device),
            repetition=torch.tensor([s.repetition_penalty for s in reqs], dtype=torch.float32, device=device),
            frequency=torch.tensor([s.frequency_penalty for s in reqs], dtype=torch.float32, device=device),
            presence=torch.tensor([s.presence_penalty for s in reqs], dtype=torch.float32, device=device),
            min_p=torch.tensor([s.min_p for s in reqs], dtype=torch.float32, device=device),
        )


def page_tables(pages: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """Each sequence's pages, cut or padded with page 0 (which no sequence owns) to `width`: the one
    padding rule of every pass's block tables."""
    rows = [p[:width] + [0] * (width - min(width, len(p))) for p in pages]
    return torch.tensor(rows, dtype=torch.long, device=device)


# A round's compile-time sampling mode (`round_flags`): all greedy, any greedy, any top-k/top-p filter,
# any penalty/bias/min-p, any request asking for log-probabilities.
Flags = tuple[bool, bool, bool, bool, bool]
MAX_LOGPROBS = 20  # top alternatives a round reports per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class RoundShape:
    """What makes one round's graph differ from another's besides the batch and context sizes."""

    g: int  # drafts per request (block - 1; 0 = plain decoding)
    budget: int  # DDTree nodes per request (0 = linear)
    flags: Flags  # the batch's sampling mode (`round_flags`)

    def kwargs(self) -> dict[str, Any]:
        return {"g": self.g, "flags": self.flags, "budget": self.budget}


def round_flags(reqs: list[Request]) -> Flags:
    """(all greedy, any greedy, any top-k/top-p, any penalty/bias/min-p): a round's compile-time
    sampling mode. Few modes, so that compiled and captured rounds need few variants: all-greedy
    batches take the argmax path; every other batch takes the sampling path, which handles greedy rows
    exactly (one-hot distributions), with the sorting filter only when a request asks for it; the
    penalties' pass (spec/penalties.py) runs only in a batch where some request asks for it, and so do
    the log-probabilities (the fifth flag)."""
    processed = any(s.processed for s in reqs)
    logprobs = any(s.logprobs is not None for s in reqs)
    if all(s.temperature == 0 for s in reqs):
        return True, True, False, processed, logprobs
    return False, True, any(s.needs_filter for s in reqs), processed, logprobs


@dataclass
class RoundOutput:
    accepted: list[int]  # drafts accepted per sequence (before length/stop truncation)
    emitted: list[int]  # the target's token after the accepted drafts
    drafts: list[list[int]]  # g tokens per sequence: the proposals (linear), the accepted path's (tree)
    drafted: list[int]  # draft tokens proposed per sequence (linear: B_i - 1; tree: its drafted nodes)
    path: list[list[int]]  # node index at depth 0..g along the accepted path (the chain: 0..g)
    overturned: list[int]  # DFlash 2: valid draft slots whose selector pick is not the drafter's argmax
    tree_budget: int = 0  # the round's DDTree budget (0 = linear DFlash)
    # per sequence, per committed position 0..g: (logprob, rank, ((token, logprob), ...)) of the token the
    # position committed, when a request of the batch asked for log-probabilities (`token_logprobs`)
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class PhaseTimes:
    """Wall time per phase, accumulated (seconds). Only synchronised when profiling is on."""

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    round_s: float = 0.0
    rounds: int = 0


class RoundParts:
    """What a round reads and writes besides its inputs: both models, both paged KV caches, the drafting
    backend, the penalty state per request row, and the round's fixed choices (uniforms and trees
    from dflash-trt's C++ operators on CPU). `round` and `prefill` are the code the executor runs
    eagerly, captures or compiles."""

    def __init__(self, target: NativeTarget, drafter: DFlashDrafter | None, backend: DraftBackend, *,
                 max_batch_size: int, num_pages: int, page_size: int, block_size: int, native_uniform: bool = False,
                 native_tree: bool = False, profile: bool = False) -> None:  # fmt: skip
        self.target, self.drafter, self.backend = target, drafter, backend
        self.device = target.model.embed_tokens.weight.device
        self.page_size = page_size
        self.block_size = block_size if drafter is not None else 1  # the longest block a round verifies
        self.max_batch_size = max_batch_size
        self.native_uniform, self.native_tree = native_uniform, native_tree
        self.host_tree_nodes = 0  # eager CPU rounds build trees of up to this many nodes on the host
        self.profile = profile
        self.times = PhaseTimes()
        self.target_cache: PagedKVCache = target.make_cache(num_pages=num_pages, page_size=page_size)
        self.draft_cache: PagedKVCache | None = None
        self.tap_layers: list[int] | None = None
        self.mask_token_id = 0
        self.penalties: Penalties | None = None  # made for the first request with a penalty (`penalty_state`)
        # guided decoding: set by the runner for the one (eager) round whose batch holds a guided request
        self.guided: GuidedRound | None = None
        self.bitmask_words = (target.config.vocab_size + 31) // 32
        if drafter is not None:
            self._bind_drafter(drafter, num_pages=num_pages)

    def penalty_state(self) -> Penalties:
        """The per-row penalty buffers, made on first use (a vocabulary-wide row per request)."""
        if self.penalties is None:
            vocab = self.target.config.vocab_size
            self.penalties = Penalties(self.max_batch_size + 1, vocab, self.device)
        return self.penalties

    def _bind_drafter(self, drafter: DFlashDrafter, *, num_pages: int) -> None:
        self.draft_cache = drafter.make_cache(num_pages=num_pages, page_size=self.page_size)
        head = self.target.lm_head
        drafter.bind_target(self.target.model.embed_tokens.weight, head.weight if head.packed is None
                            else head.packed, head.bias)  # fmt: skip
        self.tap_layers = list(drafter.config.target_layer_ids)
        self.mask_token_id = drafter.mask_token_id

    def round(
        self,
        anchors: torch.Tensor,
        starts: torch.Tensor,
        block_lens: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor,
        seeds: torch.Tensor,
        temps: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        greedy_draft: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
        min_p: torch.Tensor,
        *,
        g: int,
        flags: Flags,
        budget: int = 0,
    ) -> torch.Tensor:
        """One round over the `RoundInputs` these tensors make (its fields, in order) -> `stack`'s
        [bs, 2g + 5] results."""
        inputs = RoundInputs(anchors, starts, block_lens, tables, rows, seeds, temps, top_k, top_p, greedy_draft,
                             repetition, frequency, presence, min_p)  # fmt: skip
        t_draft = self.phase_clock()
        if budget > 0 and g > 0:
            return round_tree(self, inputs, g, flags, budget, t_draft)
        return round_chain(self, inputs, g, flags, t_draft)

    def prefill(
        self,
        ids: torch.Tensor,  # [bs, t] the chunks' tokens, padded
        pos: torch.Tensor,  # [bs, t] their positions (padding: just past the chunk)
        valid: torch.Tensor,  # [bs, t] bool: real tokens
        tables: torch.Tensor,  # [bs, W] block tables
        seq_lens: torch.Tensor,  # [bs] tokens in the cache after the chunk
        last: torch.Tensor,  # [bs] index of each chunk's last token
    ) -> torch.Tensor:
        """The prompt chunks' pass: writes the target's K/V, injects the chunks' context into the
        draft cache and returns the logits at each chunk's last token [bs, V]. No data-dependent
        shapes, so that it compiles (for every chunk length in one graph): padding tokens write their
        K/V, target and draft, to slot 0 of the padding page, which no sequence reads."""
        return self._prefill(ids, pos, valid, tables, seq_lens, last)

    def prefill_scored(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, tables: torch.Tensor,
                       seq_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """`prefill` with the logits of every chunk position [bs, t, V] (prompt log-probabilities; eager)."""
        return self._prefill(ids, pos, valid, tables, seq_lens, None)

    def _prefill(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        cap = tables.shape[1] * self.page_size - 1
        kv_slots = torch.where(valid, slot_mapping(tables, pos.clamp(max=cap), self.page_size), 0)
        logits, taps = self.target(ids, pos, seq_lens, self.target_cache, kv_slots,
                                   context_index(tables, self.page_size), tap_layers=self.tap_layers,
                                   logits_index=last)  # fmt: skip
        if self.drafter is not None and taps is not None:
            assert self.draft_cache is not None
            self.backend.drafting.inject_context(self.draft_cache, taps.flatten(0, 1), pos.flatten(),
                                                 kv_slots.flatten())  # fmt: skip
        return logits

    def phase_clock(self) -> float:
        """A phase boundary inside the round: with profiling, synchronise and read the clock; without
        it, nothing (so the round stays free of host calls for CUDA graphs and torch.compile)."""
        if not self.profile:
            return 0.0
        self.sync()
        return time.perf_counter()

    def sync(self) -> None:
        if self.profile and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)

    def add_phases(self, t_draft: float, t_verify: float, t_accept: float) -> None:
        if self.profile:
            t_end = self.phase_clock()
            self.times.draft_s += t_verify - t_draft
            self.times.verify_s += t_accept - t_verify
            self.times.accept_s += t_end - t_accept


class Penalties:
    """Per request row (the spare last row belongs to padding): counts of the tokens generated so far,
    the tokens of the prompt or generated so far, and the request's logit bias, each [rows, V]; its bad
    words (each but its last token, right-aligned [rows, NB, W], and the last [rows, NB]) and the W latest
    tokens of its sequence [rows, W] (spec/penalties.py says what they do). A row is set when its
    request's prompt is complete (`start`) and counts every committed token after (`add`)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        w = MAX_BAD_WORD_TOKENS - 1
        self.recent = torch.full((rows, w), NO_TOKEN, dtype=torch.long, device=device)
        self.prefixes = torch.full((rows, 0, w), ANY_TOKEN, dtype=torch.long, device=device)
        self.lasts = torch.full((rows, 0), ANY_TOKEN, dtype=torch.long, device=device)

    def start(self, row: int, prompt_ids: list[int], logit_bias: tuple[tuple[int, float], ...],
              bad_words: tuple[tuple[int, ...], ...] = ()) -> None:  # fmt: skip
        dev = self.counts.device
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.seen[row, torch.tensor(prompt_ids, dtype=torch.long, device=dev)] = True
        self.bias[row].zero_()
        if logit_bias:
            ids, values = zip(*logit_bias)
            self.bias[row, torch.tensor(ids, device=dev)] = torch.tensor(
                values, dtype=torch.float32, device=dev
            )
        w = self.recent.shape[1]
        tail = prompt_ids[-w:]
        self.recent[row] = torch.tensor([NO_TOKEN] * (w - len(tail)) + tail, dtype=torch.long, device=dev)
        self._set_words(row, bad_words)

    def _set_words(self, row: int, words: tuple[tuple[int, ...], ...]) -> None:
        """The row's bad words (the tables grow to the most words a request has named)."""
        if len(words) > self.lasts.shape[1]:
            grow = max(len(words), 2 * self.lasts.shape[1]) - self.lasts.shape[1]
            self.prefixes = torch.cat([self.prefixes, self.prefixes.new_full((self.prefixes.shape[0], grow,
                                                                              self.prefixes.shape[2]), ANY_TOKEN)], 1)  # fmt: skip
            self.lasts = torch.cat(
                [self.lasts, self.lasts.new_full((self.lasts.shape[0], grow), ANY_TOKEN)], 1
            )
        w = self.prefixes.shape[2]
        self.prefixes[row] = ANY_TOKEN
        self.lasts[row] = ANY_TOKEN
        for i, word in enumerate(words):
            head = list(word[:-1])
            self.prefixes[row, i] = torch.tensor(
                [ANY_TOKEN] * (w - len(head)) + head, device=self.lasts.device
            )
            self.lasts[row, i] = word[-1]

    def add(self, rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """tokens [bs, n] where valid [bs, n]: committed by the requests of `rows` [bs]."""
        idx = (rows[:, None].expand_as(tokens), tokens)
        self.counts.index_put_(idx, valid.float(), accumulate=True)
        # only the committed tokens' entries change; entries of one token all write the same value
        self.seen.index_put_(idx, self.seen[idx] | (self.counts[idx] > 0))
        if self.lasts.shape[1]:  # the sequences' latest tokens (valid is a prefix of each row)
            w = self.recent.shape[1]
            seq = torch.cat([self.recent[rows], tokens], dim=1)  # [bs, w + n]
            at = valid.sum(dim=1, keepdim=True) + torch.arange(w, device=seq.device)
            self.recent[rows] = seq.gather(1, at)

    def ban(self, rows: torch.Tensor, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """scores [bs, g + 1, V] of positions after the rows' latest tokens, drafts [bs, g] in between ->
        each row's bad words banned where they would complete (no-op while no request names any)."""
        if not self.lasts.shape[1]:
            return scores
        windows = torch.cat([self.recent[rows], drafts], dim=1).unfold(1, self.recent.shape[1], 1)
        return ban_bad_words(scores, windows, self.prefixes[rows], self.lasts[rows])

    def apply(self, x: RoundInputs, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """logits [bs, g + 1, V] of a block whose drafts [bs, g] precede positions 1..g -> penalized, each
        position with the counts its sequence has there: every position with the committed counts (on
        CPU only the tokens a row has seen or biases; `logits` may be changed in place), then, at
        position j, the tokens of drafts 0..j-1 again with the counts those drafts add."""
        counts, seen, bias = self.counts[x.rows], self.seen[x.rows], self.bias[x.rows]  # [bs, V] each
        r, f, p = (t.float()[:, None] for t in (x.repetition, x.frequency, x.presence))
        bs, bq, _ = logits.shape
        tok = drafts[:, None, :].expand(bs, bq, drafts.shape[1])  # [bs, j, i]: draft i's token at position j
        scores = logits.float()  # one conversion (none in fp32): the passes below share it
        raw = scores.gather(2, tok)  # before anything below changes the logits
        if logits.device.type == "cpu" and not torch.compiler.is_compiling():
            scores = _penalize_touched(scores, counts, seen, bias, r, f, p)
        else:  # no data-dependent shapes (CUDA graphs, compiled code): passes over the whole block
            scores = penalize(
                logits, counts[:, None], seen[:, None], bias[:, None], *(t[:, :, None] for t in (r, f, p))
            )
        if drafts.shape[1]:
            scores = _with_drafts_counted(scores, raw, tok, drafts, counts, bias, r, f, p)
        return self.ban(x.rows, scores, drafts)


def _penalize_touched(scores: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor,
                      r: torch.Tensor, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The committed counts' penalties at every position of `scores` [bs, g + 1, V], changed in place and
    only where they change anything: the tokens a row has seen or biases (a prompt's and an output's
    tokens, not the vocabulary)."""
    b, t = (seen | (bias != 0)).nonzero(as_tuple=True)  # [N] each
    at = (counts[b, t][:, None], seen[b, t][:, None], bias[b, t][:, None], r[b], f[b], p[b])  # [N, 1] each
    scores[b, :, t] = penalize(scores[b, :, t], *at)  # [N, g + 1]
    return scores


def _with_drafts_counted(scores: torch.Tensor, raw: torch.Tensor, tok: torch.Tensor, drafts: torch.Tensor,
                         counts: torch.Tensor, bias: torch.Tensor, r: torch.Tensor, f: torch.Tensor,
                         p: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`scores` [bs, g + 1, V] penalized with the committed counts; at position j the tokens of drafts
    0..j-1 penalized again from their raw logits `raw` [bs, j, i] (at `tok`) with their counts there."""
    same = (drafts[:, :, None] == drafts[:, None, :]).float()  # [bs, i', i]: draft i' has draft i's token
    before = torch.cat(
        [torch.zeros_like(same[:, :1]), same.cumsum(dim=1)], dim=1
    )  # [bs, j, i]: among drafts < j
    c = counts.gather(1, drafts)[:, None, :] + before  # the count of draft i's token at position j
    drafted = raw.new_ones((), dtype=torch.bool)  # a drafted token is seen
    val = penalize(raw, c, drafted, bias.gather(1, drafts)[:, None, :], *(t[:, :, None] for t in (r, f, p)))
    keep = scores.gather(2, tok)  # where draft i's token is not among the drafts before j
    # every entry of one token at one position agrees (`before` counts by token): the scatter is exact
    return scores.scatter_(2, tok, torch.where(before > 0, val, keep))


@dataclass
class _Sampling:
    """A round's per-request sampling tensors ([bs] each) and the batch's static flags."""

    inputs: RoundInputs
    flags: Flags  # (all greedy, any greedy, any top-k/top-p, any penalty/min-p)

    @property
    def all_greedy(self) -> bool:
        return self.flags[0]

    def probs(self, logits: torch.Tensor, *, per_row: int) -> torch.Tensor:
        """logits [bs * per_row, V] -> processed probabilities (each request's row repeated)."""
        _, any_greedy, needs_filter, processed, _ = self.flags
        x = self.inputs
        min_p = x.min_p.repeat_interleave(per_row) if processed else None
        return logits_to_probs(logits, x.temps.repeat_interleave(per_row), x.top_k.repeat_interleave(per_row),
                               x.top_p.repeat_interleave(per_row), needs_filter=needs_filter,
                               any_greedy=any_greedy, min_p=min_p)  # fmt: skip


@dataclass
class _Drafted:
    """A round's drafts and what acceptance needs to judge them."""

    tokens: torch.Tensor  # [bs, g]
    q: torch.Tensor | None = None  # [bs, g, V] the draft distribution (v1, sampling batches)
    bitmask: torch.Tensor | None = None  # guided: [bs, g + 1, words] each verified position's allowed tokens
    proposal: Proposal | None = None  # DFlash 2: q over each slot's candidates, the overturned picks


class _Block(NamedTuple):
    """Where the round's block sits in each sequence's cache."""

    pos: torch.Tensor  # [bs, Bq] positions start .. start + g
    ctx_idx: torch.Tensor  # [bs, W * P] the context's cache slots
    cap: int  # last cache column the tables cover


def _block(p: RoundParts, x: RoundInputs, g: int) -> _Block:
    pos = x.starts[:, None] + torch.arange(g + 1, device=x.anchors.device)
    return _Block(pos, context_index(x.tables, p.page_size), x.tables.shape[1] * p.page_size - 1)


def round_chain(p: RoundParts, x: RoundInputs, g: int, flags: Flags, t_draft: float) -> torch.Tensor:
    """Linear DFlash (or plain decoding, g = 0): draft the chain, verify it, accept a prefix."""
    blk, sampling = _block(p, x, g), _Sampling(x, flags)
    bs, dev = x.anchors.shape[0], x.anchors.device
    drafted = _Drafted(torch.zeros(bs, g, dtype=torch.long, device=dev))
    d_valid = torch.arange(1, g + 1, device=dev)[None, :] < x.block_lens[:, None]  # [bs, g] real slots
    overturned = torch.zeros(bs, dtype=torch.long, device=dev)
    if p.drafter is not None and g > 0:
        drafted = _draft(p, x, blk, sampling)
        if drafted.proposal is not None:
            overturned = (drafted.proposal.overturned & d_valid).sum(dim=1)
    t_verify = p.phase_clock()
    logits, taps = _verify(p, x, drafted.tokens, blk)
    if flags[3]:
        logits = _penalize_block(p, x, logits, drafted.tokens)
    if p.guided is not None:
        bitmask = drafted.bitmask if drafted.bitmask is not None else p.guided.along(drafted.tokens)
        logits = mask_logits(logits, bitmask.to(logits.device))
    t_accept = p.phase_clock()
    acc, emit = _accept(p, drafted, logits, blk, d_valid, sampling)
    inject(p, x, taps, acc, blk.cap)
    if flags[3]:
        _count_committed(p, x, drafted.tokens, acc, emit)
    extras = _committed_logprobs(logits, drafted.tokens, acc, emit) if flags[4] else None
    p.add_phases(t_draft, t_verify, t_accept)
    chain = torch.arange(g + 1, device=dev).expand(bs, g + 1)  # node j sits at depth j
    return stack(acc, emit, x.block_lens - 1, overturned, drafted.tokens, chain, extras)


def round_tree(p: RoundParts, x: RoundInputs, g: int, flags: Flags, budget: int,
               t_draft: float) -> torch.Tensor:  # fmt: skip
    """DDTree: draft, build each request's tree of `budget` nodes, verify it, walk it, commit."""
    blk = _block(p, x, g)
    d_logits = _draft_logits(p, x, blk)  # [bs, g, V]
    if p.guided is not None:
        d_logits = _masked_along_argmax(p.guided, d_logits)
    if p.native_tree:
        build = build_tree_native
    else:
        build = build_tree_host if x.anchors.shape[0] * budget <= p.host_tree_nodes else build_tree
    tree = build(d_logits, x.anchors, budget=budget, max_depth=x.block_lens - 1)
    t_verify = p.phase_clock()
    logits, taps, node_slots = _verify_tree(p, tree, x, blk)
    if p.guided is not None:  # each node's children: the state after its path
        logits = mask_logits(logits, p.guided.tree(tree.tokens, tree.parents, tree.valid).to(logits.device))
    t_accept = p.phase_clock()
    walk = _accept_tree(p, tree, logits, x, flags, g)
    _commit_tree(p, walk, node_slots, taps, x, blk.cap)
    p.add_phases(t_draft, t_verify, t_accept)
    drafted = tree.valid.sum(dim=1) - 1  # [bs] real nodes below the root
    none = torch.zeros_like(drafted)  # trees are never built from a DFlash 2 selector (refused)
    return stack(walk.accepted, walk.emitted, drafted, none, walk.path_tokens, walk.path_nodes)


def _penalize_block(
    p: RoundParts, x: RoundInputs, logits: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """The block's target logits under each request's penalties and bias (spec/penalties.py)."""
    assert p.penalties is not None
    return p.penalties.apply(x, logits, drafts)


def _count_committed(
    p: RoundParts, x: RoundInputs, drafts: torch.Tensor, acc: torch.Tensor, emit: torch.Tensor
) -> None:
    """The round's committed tokens (accepted drafts, then the emitted one) into the penalty counts."""
    assert p.penalties is not None
    tokens, valid = _committed(drafts, acc, emit)
    p.penalties.add(x.rows, tokens, valid)


def _committed(
    drafts: torch.Tensor, acc: torch.Tensor, emit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each block position commits ([bs, g + 1]: the accepted drafts, then the emitted token
    at position acc) and which positions commit one (those up to acc)."""
    g = drafts.shape[1]
    tokens = torch.cat([drafts, emit[:, None]], dim=1)
    cols = torch.arange(g + 1, device=drafts.device)[None, :]
    return torch.where(cols == acc[:, None], emit[:, None], tokens), cols <= acc[:, None]


def _committed_logprobs(
    logits: torch.Tensor, drafts: torch.Tensor, acc: torch.Tensor, emit: torch.Tensor
) -> torch.Tensor:
    """`token_logprobs` of the tokens the block commits. Eager on CPU only the positions up to the batch's
    longest accepted run are computed (a round commits acc + 1 tokens; the rest are padding, never read)."""
    chosen = _committed(drafts, acc, emit)[0]
    if logits.device.type != "cpu" or torch.compiler.is_compiling():
        return token_logprobs(logits, chosen)
    n = int(acc.max()) + 1
    bs, bq = chosen.shape
    part = token_logprobs(logits[:, :n], chosen[:, :n]).reshape(bs, n, -1)
    return torch.cat([part, part.new_zeros(bs, bq - n, part.shape[-1])], dim=1).reshape(bs, -1)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """logits [bs, n, V] (after penalties and bias, before temperature) and the tokens chosen at those
    positions [bs, n] -> [bs, n * (2 + 2K)] float64: per position the chosen token's log-probability and
    rank (1 = the most likely), then the K most likely tokens and their log-probabilities."""
    bs, vocab = logits.shape[0], logits.shape[-1]
    lsm = torch.log_softmax(logits.float(), dim=-1)
    lp = lsm.gather(-1, chosen[..., None])  # [bs, n, 1]
    rank = (lsm > lp).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1
    top_lp, top_ids = lsm.topk(min(MAX_LOGPROBS, vocab), dim=-1)
    cols = (lp.double(), rank.double(), top_ids.double(), top_lp.double())
    return torch.cat(cols, dim=-1).reshape(bs, -1)


def inject(
    p: RoundParts, x: RoundInputs, taps: torch.Tensor | None, accepted: torch.Tensor, cap: int
) -> None:
    """KV injection: the round's committed positions start .. start + accepted (the anchor and the
    accepted drafts, their target taps [bs, n, K*D] in depth order) become draft-cache context; the
    other n - 1 - accepted rows go to the padding page (cap: the last cache column the tables cover).
    Nothing without a drafter."""
    if taps is None or p.draft_cache is None:
        return
    bs, n = taps.shape[:2]
    r = torch.arange(n, device=x.starts.device)
    pos = x.starts[:, None] + r  # [bs, n]
    slots = torch.where(
        r[None, :] <= accepted[:, None], slot_mapping(x.tables, pos.clamp(max=cap), p.page_size), 0
    )
    p.backend.drafting.inject_context(
        p.draft_cache, taps.reshape(bs * n, -1), pos.reshape(-1), slots.reshape(-1)
    )


def _draft_hidden(p: RoundParts, x: RoundInputs, blk: _Block) -> torch.Tensor:
    """One non-causal block pass over [anchor, g masks] -> the final hidden states [bs, g, D] of
    depths 1..g."""
    assert p.draft_cache is not None and p.drafter is not None
    bs, bq = blk.pos.shape
    masks = torch.full((bs, bq - 1), p.mask_token_id, dtype=torch.long, device=x.anchors.device)
    block = torch.cat([x.anchors[:, None], masks], dim=1)  # [bs, Bq]: the anchor, then g mask tokens
    ctx_lens = blk.pos[:, 0].contiguous()  # the anchors' positions; kernels index it flat
    hidden = p.backend.drafting.forward_block(p.draft_cache, p.drafter.embed_block(block), blk.pos, blk.ctx_idx,
                                              ctx_lens, x.block_lens)  # fmt: skip
    # A copy, not a view of rows 1.. (a view's reshape would depend on whether bs is 1).
    return hidden[:, 1:].clone(memory_format=torch.contiguous_format)


def _draft_logits(p: RoundParts, x: RoundInputs, blk: _Block) -> torch.Tensor:
    """The drafter's logits [bs, g, V] for depths 1..g (raw: no temperature)."""
    assert p.drafter is not None
    return p.drafter.compute_logits(_draft_hidden(p, x, blk))


def _draft(p: RoundParts, x: RoundInputs, blk: _Block, sampling: _Sampling) -> _Drafted:
    """One non-causal block pass proposes g drafts per sequence (drafts [bs, g]; q [bs, g, V], None
    when every request is greedy). A DFlash 2 drafter's selector proposes instead (`select`)."""
    assert p.drafter is not None
    bs, bq = blk.pos.shape
    g = bq - 1
    slots = _draft_hidden(p, x, blk)  # [bs, g, D]
    d_logits = p.drafter.compute_logits(slots)  # [bs, g, V]
    if p.guided is not None:
        return _draft_guided(p, x, blk, sampling, slots, d_logits)
    if p.drafter.selector is not None:
        return select(p, x, blk, slots, d_logits, sampling)
    argmax = d_logits.argmax(dim=-1)
    if sampling.all_greedy:
        return _Drafted(argmax)
    vocab = d_logits.shape[-1]
    q_probs = sampling.probs(d_logits.reshape(bs * g, vocab), per_row=g).reshape(bs, g, vocab)
    u = uniform(x.seeds, blk.pos[:, 1:], PURPOSE_DRAFT, native=p.native_uniform)
    sampled = sample_from_probs(q_probs.reshape(bs * g, vocab), u.reshape(-1)).reshape(bs, g)
    greedy = x.greedy_draft
    drafts = torch.where(greedy[:, None], argmax, sampled)
    one_hot = torch.zeros_like(q_probs).scatter_(-1, drafts[..., None], 1.0)
    return _Drafted(drafts, q=torch.where(greedy[:, None, None], one_hot, q_probs))


def _masked_along_argmax(guided: GuidedRound, d_logits: torch.Tensor) -> torch.Tensor:
    """Draft logits [bs, g, V] with slot j masked by the guide's state after the masked argmax drafts
    1..j: what a DFlash 2 selector or a DDTree proposes from (their own picks are walked afterwards)."""
    _, bitmask = guided.chain(d_logits, lambda j, m: m.argmax(dim=-1))
    return mask_logits(d_logits.clone(), bitmask[:, :-1].to(d_logits.device))


def _draft_guided(p: RoundParts, x: RoundInputs, blk: _Block, sampling: _Sampling, slots: torch.Tensor,
                  d_logits: torch.Tensor) -> _Drafted:  # fmt: skip
    """`_draft` under guides (engine/grammar.py): slot j + 1 drafted from logits masked by the state
    after drafts 1..j, argmax or a draw from the masked q with the slot's PURPOSE_DRAFT uniform."""
    assert p.guided is not None and p.drafter is not None
    if p.drafter.selector is not None:
        return select(p, x, blk, slots, _masked_along_argmax(p.guided, d_logits), sampling)
    if sampling.all_greedy:
        drafts, bitmask = p.guided.chain(d_logits, lambda j, m: m.argmax(dim=-1))
        return _Drafted(drafts, bitmask=bitmask)
    u = uniform(x.seeds, blk.pos[:, 1:], PURPOSE_DRAFT, native=p.native_uniform)  # [bs, g]
    greedy, qs = x.greedy_draft, []

    def pick(j: int, masked: torch.Tensor) -> torch.Tensor:
        q = sampling.probs(masked, per_row=1)  # [bs, V]
        tok = torch.where(greedy, masked.argmax(dim=-1), sample_from_probs(q, u[:, j]))
        qs.append(torch.where(greedy[:, None], torch.zeros_like(q).scatter_(-1, tok[:, None], 1.0), q))
        return tok

    drafts, bitmask = p.guided.chain(d_logits, pick)
    return _Drafted(drafts, q=torch.stack(qs, dim=1), bitmask=bitmask)


def select(p: RoundParts, x: RoundInputs, blk: _Block, hidden: torch.Tensor, logits: torch.Tensor,
           sampling: _Sampling) -> _Drafted:  # fmt: skip
    """DFlash 2: the selector's walk over each slot's top-k candidates (hidden [bs, g, D], logits
    [bs, g, V]) proposes the drafts. Greedy rows (T = 0 or greedy drafts) take the best score, sampled
    rows draw from softmax(score / T) with the slot's PURPOSE_DRAFT uniform: exactly the reference
    loop's rule, batched."""
    assert p.drafter is not None and p.drafter.selector is not None
    if sampling.all_greedy:  # no draws: skip hashing the uniforms
        u = torch.zeros(blk.pos.shape[0], blk.pos.shape[1] - 1, device=blk.pos.device)
    else:
        u = uniform(x.seeds, blk.pos[:, 1:], PURPOSE_DRAFT, native=p.native_uniform)
    proposal = propose(
        hidden=hidden, logits=logits, anchors=x.anchors, selector=p.drafter.selector, temperature=x.temps,
        greedy=x.greedy_draft, u=u, any_sampled=not sampling.all_greedy, walk=p.backend.walk,
    )  # fmt: skip
    return _Drafted(proposal.drafts, proposal=proposal)


def _verify(
    p: RoundParts, x: RoundInputs, drafts: torch.Tensor, blk: _Block
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target pass over [anchor, drafts] writes the B_i valid tokens' K/V -> logits [bs, Bq, V] and
    the layer taps [bs, Bq, K*D] (None without a drafter)."""
    bq = blk.pos.shape[1]
    tokens = torch.cat([x.anchors[:, None], drafts], dim=1)  # [bs, Bq]
    blk_valid = torch.arange(bq, device=x.anchors.device)[None, :] < x.block_lens[:, None]  # [bs, Bq]
    kv_slots = torch.where(blk_valid, slot_mapping(x.tables, blk.pos.clamp(max=blk.cap), p.page_size), 0)
    logits, taps = p.target(tokens, blk.pos, x.starts + x.block_lens, p.target_cache, kv_slots, blk.ctx_idx,
                            tap_layers=p.tap_layers, paged=True)  # fmt: skip
    return logits, taps


def _verify_tree(p: RoundParts, tree: DraftTree, x: RoundInputs,
                 blk: _Block) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """One target pass over every tree's N nodes under the ancestor-only mask (past context fully
    visible). Node i's K/V goes to the scratch slot of cache column start + i. Returns logits
    [bs, N, V], layer taps [bs, N, K*D] (or None) and the nodes' slots [bs, N]."""
    n1 = tree.tokens.shape[1]
    cols = x.starts[:, None] + torch.arange(n1, device=x.starts.device)  # [bs, N]
    node_slots = slot_mapping(x.tables, cols.clamp(max=blk.cap), p.page_size)
    logits, taps = p.target(tree.tokens, tree_positions(x.starts, tree), x.starts + n1, p.target_cache, node_slots,
                            blk.ctx_idx, tap_layers=p.tap_layers, block_mask=tree.visibility, paged=True)  # fmt: skip
    return logits, taps, node_slots


def _accept_tree(p: RoundParts, tree: DraftTree, logits: torch.Tensor, x: RoundInputs,
                 flags: Flags, g: int) -> TreeWalk:  # fmt: skip
    """The target's own token at every node (argmax, or a sample with the uniform of the position
    it fills), then the walk from the root along those choices."""
    all_greedy, any_greedy, needs_filter, _, _ = flags  # trees never run with penalties or logprobs (planner)
    chosen = target_tokens(
        logits, tree, x.starts, x.seeds, x.temps, x.top_k, x.top_p,
        all_greedy=all_greedy, any_greedy=any_greedy, needs_filter=needs_filter, native=p.native_uniform,
    )  # fmt: skip
    return walk_tree(tree, chosen, max_depth=g)


def _commit_tree(p: RoundParts, walk: TreeWalk, node_slots: torch.Tensor, taps: torch.Tensor | None,
                 x: RoundInputs, cap: int) -> None:  # fmt: skip
    """Compaction: the accepted path's K/V move from their scratch slots to the slots of positions
    start .. start + a; the path's taps are injected as the chain's are."""
    g1 = walk.path_nodes.shape[1]
    cols = x.starts[:, None] + torch.arange(g1, device=x.starts.device)
    dest = slot_mapping(x.tables, cols.clamp(max=cap), p.page_size)  # [bs, g + 1]
    src, dst = commit_slots(walk, node_slots, dest)
    p.target_cache.copy_slots(src.reshape(-1), dst.reshape(-1))
    if taps is not None:
        inject(p, x, gather_path(taps, walk.path_nodes), walk.accepted, cap)


def _accept(p: RoundParts, drafted: _Drafted, logits: torch.Tensor, blk: _Block, d_valid: torch.Tensor,
            sampling: _Sampling) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Greedy or lossless rejection sampling (d_valid [bs, g]: slots inside each block; DFlash 2: q
    over the selector's candidates) -> (accepted drafts [bs], emitted token [bs])."""
    bs, bq, vocab = logits.shape
    g, drafts, backend = bq - 1, drafted.tokens, p.backend
    if sampling.all_greedy:
        return backend.greedy_accept(drafts, logits, d_valid)
    seeds = sampling.inputs.seeds
    probs = sampling.probs(logits.reshape(bs * bq, vocab), per_row=bq).reshape(bs, bq, vocab)
    u_accept = uniform(seeds, blk.pos[:, 1:], PURPOSE_ACCEPT, native=p.native_uniform)  # [bs, g]
    u_emit = uniform(seeds, blk.pos + 1, PURPOSE_EMIT, native=p.native_uniform)  # [bs, g + 1]
    if drafted.proposal is not None:
        cands, cand_q = drafted.proposal.candidates, drafted.proposal.cand_probs  # [bs, g, K] each
        return backend.candidate_accept(drafts, cands, cand_q, probs, u_accept, u_emit, d_valid)
    q_probs = drafted.q if drafted.q is not None else probs.new_zeros(bs, g, vocab)
    return backend.rejection_accept(drafts, q_probs, probs, u_accept, u_emit, d_valid)


def stack(accepted: torch.Tensor, emitted: torch.Tensor, drafted: torch.Tensor, overturned: torch.Tensor,
          drafts: torch.Tensor, path: torch.Tensor, extras: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[bs] x 4, drafts [bs, g], path [bs, g + 1] -> [bs, 2g + 5] long: one tensor, one read-back. With
    `extras` (`token_logprobs`) they follow those columns, all float64 (token ids are exact in it)."""
    columns = (accepted[:, None], emitted[:, None], drafted[:, None], overturned[:, None], drafts, path)
    if extras is None:
        return torch.cat([c.long() for c in columns], dim=1)
    return torch.cat([*(c.double() for c in columns), extras], dim=1)


def unstack(rows: list[list[Any]], g: int, budget: int) -> RoundOutput:
    """`stack`'s rows (read back as lists) -> RoundOutput."""
    ids = [[int(v) for v in r[: 2 * g + 5]] for r in rows]
    out = RoundOutput(
        accepted=[r[0] for r in ids],
        emitted=[r[1] for r in ids],
        drafted=[r[2] for r in ids],
        overturned=[r[3] for r in ids],
        drafts=[r[4 : 4 + g] for r in ids],
        path=[r[4 + g :] for r in ids],
        tree_budget=budget,
    )
    if rows and len(rows[0]) > 2 * g + 5:
        out.logprobs = [parse_logprobs(r[2 * g + 5 :], g + 1) for r in rows]
    return out


def parse_logprobs(values: list[float], n: int) -> list[TokenLogprob]:
    """`token_logprobs`' columns of n positions -> (logprob, rank, top alternatives) per position."""
    width = len(values) // n
    k = (width - 2) // 2
    out = []
    for j in range(n):
        v = values[j * width : (j + 1) * width]
        out.append((v[0], int(v[1]), tuple((int(t), lp) for t, lp in zip(v[2 : 2 + k], v[2 + k :]))))
    return out
