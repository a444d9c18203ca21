# SPDX-License-Identifier: Apache-2.0
"""The CPU paged-attention operator alone at three shapes, as results.txt beside this file measured it.

    .venv/bin/python bench/results/paged-attention-transpose-2026-12-07/attn_loop.py [save|check]

One torch thread; per shape the best of 3 loops of 200 calls (a shuffled pool, every key visible).
`save` keeps this build's outputs under /tmp; `check` compares this build's with them bit for bit.
"""

from __future__ import annotations

import sys
import time

import torch

from dflash_trt.layers import cpu_attention

SHAPES = {  # name: (batch, query rows, query heads, KV heads, head dim, context keys, dtype)
    "tiny T=1 b64 L256 f32": (64, 1, 4, 2, 32, 256, torch.float32),
    "tiny T=16 b16 L256 f32": (16, 16, 4, 2, 32, 256, torch.float32),
    "smollm2 T=1 b64 L256 bf16": (64, 1, 9, 3, 64, 256, torch.bfloat16),
}


def case(bs: int, t: int, h: int, hkv: int, d: int, lc: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    slots = bs * lc + 16
    k_pool, v_pool = (torch.randn(slots, hkv, d).to(dtype) for _ in range(2))
    q = torch.randn(bs, t, h, d).to(dtype)
    ctx = torch.randperm(slots)[: bs * lc].view(bs, lc).long()
    return q, k_pool, v_pool, ctx, torch.ones(bs, 1, t, lc, dtype=torch.bool)


def call(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    q, k_pool, v_pool, ctx, mask = args
    return torch.ops.dflash_cpu.paged_attention(q, k_pool, v_pool, ctx, None, None, mask, 0.17)


def best_ms(args: tuple[torch.Tensor, ...], calls: int = 200) -> float:
    call(args)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            call(args)
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if not cpu_attention.available():
        raise SystemExit("the CPU paged-attention operator is unavailable here")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for name, shape in SHAPES.items():
        args = case(*shape)
        saved = f"/tmp/attn_{name.replace(' ', '_')}.pt"
        if mode == "save":
            torch.save(call(args), saved)
        elif mode == "check":
            print(f"  bit-identical to the saved run: {torch.equal(torch.load(saved), call(args))}")
        print(f"{name}: {best_ms(args):.3f} ms")


if __name__ == "__main__":
    main()
