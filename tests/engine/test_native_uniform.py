# SPDX-License-Identifier: Apache-2.0
"""`dflash_rng::uniform` (spec/uniform_op.cpp): the counter-based uniforms of `sampling.uniform` from
one C++ operator give the torch ops' values bit for bit, for every seed, position, purpose and shape
the rounds use, inside a compiled graph too; the engine uses it on CPU and samples the same tokens
with it and without it (linear DFlash and DDTree)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.spec import native_uniform
from dflash_trt.spec.sampling import PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_EMIT, uniform

HAS_OP = native_uniform.available()
SEEDS = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1, 987654321987654321]


def test_the_operator_runs_wherever_a_cpp_compiler_does() -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if os.environ.get(native_uniform.SWITCH_ENV) == "0" or compiler is None:
        assert not HAS_OP
    else:  # the machines this project runs on have g++
        assert HAS_OP


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5)])
def test_same_bits_as_the_torch_ops(shape: tuple[int, ...]) -> None:
    if not HAS_OP:
        return
    g = torch.Generator().manual_seed(len(shape))
    seeds = torch.tensor(SEEDS + torch.randint(0, 2**62, (22,), generator=g).tolist())
    n = seeds.numel()
    # small, past 2**32 and negative positions: the hash reads their low 32 bits
    positions = torch.randint(-(2**40), 2**40, (n, *shape), generator=g)
    positions[: n // 2] = torch.randint(0, 4096, (n // 2, *shape), generator=g)
    for purpose in (PURPOSE_DRAFT, PURPOSE_ACCEPT, PURPOSE_EMIT, 3):
        want = uniform(seeds, positions, purpose)
        got = uniform(seeds, positions, purpose, native=True)
        assert got.dtype == torch.float32 and got.shape == positions.shape
        assert torch.equal(got, want), purpose
        assert bool(((got > 0) & (got < 1)).all())
    if positions.dim() == 2:  # a strided view (block_pos[:, 1:] in the round) and int32 positions
        view = positions[:, 1:]
        assert torch.equal(uniform(seeds, view, 1, native=True), uniform(seeds, view, 1))
        small = positions[: n // 2].int()
        assert torch.equal(
            uniform(seeds[: n // 2], small, 2, native=True), uniform(seeds[: n // 2], small, 2)
        )


def test_off_the_cpu_the_torch_ops_are_used() -> None:
    """`native` names a CPU operator; a tensor elsewhere (here: meta) takes the torch ops."""
    seeds = torch.zeros(3, dtype=torch.long, device="meta")
    out = uniform(seeds, torch.zeros(3, 4, dtype=torch.long, device="meta"), 0, native=True)
    assert out.device.type == "meta" and out.shape == (3, 4)


def test_bad_arguments_are_named() -> None:
    if not HAS_OP:
        return
    op = torch.ops.dflash_rng.uniform
    with pytest.raises(RuntimeError, match="positions has 2 rows for 3 seeds"):
        op(torch.zeros(3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), 0)
    with pytest.raises(RuntimeError, match=r"seeds: \[N\] int64"):
        op(torch.zeros(3, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.long), 0)
    with pytest.raises(RuntimeError, match=r"positions: \[N, ...\] int64"):
        op(torch.zeros(3, dtype=torch.long), torch.zeros(3, 4), 0)


def test_the_operator_runs_inside_a_compiled_graph() -> None:
    """Inductor calls it as an extern kernel (its fake implementation gives the shape and dtype)."""
    if not HAS_OP:
        return
    seeds = torch.tensor(SEEDS)
    lens = torch.arange(len(SEEDS)) * 37

    def fn(seeds, lens):
        pos = lens[:, None] + torch.arange(16)
        return (
            uniform(seeds, pos[:, 1:], PURPOSE_ACCEPT, native=True) * 2 + uniform(seeds, pos + 1, 2)[:, :15]
        )

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(seeds, lens), fn(seeds, lens))


@pytest.mark.slow
def test_the_engine_samples_the_same_tokens_with_and_without_the_operator(monkeypatch) -> None:
    """`tiny` with its drafter, seeded sampling, batched, linear DFlash and a DDTree budget: identical
    token ids with the operator and with the torch ops (DFLASH_TRT_CPU_UNIFORM=0), eager rounds; the
    compile fingerprint's facts tell the two apart."""
    if not HAS_OP:
        return
    prompts = ["def add(a, b):", "for i in range(10):", "import os\n"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, seed=3),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=11),
    ]
    outs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(native_uniform.SWITCH_ENV, switch)
        for budget in (0, 16):
            spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
            if budget:
                spec["tree_budget"] = budget
            with LLM("tiny", speculative_config=spec, compile=False) as llm:
                assert llm.engine.parts.native_uniform == (switch == "1")
                assert llm.engine.executor.compile_facts()["native_uniform"] == (switch == "1")
                outs[switch, budget] = [
                    [o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in params
                ]
    assert outs["1", 0] == outs["0", 0]
    assert outs["1", 16] == outs["0", 16]
