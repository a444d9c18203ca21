# SPDX-License-Identifier: Apache-2.0
"""The dflash:: ops on CPU (their PyTorch references), in this process without the interpreter:

- each reference is exactly the engine's current math (drafter methods, verify.py), bit for bit;
- opcheck (schema, fake/meta implementation, dispatch) and torch.compile(fullgraph=True);
- the engine with use_plugins=True is token-for-token the engine without, and the reference loop;
- the CUDA self-check turns a broken kernel into a warning and the PyTorch path.
The Triton kernels themselves are tested in test_interpreter.py (child process, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.plugins import accept, block_attention, context_kv, load_ops
from dflash_trt.plugins.drafting import DrafterPlugins, enable_plugins, greedy_accept, rejection_accept
from dflash_trt.spec import accept as verify
from tests.conftest import make_drafter, make_target
from tests.plugins import cases
from tests.plugins.conftest import VARIANTS, greedy_jobs, reference_greedy, run_engine

load_ops()
OPS = torch.ops.dflash


# --- the references are the engine's math ---------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", seed=3, vocab=61)


def _paged_context(drafter, *, bs: int, page: int, seed: int):
    """A draft cache filled through the drafter's own inject_context for ragged contexts."""
    gen = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    pages_per = 3
    cache = drafter.make_cache(num_pages=1 + bs * pages_per + 1, page_size=page)
    tables = (torch.randperm(bs * pages_per, generator=gen) + 1).view(bs, pages_per)
    lens = torch.randint(1, pages_per * page + 1, (bs,), generator=gen)
    pos = torch.arange(pages_per * page).expand(bs, -1)
    ok = pos < lens[:, None]
    slots = slot_mapping(tables, pos, page)[ok]
    feats = torch.randn(int(ok.sum()), cfg.num_target_features * cfg.hidden_size, generator=gen)
    return cache, tables, lens, feats, pos[ok], slots


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page", [1, 4, 16])
def test_inject_and_block_pass_equal_the_drafter_exactly(target, variant, page):
    """DrafterPlugins (ops on their references) == DFlashDrafter's own inject_context and
    forward_block, bit for bit, for every drafter variant and page size."""
    drafter = make_drafter(target, block_size=7, seed=5, std=0.5, **VARIANTS[variant])
    plug = DrafterPlugins(drafter)
    cache_a, tables, lens, feats, pos, slots = _paged_context(drafter, bs=3, page=page, seed=page)
    cache_b = drafter.make_cache(num_pages=cache_a.num_pages, page_size=page)
    with torch.inference_mode():
        drafter.inject_context(cache_a, feats, pos, slots)
        plug.inject_context(cache_b, feats, pos, slots)
        for layer in range(drafter.config.num_hidden_layers):
            assert torch.equal(cache_a.k[layer], cache_b.k[layer]) and torch.equal(
                cache_a.v[layer], cache_b.v[layer]
            )
        assert any(k.abs().sum() > 0 for k in cache_b.k)
        bq = 7
        block_lens = torch.tensor([bq, 3, 1])
        positions = lens[:, None] + torch.arange(bq)  # [bs, B]: the block follows the context
        ctx_idx = context_index(tables, page)
        embeds = torch.randn(3, bq, drafter.config.hidden_size, generator=torch.Generator().manual_seed(1))
        want = drafter.forward_block(cache_a, embeds, positions, ctx_idx, lens, block_lens)
        got = plug.forward_block(cache_b, embeds, positions, ctx_idx, lens, block_lens)
        valid = torch.arange(bq)[None, :] < block_lens[:, None]
        assert torch.equal(want[valid], got[valid])
        full = drafter.forward_block(cache_a, embeds, positions, ctx_idx, lens)
        assert torch.equal(full, plug.forward_block(cache_b, embeds, positions, ctx_idx, lens))


@pytest.mark.parametrize("variant", ["plain", "gpt_oss"])
def test_bf16_drafter_equals_the_drafter_exactly(target, variant):
    """`model.to(bf16)` casts the rotary inv_freq buffer too; the plugin upcasts it (exactly) for
    the kernels' fp32 contract, and the results stay bit-identical to the drafter's."""
    drafter = make_drafter(target, block_size=5, seed=6, std=0.5, **VARIANTS[variant]).to(torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.bfloat16
    plug = DrafterPlugins(drafter)
    assert plug.inv_freq.dtype == torch.float32 and torch.equal(
        plug.inv_freq, drafter.rotary.inv_freq.float()
    )
    cache_a, tables, lens, feats, pos, slots = _paged_context(drafter, bs=2, page=4, seed=2)
    cache_b = drafter.make_cache(num_pages=cache_a.num_pages, page_size=4)
    with torch.inference_mode():
        drafter.inject_context(cache_a, feats, pos, slots)
        plug.inject_context(cache_b, feats, pos, slots)
        assert all(torch.equal(a, b) for a, b in zip((*cache_a.k, *cache_a.v), (*cache_b.k, *cache_b.v)))
        embeds = torch.randn(2, 5, drafter.config.hidden_size).to(torch.bfloat16)
        positions = lens[:, None] + torch.arange(5)
        args = (embeds, positions, context_index(tables, 4), lens)
        assert torch.equal(drafter.forward_block(cache_a, *args), plug.forward_block(cache_b, *args))


def test_accept_references_are_verify():
    drafts = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 9, 9]])
    logits = torch.zeros(3, 4, 10)
    for n, row in enumerate([[5, 6, 0, 4], [1, 2, 3, 8], [0, 9, 9, 9]]):
        logits[n, torch.arange(4), torch.tensor(row)] = 1.0
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    acc, emit = accept.greedy_accept_reference(drafts, logits, valid)
    assert acc.tolist() == [2, 2, 0] and emit.tolist() == [0, 3, 0]
    want = verify.greedy_accept(drafts, logits, valid)
    assert torch.equal(want[0], acc) and torch.equal(want[1], emit)
    args = cases.rejection_inputs(5, 4, 37, seed=2)
    got = accept.rejection_accept_reference(*args)
    want = verify.rejection_accept(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rejection_reference_at_zero_drafts_draws_from_the_bonus_row():
    """g = 0 (speculation off by schedule): verify.rejection_accept indexes an empty q; the op's
    reference (and kernel) emit the inverse-CDF draw from p_0 with u_emit[:, 0]."""
    _, q, p, ua, ue, valid = cases.rejection_inputs(4, 0, 29, seed=3)
    acc, emit = accept.rejection_accept_reference(torch.zeros(4, 0, dtype=torch.int64), q, p, ua, ue, valid)
    from dflash_trt.spec.sampling import sample_from_probs

    assert acc.dtype == torch.int64 and acc.tolist() == [0] * 4
    assert torch.equal(emit, sample_from_probs(p[:, 0], ue[:, 0]))


# --- opcheck and torch.compile ---------------------------------------------------------------------
def _sample_args():
    attn = cases.attn_inputs(cases.AttnCase(2, 4, 4, 2, 12, 4, causal=True, window=3))
    ctx_args, k_pools, v_pools = cases.ctx_inputs(cases.CtxCase(5, 2, 24, 2, 2, 8, bias=True))
    return (
        attn,
        (*ctx_args, k_pools, v_pools),
        cases.greedy_inputs(3, 4, 61),
        cases.rejection_inputs(3, 4, 61),
    )


def test_opcheck_every_op():
    attn, ctx, greedy, rejection = _sample_args()
    torch.library.opcheck(block_attention.block_attention, attn)
    torch.library.opcheck(context_kv.inject_context, ctx)
    # also without bias
    torch.library.opcheck(context_kv.inject_context, (*ctx[:6], None, *ctx[7:]))
    torch.library.opcheck(accept.greedy_accept, greedy)
    torch.library.opcheck(accept.rejection_accept, rejection)
    torch.library.opcheck(accept.greedy_accept, cases.greedy_inputs(2, 0, 13))


def test_torch_compile_fullgraph_calls_every_op():
    attn, ctx, greedy, rejection = _sample_args()

    def step(attn, ctx, greedy, rejection):
        out = OPS.block_attention(*attn)
        OPS.inject_context(*ctx)
        g = OPS.greedy_accept(*greedy)
        r = OPS.rejection_accept(*rejection)
        return out.sum(-1), g[0] + r[0], g[1], r[1]

    ctx_eager = (*ctx[:11], [t.clone() for t in ctx[11]], [t.clone() for t in ctx[12]])
    want = step(attn, ctx_eager, greedy, rejection)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(attn, ctx, greedy, rejection)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, equal_nan=True)
    for a, b in zip((*ctx_eager[11], *ctx_eager[12]), (*ctx[11], *ctx[12])):  # the in-place writes happened
        assert torch.equal(a, b)
    assert any(t.abs().sum() > 0 for t in ctx[11])


# --- the engine on the ops (references) ------------------------------------------------------------
def _sampled_jobs(n: int, seed: int):
    from dflash_trt import SamplingParams

    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(12) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            sp = SamplingParams(max_tokens=rng.randint(4, 24))
        elif i % 3 == 1:
            sp = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.8, seed=100 + i)
        else:
            sp = SamplingParams(
                max_tokens=rng.randint(4, 24), temperature=1.1, top_k=4, top_p=0.9, seed=200 + i
            )
        jobs.append((prompt, sp))
    return jobs


def test_engine_with_plugins_equals_engine_without(plugin_pair):
    """Greedy and sampled requests, continuous batching: identical tokens with the ops on (CPU:
    references; eager and static padded rounds) and off; greedy ones equal the batch-1 reference loop."""
    pair = plugin_pair("plain")
    jobs = _sampled_jobs(8, seed=1)
    on, (engine, outs) = run_engine(pair, jobs, use_plugins=True)
    backend = engine.parts.backend
    assert isinstance(backend.drafting, DrafterPlugins)
    assert backend.greedy_accept is greedy_accept and backend.rejection_accept is rejection_accept
    on_static, _ = run_engine(pair, jobs, use_plugins=True, static_rounds=True)
    off, _ = run_engine(pair, jobs, use_plugins=False)
    assert on == off and on_static == off
    accepted = 0
    for (prompt, sp), tokens, out in zip(jobs, on, outs):
        m = out.outputs[0].request_perf_metrics.speculative_decoding
        accepted += m.total_accepted_draft_tokens
        if sp.temperature is None:
            assert tokens == reference_greedy(pair, prompt, sp.max_tokens).output_ids
    assert accepted > 10, "drafts were rarely accepted: the comparison has no teeth"


@pytest.mark.parametrize("variant", ["swa", "gpt_oss"])
def test_engine_with_plugins_is_lossless_for_drafter_variants(plugin_pair, variant):
    pair = plugin_pair(variant)
    jobs = greedy_jobs(4, seed=7)
    tokens, _ = run_engine(pair, jobs, use_plugins=True)
    for (prompt, max_tokens), got in zip(jobs, tokens):
        assert got == reference_greedy(pair, prompt, max_tokens).output_ids


def test_plugins_default_off_on_cpu(plugin_pair):
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.plugins import default_enabled

    assert EngineConfig().use_plugins is None
    assert not default_enabled(torch.device("cpu"))
    _, (engine, _) = run_engine(plugin_pair("plain"), [([1, 2], 3)], use_plugins=None)  # type: ignore[arg-type]
    backend = engine.parts.backend
    assert not backend.plugins and backend.greedy_accept is verify.greedy_accept


# --- the device self-check -------------------------------------------------------------------------
def test_self_check_falls_back_on_a_wrong_or_failing_kernel(monkeypatch, caplog, target):
    """enable_plugins(check=True) runs every op against its reference; a kernel that disagrees or
    raises (as a kernel failing to compile would) disables the plugin with a warning."""
    from dflash_trt.plugins import _registry

    drafter = make_drafter(target, block_size=5, seed=2, std=0.5, variant="swa")
    plugins, g, _ = enable_plugins(drafter, torch.device("cpu"), check=True)
    assert plugins is not None and g is greedy_accept

    monkeypatch.setattr(_registry, "_TRITON_ON_CPU", True)  # route the ops to the (patched) launchers

    def wrong_greedy(drafts, logits, valid):
        acc, emit = accept.greedy_accept_reference(drafts, logits, valid)
        return acc * 0, emit

    monkeypatch.setattr(accept, "launch_greedy_accept", wrong_greedy)
    with caplog.at_level(logging.WARNING, logger="dflash_trt.plugins.drafting"):
        plugins, g, r = enable_plugins(drafter, torch.device("cpu"), check=True)
    assert plugins is None and g is verify.greedy_accept and r is verify.rejection_accept
    assert "greedy_accept disagrees" in caplog.text

    monkeypatch.setattr(accept, "launch_greedy_accept", accept.greedy_accept_reference)
    monkeypatch.setattr(accept, "launch_rejection_accept", accept.rejection_accept_reference)
    monkeypatch.setattr(context_kv, "launch_inject_context", context_kv.inject_context_reference)

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(block_attention, "launch_block_attention", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_trt.plugins.drafting"):
        plugins, _, _ = enable_plugins(drafter, torch.device("cpu"), check=True)
    assert plugins is None and "PassManager::run failed" in caplog.text


def test_set_triton_on_cpu_refuses_without_the_interpreter(monkeypatch):
    from dflash_trt.plugins import _registry

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _registry.set_triton_on_cpu(True)
    assert not _registry.triton_on_cpu()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_bench_script_exits_clearly_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "plugin_kernels.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "needs a CUDA device" in proc.stderr and "Nothing was measured" in proc.stderr
