# SPDX-License-Identifier: Apache-2.0
"""float32 on CPU with AVX-512F: `dflash_f32::linear` (layers/gemm_f32_op.cpp, a C++ operator) on
weights packed as [N/16, K, 16] computes the fp32 product, gives a row the same bits whatever the batch
it is in, runs inside a compiled graph, and keeps the engine lossless (layers/linear.py, cpu_gemm.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

from dflash_trt import LLM, SamplingParams
from dflash_trt.layers import cpu_gemm
from dflash_trt.layers.linear import FusedLinear, Linear, can_pack, linear, pack_linears

# Where the operator cannot run (no AVX-512F, no C++ compiler) nothing is packed for it and the layers
# keep MKL's GEMMs: the tests below check that instead of the operator.
HAS_OP = cpu_gemm.f32_available()


def test_the_operator_runs_exactly_where_the_cpu_has_avx512f() -> None:
    from dflash_trt.utils.device import cpu_flags

    if "avx512f" not in cpu_flags() or os.environ.get(cpu_gemm.SWITCH_ENV) == "0":
        assert not HAS_OP and not can_pack(torch.zeros(32, 8))
    else:  # x86-64 with AVX-512F and g++ (the machines this project runs on)
        assert HAS_OP and can_pack(torch.zeros(32, 8))


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(16, 8), (61, 32), (256, 128), (264, 128), (128, 384)])
def test_the_operator_equals_a_float32_product(m, n, k) -> None:
    """Every row tile (16, 8, 4, 2, 1 and remainders), a last block of fewer than 16 outputs, with
    and without a bias, leading dimensions kept (where the operator runs)."""
    if not HAS_OP:
        assert not hasattr(torch.ops.dflash_f32, "linear")  # never loaded: nothing can call it
        return
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_gemm.pack_f32(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == torch.float32
    for b in (None, bias):
        got = torch.ops.dflash_f32.linear(x, packed, b, n)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.ops.dflash_f32.linear(x.reshape(m, 1, k), packed, None, n).shape == (m, 1, n)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.dflash_f32.linear(torch.zeros(1, k + 1), packed, None, n)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.dflash_f32.linear(x, packed, None, n + 16)


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """One FMA chain per output, in the same order for every row count: a verify pass of 16 tokens
    and a plain step of one compute a token's logits bit for bit alike (where the operator runs)."""
    if not HAS_OP:
        return
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(272, 384, generator=g), torch.randn(37, 384, generator=g)
    packed = cpu_gemm.pack_f32(w)
    full = torch.ops.dflash_f32.linear(x, packed, None, 272)
    for lo, hi in ((0, 1), (5, 6), (3, 19), (20, 37), (0, 37)):
        assert torch.equal(torch.ops.dflash_f32.linear(x[lo:hi], packed, None, 272), full[lo:hi])


def test_packed_fp32_linears_run_compiled_and_release_the_dense_weights() -> None:
    """Whole-block widths are packed (a 3-D tensor the layer holds), others stay dense on MKL; the
    packed layers give the dense result eagerly and inside torch.compile."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 48, bias=False), Linear(48, 40, bias=True))
    fused = FusedLinear.of([Linear(64, 32, bias=False), Linear(64, 16, bias=False)])
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want, want_fused = model(x), fused(x)
        if not HAS_OP:  # MKL everywhere: nothing packed, the same results
            assert pack_linears(model) == 0 and pack_linears(fused) == 0 and model[0].packed is None
            torch.testing.assert_close(model(x), want, rtol=0, atol=0)
            return
        assert pack_linears(model) == 1 and pack_linears(fused) == 1  # 40 outputs: not a whole block
        assert model[0].packed is not None and model[0].packed.dim() == 3 and model[0].weight.numel() == 0
        assert model[1].packed is None and model[1].weight.numel() == 48 * 40
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
        for a, b in zip(fused(x), want_fused, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(lambda t: linear(t, model[0].packed), fullgraph=True)
        assert torch.equal(compiled(x), model[0](x))  # the operator inside a compiled graph
    assert not can_pack(torch.zeros(40, 8)) and can_pack(torch.zeros(32, 8))
    with cpu_gemm.switched(False):
        assert not can_pack(torch.zeros(32, 8))  # DFLASH_TRT_CPU_GEMM=0: MKL everywhere


def test_fp32_engine_runs_packed_and_equals_the_dense_engine() -> None:
    """tiny in float32 (its default on CPU): with the fp32 operator, greedy DFlash and plain output
    equal the same engine's with dense weights on MKL, batched and alone."""
    from dflash_trt.tiny import heldout_prompts

    tiny = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"}
    prompts = heldout_prompts()[:4]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    with cpu_gemm.switched(False), LLM("tiny", dtype="float32", compile=False) as dense:
        assert dense.engine.packed_weights == 0
        want = [o.outputs[0].token_ids for o in dense.generate(prompts, sp)]
    with LLM("tiny", dtype="float32", compile=False) as plain:
        # every projection where the operator runs (the 264-wide head stays dense); none elsewhere
        assert plain.engine.packed_weights == (4 * 12 if HAS_OP else 0)
        assert plain.engine.target.model.layers[0].mlp.gate_up.weight.dim() == (3 if HAS_OP else 2)
        assert [o.outputs[0].token_ids for o in plain.generate(prompts, sp)] == want
    with LLM("tiny", dtype="float32", compile=False, speculative_config=tiny, max_batch_size=4) as llm:
        assert (llm.engine.packed_weights > 4 * 12) is HAS_OP  # the drafter's too
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        alone = llm.generate(prompts[1], sp).outputs[0].token_ids
    assert got == want and alone == want[1]


def test_a_packed_fp32_head_is_shared_with_the_drafter(tmp_path) -> None:
    """A target whose LM head is a whole number of blocks wide (most real vocabularies) has it packed
    for the fp32 operator; the drafter drafts through that packed head, and greedy DFlash equals plain
    decoding."""
    from dflash_trt.models.checkpoint import save_drafter
    from tests.conftest import make_drafter, make_target

    target = make_target("qwen3", seed=4, vocab=64, layers=2)
    target.save_pretrained(tmp_path / "target")
    save_drafter(make_drafter(target, block_size=4, seed=5, std=0.5), tmp_path / "drafter")
    spec = {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": str(tmp_path / "drafter")}
    prompts, sp = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(str(tmp_path / "target"), dtype="float32", compile=False) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    with LLM(str(tmp_path / "target"), dtype="float32", compile=False, speculative_config=spec) as llm:
        assert (llm.engine.target.lm_head.packed is not None) is HAS_OP
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
