# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the plugin tests: tiny target/drafter pairs on disk (one per drafter variant) and
the batch-1 reference loop that every engine output is compared with.

Nothing here imports triton: the interpreter tests run in a child process that sets
TRITON_INTERPRET=1 before the first import (see test_interpreter.py).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_drafter, make_target

BLOCK = 6

# variant -> drafter_hf_config arguments. plain: full non-causal layers; swa: two sliding (causal,
# window 5) layers and a full one; swa_noncausal: is_causal=False turns the sliding layers into a
# symmetric window; gpt_oss: attention bias (k/v/o) + yarn RoPE with attention scaling, H*d != D.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "swa": {"variant": "swa"},
    "swa_noncausal": {"variant": "swa", "is_causal": False},
    "gpt_oss": {"variant": "gpt_oss"},
}


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """The dflash:: ops' CPU calls go to the Triton launchers (under TRITON_INTERPRET=1) inside."""
    from dflash_trt.plugins import _registry

    _registry.set_triton_on_cpu(True)
    try:
        yield
    finally:
        _registry.set_triton_on_cpu(False)


@pytest.fixture(scope="session")
def plugin_pair(tmp_path_factory: pytest.TempPathFactory):
    """Factory: variant -> (target_dir, drafter_dir, target_model), built once per session."""
    from dflash_trt.models.checkpoint import save_drafter

    made: dict[str, tuple[Path, Path, Any]] = {}

    def get(variant: str = "plain") -> tuple[Path, Path, Any]:
        if variant not in made:
            root = tmp_path_factory.mktemp(f"plugin-pair-{variant}")
            target = make_target("qwen3", seed=31, vocab=13)
            target.save_pretrained(root / "target")
            drafter = make_drafter(target, block_size=BLOCK, seed=32, std=0.5, **VARIANTS[variant])
            save_drafter(drafter, root / "drafter")
            made[variant] = (root / "target", root / "drafter", target)
        return made[variant]

    return get


def greedy_jobs(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs with ragged prompt and output lengths."""
    rng = random.Random(seed)
    return [([rng.randrange(12) for _ in range(rng.randint(1, 30))], rng.randint(4, 20)) for _ in range(n)]


_REFERENCE: dict[tuple, Any] = {}


def reference_greedy(pair: tuple[Path, Path, Any], prompt: list[int], max_tokens: int):
    """The batch-1 reference loop (transformers target, PyTorch drafter, verify.py); memoised."""
    key = (str(pair[1]), tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_greedy(pair, prompt, max_tokens)
    return _REFERENCE[key]


def _reference_greedy(pair: tuple[Path, Path, Any], prompt: list[int], max_tokens: int):
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.spec.sampling import SamplingConfig

    _, ddir, model = pair
    return spec_generate(
        HFTarget(model),
        load_drafter(ddir),
        prompt,
        max_new_tokens=max_tokens,
        sampling=SamplingConfig(),
        block_size=BLOCK,
    )


def run_engine(
    pair: tuple[Path, Path, Any],
    jobs: list[tuple[list[int], Any]],
    *,
    use_plugins: bool,
    static_rounds: bool = False,
    max_batch_size: int = 4,
    rounds: dict[int, list] | None = None,
) -> tuple[list[list[int]], Any]:
    """Token ids per job from the embedded engine (jobs: (prompt, SamplingParams or max_tokens)).

    rounds: filled with request id (= job index) -> [(accepted, emitted, drafts inside the block)]
    per round. With the draft length pinned to the full block at every batch size, a request's rounds
    do not depend on what it was batched with, so two engines can be compared draft for draft even
    when their threads batch requests differently (the automatic draft length would choose by time)."""
    from dflash_trt import LLM, SamplingParams

    tdir, ddir, _ = pair
    spec = {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir),
            "max_concurrency": max_batch_size}  # fmt: skip
    llm = LLM(
        str(tdir),
        speculative_config=spec,
        max_batch_size=max_batch_size,
        max_num_tokens=64,
        max_seq_len=128,
        use_plugins=use_plugins,
    )
    engine, runner = llm.engine, llm.engine.runner
    if static_rounds:  # padded static buffers: what a CUDA graph captures
        engine.executor.static_rounds = True
        engine.executor.graph_batch_sizes = (3, max_batch_size)
    if rounds is not None:
        decode_round = runner.decode_round

        def recording(seqs: list, shape):
            block_lens = [min(shape.g + 1, s.max_len - s.start) for s in seqs]
            out = decode_round(seqs, shape)
            for s, a, e, d, b in zip(seqs, out.accepted, out.emitted, out.drafts, block_lens):
                rounds.setdefault(s.request_id, []).append((a, e, d[: b - 1]))
            return out

        runner.decode_round = recording
    try:
        params = [sp if not isinstance(sp, int) else SamplingParams(max_tokens=sp) for _, sp in jobs]
        params = [SamplingParams(**{**vars(sp), "return_perf_metrics": True}) for sp in params]
        outs = llm.generate([p for p, _ in jobs], params)
    finally:
        llm.shutdown()
    assert isinstance(outs, list)
    return [o.outputs[0].token_ids for o in outs], (engine, outs)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The tiny models gain nothing from a second thread, and on a shared 2-core machine OpenMP
    workers spinning against the engine thread made these tests 30x slower: use one, then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
