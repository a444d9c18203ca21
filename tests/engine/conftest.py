# SPDX-License-Identifier: Apache-2.0
"""The small pair whose rounds the compile tests compile (test_compiled_rounds.py, test_precompile.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch._inductor.config as inductor_config

from dflash_trt import LLM, SamplingParams
from dflash_trt.models.checkpoint import save_drafter
from tests.conftest import make_drafter, make_target

BLOCK = 5
# The small pair's warm-up shape classes (the default, automatic draft length): the candidate draft
# lengths 4 and 0 at batch 1 and at batch 2+, each greedy and sampled (8 round classes), and the prefill
# pass at batch 1 and 2+ (2 classes).
BATCH_1_CLASSES = 5  # with max_batch_size=1: both draft lengths, greedy and sampled, and the prefill
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2]]
SP = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """Two target layers and one drafter layer: every shape class compiles in about a minute on 2 cores."""
    root = tmp_path_factory.mktemp("small-pair")
    target = make_target("qwen3", seed=7, vocab=37, layers=2)
    target.save_pretrained(root / "target")
    save_drafter(make_drafter(target, block_size=BLOCK, seed=8, std=0.5), root / "drafter")
    return root / "target", root / "drafter"


def small_llm(pair, cache: Path, **kw) -> LLM:
    tdir, ddir = pair
    spec = {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir)}
    kw.setdefault("max_batch_size", 4)
    return LLM(str(tdir), speculative_config=spec, compile_cache=str(cache), **kw)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


@pytest.fixture
def untrusted_isa(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inductor's ISA probe untrusted and nothing recorded in this process (engine/vec_isa.py); inductor's
    setting is put back afterwards (monkeypatch cannot restore a setting of inductor's config proxy)."""
    from dflash_trt.engine import vec_isa

    monkeypatch.setattr(vec_isa, "_recorded", set())
    before = inductor_config.cpp.vec_isa_ok
    inductor_config.cpp.vec_isa_ok = None
    try:
        yield
    finally:
        inductor_config.cpp.vec_isa_ok = before
