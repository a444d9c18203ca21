# SPDX-License-Identifier: Apache-2.0
"""bfloat16 on CPU: prepacked weights (layers/linear.py: dflash-trt's own GEMM where the CPU has
AVX512-BF16, layers/cpu_gemm.py, else oneDNN's) and the GEMM form of attention for short query
blocks (layers/attention.py) compute what the plain kernels compute, release the dense copies they
replace, and keep the engine lossless in bf16."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch.nn import functional as F

from dflash_trt import LLM, SamplingParams
from dflash_trt.layers import cpu_gemm, native
from dflash_trt.layers import linear as linear_mod
from dflash_trt.layers.attention import attend
from dflash_trt.layers.linear import Linear, can_pack, pack_linears
from dflash_trt.models.decoder import NativeTarget
from dflash_trt.models.target_config import parse_target_config
from tests.conftest import make_target


def native_bf16(*, tie: bool) -> NativeTarget:
    hf = make_target("qwen3", seed=5, vocab=61)
    cfg = hf.config.to_dict()
    cfg["tie_word_embeddings"] = tie
    model = NativeTarget(parse_target_config(cfg))
    state = {k: v for k, v in hf.state_dict().items() if tie is False or k != "lm_head.weight"}
    model.load_state_dict(state, strict=False)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16).eval()
    model.fuse_projections()
    return model


def layer_outputs(model: NativeTarget, x: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        outs += [*attn.qkv(x), attn.o_proj(x), *mlp.gate_up(x)]
        outs.append(mlp.down_proj(torch.randn(*x.shape[:-1], mlp.down_proj.in_features, dtype=x.dtype,
                                              generator=torch.Generator().manual_seed(1))))  # fmt: skip
    return [*outs, model.lm_head(x)]


NO_KERNEL = "this CPU has no AVX512-BF16 (or no C compiler): dflash-trt's bf16 GEMM does not run here"
NO_ONEDNN = "this CPU has neither AVX512BW/VL/DQ nor AVX-NE-CONVERT: oneDNN's bf16 GEMM does not run here"


@pytest.fixture(params=["onednn", "dflash", "dense"])
def gemm_kernel(request, monkeypatch) -> str:
    """Which kernel packed linears run: oneDNN's (our GEMM switched off), dflash-trt's, or neither (an
    AVX2-only CPU, both switched off: the weights stay dense for torch's bf16 matmul)."""
    if request.param in ("onednn", "dense"):
        monkeypatch.setattr(cpu_gemm, "available", lambda dtype=None: False)
    if request.param == "dense":
        monkeypatch.setattr(linear_mod, "onednn_bf16_available", lambda: False)
    elif request.param == "onednn" and not linear_mod.onednn_bf16_available():
        pytest.skip(NO_ONEDNN)
    elif request.param == "dflash" and not cpu_gemm.available():
        pytest.skip(NO_KERNEL)
    return request.param


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_packed_linears_equal_the_plain_ones_and_release_the_dense_weights(tie, gemm_kernel) -> None:
    model = native_bf16(tie=tie)
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = layer_outputs(model, x)
        n_linear = sum(isinstance(m, Linear) for m in model.modules())
        packed = pack_linears(model)
        got = layer_outputs(model, x)
    if gemm_kernel == "dense":  # nothing packed, nothing released, torch's own products
        assert packed == 0 and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert model.model.layers[0].self_attn.qkv.weight.numel() > 0
        return
    # per layer: qkv, o, gate_up and down; plus the LM head
    assert packed == 4 * model.config.num_hidden_layers + 1 and n_linear > packed
    attn = model.model.layers[0].self_attn
    if gemm_kernel == "dflash":  # whole blocks: the layer holds the packed tensor, run by dflash_bf16::linear
        assert attn.qkv.weight.dim() == 4 and cpu_gemm.bf16_op_available()
    else:  # a placeholder for oneDNN's packed weight
        assert type(linear_mod._PACKED[attn.qkv.weight._cdata]) is not cpu_gemm.BlockedWeight
    for a, b in zip(want, got, strict=True):
        if gemm_kernel == "onednn":
            assert torch.equal(a, b)  # the same oneDNN kernels, without the per-call reorder
        else:  # fp32 sums in another order, one bf16 rounding: within a bf16 step of oneDNN's
            assert b.dtype == torch.bfloat16
            torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=1e-2)
    assert attn.q_proj.weight.numel() == 0  # dense copies released: the fused one is a placeholder or packed
    assert attn.qkv.weight.dim() == 4 if gemm_kernel == "dflash" else attn.qkv.weight.numel() == 0
    assert attn.q_proj.weight.dtype == torch.bfloat16  # metadata kept for dtype/device readers
    embed = model.model.embed_tokens.weight
    assert embed.numel() > 0  # the embedding is never released, tied or not
    assert (model.lm_head.weight.numel() > 0) is tie  # a tied head keeps its (shared) dense copy
    with pytest.raises(RuntimeError):  # a stray use of a released weight fails loudly
        F.linear(x, attn.q_proj.weight)
    assert pack_linears(model) == 0  # idempotent


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(61, 32), (100, 64), (256, 128), (1000, 512)])
def test_dflash_gemm_equals_a_float32_product(m, n, k) -> None:
    """Every row tiling (1, 2, 4 and 8 rows, remainders) and block tail (N not a multiple of 16),
    with and without a bias."""
    if not cpu_gemm.available():
        pytest.skip(NO_KERNEL)
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = cpu_gemm.pack(w)
    assert packed.data.shape == (-(-n // 16), k // 2, 16, 2)
    for b in (None, bias):
        got = cpu_gemm.gemm(x, packed, b)
        want = x.float() @ w.float().T + (0 if b is None else b.float())
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)
    # leading dimensions are kept; a wrong width is refused
    assert cpu_gemm.gemm(x.reshape(m, 1, k), packed, None).shape == (m, 1, n)
    with pytest.raises(ValueError, match="features"):
        cpu_gemm.gemm(torch.zeros(1, k + 2, dtype=torch.bfloat16), packed, None)


@pytest.mark.parametrize("kernel", [cpu_gemm.BF16, cpu_gemm.F32], ids=["bf16", "f32"])
def test_dflash_gemm_builds_once_into_its_cache(kernel, tmp_path, monkeypatch) -> None:
    """Each library is compiled once per source, flags and compiler and then reused; a compiler that
    fails is an error (callers keep torch's GEMMs), and the switch turns the kernels off."""
    import shutil

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    first = cpu_gemm._build(kernel)
    stamp = first.stat().st_mtime_ns
    assert cpu_gemm._build(kernel) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
    assert first.name.startswith(kernel.source.removesuffix(".c"))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(Exception):  # noqa: B017 - `false --version` or the compile itself fails
        cpu_gemm._build(kernel)
    with cpu_gemm.switched(False):
        assert not cpu_gemm.available(kernel.dtype)
        assert os.environ[cpu_gemm.SWITCH_ENV] == "0"  # child processes see it too


def test_only_bf16_cpu_weights_are_packed() -> None:
    bf16 = torch.zeros(4, 4, dtype=torch.bfloat16)  # where our GEMM or oneDNN's runs (not on AVX2 only)
    assert can_pack(bf16) is (cpu_gemm.supports(bf16) or linear_mod.onednn_bf16_available())
    assert not can_pack(torch.zeros(4, 4))  # float32 keeps MKL's GEMMs
    assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16, device="meta"))
    # unless asked to: then fp32 weights holding bf16 values only, where the AVX2 kernel runs
    assert can_pack(torch.zeros(4, 4), float32=True) is cpu_gemm.available(torch.float32)
    assert not can_pack(torch.full((4, 4), 1 + 2**-10), float32=True)  # not a bf16 value: never narrowed


NO_AVX2 = "this CPU has no AVX2/FMA (or no C compiler): dflash-trt's fp32 GEMM on bf16 weights does not run"


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(61, 32), (100, 64), (1000, 512)])
def test_float32_gemm_on_bf16_weights_equals_a_float32_product(m, n, k) -> None:
    """The AVX2 kernel: fp32 activations, weights kept as bf16, an fp32 result equal to the fp32
    product of the same (bf16-valued) weights up to the summation order."""
    if not cpu_gemm.available(torch.float32):
        pytest.skip(NO_AVX2)
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16().float()  # a bf16 checkpoint loaded in fp32
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    assert cpu_gemm.supports(w) and not cpu_gemm.supports(w + 2**-12)
    packed = cpu_gemm.pack(w)
    assert packed.data.dtype == torch.bfloat16  # half the bytes of the fp32 weight
    for b in (None, bias):
        got = cpu_gemm.gemm(x, packed, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_float32_engine_keeps_bf16_weights_and_is_lossless(monkeypatch) -> None:
    """tiny in float32 with its (bf16-checkpoint) weights kept as bf16 for the AVX2 kernel, as the
    engine does for models whose steps stream their weights (the line lowered here to reach tiny): greedy
    DFlash output equals the plain greedy output of the same target with dense fp32 weights."""
    from dflash_trt.engine import assemble as engine_mod
    from dflash_trt.tiny import heldout_prompts

    if not cpu_gemm.available(torch.float32):
        pytest.skip(NO_AVX2)
    tiny = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"}
    prompts = heldout_prompts()[:4]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    with cpu_gemm.switched(False), LLM("tiny", dtype="float32", compile=False) as plain:
        assert plain.engine.packed_weights == 0  # dense fp32 weights on MKL's GEMMs
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    monkeypatch.setattr(engine_mod, "streams_weights", lambda n: True)
    with LLM("tiny", dtype="float32", compile=False, speculative_config=tiny, max_batch_size=4) as llm:
        assert llm.engine.packed_weights > 4 * 12 + 1  # the target's and the drafter's linears
        head = llm.engine.target.lm_head
        assert isinstance(linear_mod._PACKED[head.packed._cdata], cpu_gemm.BlockedWeight)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want


@pytest.mark.parametrize("t", [1, 7, 16])
@pytest.mark.parametrize("sinks", [False, True])
def test_gemm_attention_equals_float32_sdpa(t, sinks) -> None:
    g = torch.Generator().manual_seed(t)
    bs, h, hkv, lk, d = 3, 8, 2, 40, 32
    q, k, v = (torch.randn(*s, generator=g) for s in ((bs, h, t, d), (bs, hkv, lk, d), (bs, hkv, lk, d)))
    keys = torch.arange(lk)
    lens = torch.tensor([lk, 25, 9])
    mask = (keys[None, None, None, :] < lens[:, None, None, None]) & (
        keys[None, None, None, :] <= (lens[:, None, None, None] - t + torch.arange(t)[None, None, :, None])
    )  # [bs, 1, T, L]: causal tail of each sequence
    mask[2, :, 0] = False  # a row that sees nothing (padding): finite output, no NaN
    sink = torch.randn(h, generator=g) if sinks else None
    want = attend(q, k, v, mask, scale=d**-0.5, sinks=sink)  # float32: torch's SDPA
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scale=d**-0.5, sinks=sink)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    ok = mask.any(-1).expand(bs, h, t)  # rows with at least one visible key
    assert torch.allclose(got.float()[ok], want[ok], atol=3e-2, rtol=3e-2)


@pytest.fixture
def threads_restored():
    """torch's thread count and the bf16 kernels' own, as they were before the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_gemm.set_threads(0)


def test_bf16_engine_is_lossless_and_runs_packed(threads_restored) -> None:
    """tiny in bfloat16: greedy DFlash output equals plain greedy output of the same bf16 target,
    batched and alone, with every linear prepacked. The DFlash engine is given two cores: where
    dflash-trt's bf16 GEMM runs, it takes both for its wide products and torch runs on one."""
    from dflash_trt.tiny import heldout_prompts

    tiny = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"}
    prompts = heldout_prompts()[:4]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    packs = can_pack(torch.zeros(16, 16, dtype=torch.bfloat16))  # not on an AVX2-only CPU: dense bf16
    with LLM("tiny", dtype="bfloat16", compile=False) as plain:
        assert plain.engine.packed_weights == (4 * 12 + 1 if packs else 0)  # tiny: 12 layers, tied head
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    with LLM("tiny", dtype="bfloat16", compile=False, speculative_config=tiny, max_batch_size=4,
             cpu_threads=2) as llm:  # fmt: skip
        assert llm.engine.packed_weights > 4 * 12 + 1 or not packs  # the drafter's too
        split = cpu_gemm.bf16_op_available()
        assert (llm.cpu_threads, cpu_gemm.threads()) == ((1, 2) if split else (2, 2))
        seen = _threads_seen(llm.engine.runner.executor.parts)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        alone = llm.generate(prompts[1], sp).outputs[0].token_ids
        stats = llm.generate(
            prompts[0], SamplingParams(max_tokens=48, ignore_eos=True, return_perf_metrics=True)
        )
    assert got == want and alone == want[1]
    spec = stats.outputs[0].request_perf_metrics.speculative_decoding
    assert spec.total_accepted_draft_tokens > 0  # the drafter really drafted (through the packed head)
    assert seen == {"prefill": {2}, "round": {1 if split else 2}}  # a prefill runs on every core


def _threads_seen(parts) -> dict[str, set[int]]:
    """torch's thread count inside each prefill and round `parts` runs from now on (an eager engine)."""
    seen: dict[str, set[int]] = {}

    def spied(name: str):
        real = getattr(parts, name)

        def spy(*args, **kwargs):
            seen.setdefault(name, set()).add(torch.get_num_threads())
            return real(*args, **kwargs)

        return spy

    for name in ("prefill", "round"):
        setattr(parts, name, spied(name))
    return seen


@pytest.mark.parametrize("m", [0, 1, 5, 17])
def test_the_bf16_operator_is_the_kernel_and_whole_blocks_only_take_it(m) -> None:
    """Where `dflash_bf16::linear` runs, a whole-block bf16 weight is held packed (4-D) and the operator
    gives the ctypes call's results bit for bit; a width that is not a whole number of blocks keeps the
    placeholder (the packed shape could not name it). Where it does not run (no AVX512-BF16), no layer
    is given a 4-D weight: the placeholder path (or the dense one) serves it."""
    whole, ragged = Linear(64, 96, bias=False).bfloat16(), Linear(64, 90, bias=False).bfloat16()
    pack_linears(whole)
    pack_linears(ragged)
    assert ragged.packed is None or linear_mod.is_packed(ragged.packed)
    if not cpu_gemm.bf16_op_available():
        assert whole.packed is None or linear_mod.is_packed(whole.packed)
        return
    assert whole.packed.dim() == 4
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    x = torch.randn(2, m, 64, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    packed = cpu_gemm.pack(w)
    for b in (None, bias):
        assert torch.equal(torch.ops.dflash_bf16.linear(x, packed.data, b, 96), cpu_gemm.gemm(x, packed, b))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.dflash_bf16.linear(x[..., :32], packed.data, None, 96)


@pytest.mark.parametrize("m", [1, 7, 8, 40])
def test_the_bf16_kernels_threads_are_their_own_and_change_no_bit(m, threads_restored) -> None:
    """`engine_threads` gives the cores to dflash-trt's bf16 GEMM and one to torch where the operator
    runs, all to torch elsewhere (oneDNN and MKL run on torch's threads) and for fp32; `all_cores` gives
    them back to torch for a block; the kernel's results do not depend on its thread count (each thread
    owns whole output blocks)."""
    assert cpu_gemm.engine_threads(torch.float32, 2) == 2 and cpu_gemm.threads() == torch.get_num_threads()
    torch.set_num_threads(1)
    with cpu_gemm.all_cores():
        assert torch.get_num_threads() == 1  # no count of their own: torch's stays
    with pytest.raises(ValueError, match="n=-1"):
        cpu_gemm.set_threads(-1)
    if not cpu_gemm.bf16_op_available():
        assert cpu_gemm.engine_threads(torch.bfloat16, 2) == 2
        return
    assert cpu_gemm.engine_threads(torch.bfloat16, 1) == 1 and cpu_gemm.threads() == torch.get_num_threads()
    assert cpu_gemm.engine_threads(torch.bfloat16, 2) == 1 and cpu_gemm.threads() == 2
    with cpu_gemm.all_cores():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    g = torch.Generator().manual_seed(m)
    packed = cpu_gemm.pack((torch.randn(208, 96, generator=g) * 0.1).bfloat16())
    x = torch.randn(m, 96, generator=g).bfloat16()
    outs = []
    for n in (1, 2, 3):
        cpu_gemm.set_threads(n)
        outs += [torch.ops.dflash_bf16.linear(x, packed.data, None, 208), cpu_gemm.gemm(x, packed, None)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_the_bf16_operators_team_serves_two_callers_and_a_forked_child(threads_restored) -> None:
    """The operator's own worker threads (spin_team.h): a call that finds the team busy runs alone, so two
    threads calling at once both get the exact product; a forked child, whose copy of the process has
    no workers, starts a team of its own instead of waiting on the parent's (a hang is a failure)."""
    if not cpu_gemm.bf16_op_available():
        pytest.skip(NO_KERNEL)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    packed = cpu_gemm.pack((torch.randn(400, 64, generator=g) * 0.1).bfloat16())
    xs = [torch.randn(m, 64, generator=g).bfloat16() for m in (1, 3, 9)]
    want = [torch.ops.dflash_bf16.linear(x, packed.data, None, 400) for x in xs]  # one thread: no team
    cpu_gemm.set_threads(2)
    wrong: list[int] = []

    def caller() -> None:
        for i in range(300):
            x = xs[i % 3]
            if not torch.equal(torch.ops.dflash_bf16.linear(x, packed.data, None, 400), want[i % 3]):
                wrong.append(i)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and wrong == []
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its products are exact
        ok = all(
            torch.equal(torch.ops.dflash_bf16.linear(x, packed.data, None, 400), w) for x, w in zip(xs, want)
        )
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child hung or was wrong"
