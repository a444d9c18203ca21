# SPDX-License-Identifier: Apache-2.0
"""Guided decoding with xgrammar: compile a request's guide once, keep its matcher, and mask what a
round drafts and verifies.

A guided request's output must stay inside its guide's language. At every position a round uses, the
target's logits are masked (-inf) to the tokens the guide allows after the sequence so far, drafts
included: row j of a verified block (the distribution after draft j) is masked by the matcher's state
after drafts 1..j. Greedy acceptance then takes the masked argmax and rejection sampling compares
against the masked distribution, so the committed tokens are exactly what plain constrained decoding
commits (greedy), or distributed as it (sampling: the rule is lossless for any draft distribution q).

Drafts are masked too, or few would survive: a linear chain's draft j + 1 is chosen from the drafter's
logits masked by the state after drafts 1..j (one slot after the other, `GuidedRound.chain`). A DFlash 2
selector and a DDTree propose from slots masked along the drafter's own masked argmax chain; their
actual drafts are then walked through the matcher (`along`, `tree`): each verified position gets the
mask of its own path, and a draft the guide refuses is never accepted (its probability is 0).

Grammars compile once per (type, text) per engine (xgrammar's compiler caches them); a matcher per
sequence advances along committed tokens only (`Guide.advance`), the drafts it walks in a round are
rolled back before the round ends.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from dflash_trt.engine.request import GUIDE_TYPES
from dflash_trt.errors import RequestError

FIELD = "guided_decoding"
MAX_GUIDE_CHARS = 1 << 20  # a guide's text: bounded work for the compiler


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and vocabulary (the target's logits width: ids the
    tokenizer lacks are never allowed); the model's end ids are the tokens that finish a guide."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self._lock = threading.Lock()  # add_request may run on several threads

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of a guide; RequestError naming guided_decoding when it does not compile."""
        if kind not in GUIDE_TYPES:
            raise RequestError(f"guided_decoding type {kind!r} is not one of {', '.join(GUIDE_TYPES)}",
                               field=FIELD, hint="send json, json_schema, regex, ebnf_grammar or structural_tag")  # fmt: skip
        if len(text) > MAX_GUIDE_CHARS:
            raise RequestError(f"guided_decoding {kind} is {len(text)} characters, over {MAX_GUIDE_CHARS}",
                               field=FIELD, hint="send a smaller guide")  # fmt: skip
        try:
            with self._lock:
                return self._compile(kind, text)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar's parse errors: RuntimeError, ValueError, its own types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise RequestError(f"guided_decoding {kind} does not compile: {first}", field=FIELD,
                               hint=f"send a valid {kind.replace('_', ' ')}") from None  # fmt: skip

    def _compile(self, kind: str, text: str) -> Any:
        c = self._compiler
        if kind == "json":  # TensorRT-LLM's json_object guide: any JSON value
            return c.compile_builtin_json_grammar()
        if kind == "json_schema":
            json.loads(text)  # a clear error for text that is not JSON at all
            # no free whitespace between tokens (", " and ": " only): a small model otherwise loops on it
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "ebnf_grammar":
            return c.compile_grammar(text)
        return c.compile_structural_tag(text)

    def guide(self, compiled: Any) -> Guide:
        """A fresh matcher (xgrammar's roll back as far as needed: a round's drafts or tree path)."""
        return Guide(self._xgr.GrammarMatcher(compiled))


class Guide:
    """One sequence's matcher: the state after its committed tokens."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, out: torch.Tensor) -> None:
        """The allowed tokens after the current state into `out` [words] int32 (all, once terminated:
        the sequence has ended at a stop token and what follows is never committed)."""
        if self.matcher.is_terminated():
            out.fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(out[None], 0)

    def step(self, token: int) -> bool:
        """Advance by a drafted token; False (state unchanged) when the guide refuses it."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(int(token))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def advance(self, tokens: list[int]) -> None:
        """Committed tokens (each allowed: it was chosen under this guide's mask)."""
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] and bitmask [..., words] int32 (bit t % 32 of word t // 32: token t allowed) -> the
    logits with refused tokens at -inf (xgrammar's kernel: ~20-40 us for 16 rows of a 49k vocabulary, where
    unpacking the bits in torch took ~20 ms)."""
    import xgrammar as xgr

    flat = logits.contiguous().view(-1, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(flat, bitmask.reshape(-1, bitmask.shape[-1]).contiguous())
    return flat.view(logits.shape)


class GuidedRound:
    """A round's guides, one per batch row (None for a free row), and the masks it computes."""

    def __init__(self, guides: list[Guide | None], words: int) -> None:
        self.guides = guides
        self.words = words
        self.rows = [i for i, g in enumerate(guides) if g is not None]

    def _fresh(self, n: int) -> torch.Tensor:
        return torch.full((len(self.guides), n, self.words), -1, dtype=torch.int32)

    def chain(self, logits: torch.Tensor, pick: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked drafting of a chain: logits [bs, g, V]; pick(j, masked [bs, V]) -> tokens [bs] chooses
        slot j's drafts. Slot j is masked by the state after drafts 1..j. Returns (drafts [bs, g], the
        bitmask [bs, g + 1, words] of every verified position; the last: after all g drafts)."""
        bs, g, _ = logits.shape
        bitmask = self._fresh(g + 1)
        stepped = [0] * bs
        drafts = []
        for j in range(g + 1):
            for i in self.rows:
                self.guides[i].fill(bitmask[i, j])  # type: ignore[union-attr]
            if j == g:
                break
            tok = pick(j, mask_logits(logits[:, j].clone(), bitmask[:, j].to(logits.device)))
            drafts.append(tok)
            host = tok.tolist()
            for i in self.rows:
                if stepped[i] == j and self.guides[i].step(host[i]):  # type: ignore[union-attr]
                    stepped[i] += 1
        self._rollback(stepped)
        return torch.stack(drafts, dim=1) if drafts else logits.new_zeros(bs, 0, dtype=torch.long), bitmask

    def along(self, drafts: torch.Tensor) -> torch.Tensor:
        """The bitmask [bs, g + 1, words] of each verified position along drafts [bs, g] proposed
        elsewhere (a DFlash 2 selector's): after the first draft the guide refuses, the positions are
        never used (that draft has probability 0) and stay all-allowed."""
        bs, g = drafts.shape
        bitmask = self._fresh(g + 1)
        host = drafts.tolist()
        stepped = [0] * bs
        for i in self.rows:
            guide = self.guides[i]
            for j in range(g + 1):
                guide.fill(bitmask[i, j])  # type: ignore[union-attr]
                if j == g or not guide.step(host[i][j]):  # type: ignore[union-attr]
                    break
                stepped[i] += 1
        self._rollback(stepped)
        return bitmask

    def tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The bitmask [bs, N, words] of every tree node's children: the state after the path from the
        root to the node (nodes come after their parents). A node the guide refuses, and its subtree,
        keep the all-allowed mask: the walk never reaches them."""
        bitmask = self._fresh(tokens.shape[1])
        toks, pars, ok = tokens.tolist(), parents.tolist(), valid.tolist()
        for i in self.rows:
            self._walk_tree(self.guides[i], bitmask[i], toks[i], pars[i], ok[i])  # type: ignore[arg-type]
        return bitmask

    @staticmethod
    def _walk_tree(guide: Guide, out: torch.Tensor, toks: list[int], pars: list[int], ok: list[bool]) -> None:
        """Depth-first over one tree: the matcher follows each path and rolls back on the way up."""
        children: dict[int, list[int]] = {}
        for node in range(1, len(toks)):
            if ok[node] and pars[node] >= 0:
                children.setdefault(pars[node], []).append(node)
        stack: list[tuple[int, bool]] = [(0, False)]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                guide.rollback(1)
                continue
            if node and not guide.step(toks[node]):
                continue
            if node:
                stack.append((node, True))
            guide.fill(out[node])
            stack.extend((c, False) for c in reversed(children.get(node, [])))

    def _rollback(self, stepped: list[int]) -> None:
        for i in self.rows:
            self.guides[i].rollback(stepped[i])  # type: ignore[union-attr]


def guided_round(reqs: list[Any], words: int) -> GuidedRound | None:
    """The round's guides (None when no request of the batch is guided; a None entry is a free row)."""
    guides = [r.guide if r is not None else None for r in reqs]
    return GuidedRound(guides, words) if any(g is not None for g in guides) else None
