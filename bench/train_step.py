# SPDX-License-Identifier: Apache-2.0
"""One `train-drafter` step on the real pair (`smollm2-135m`), per precision and loss vocabulary, in one run:
what the trainer's CPU defaults (bf16 autocast, `--loss-vocab data`) rest on.

  variants  fp32      the drafter's math in fp32, the loss over the whole 49152-token head (the trainer's
                      CPU path before autocast was enabled there)
            autocast  bf16 autocast (fp32 master weights), the whole head
            default   bf16 autocast and the loss over the training samples' vocabulary (`--loss-vocab data`)
  step      the recipe's shape: the v1 drafter (2 layers, block 16), 8 sequences of 384 tokens, --anchors
            blocks each; features and token ids are random (the target's forward is not timed: features
            come from the feature cache after the first epoch), labels drawn from --vocab token ids (default:
            the distinct tokens of the recipe's regenerated answers when build/out holds them, else 9000)
  timing    --repeats rounds; each runs every variant once in turn (forward, loss, backward, AdamW step)
            after one warm-up step; the median per variant and each variant's ratio to fp32

    .venv/bin/python bench/train_step.py --out bench/results/train-step-2026-12-06
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
REGEN = REPO / "build" / "out" / "smollm2-pair" / "regenerated"
VARIANTS = ("fp32", "autocast", "default")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence (the recipe's --num-anchors)")
    p.add_argument("--vocab", type=int, default=None, help="distinct label tokens (default: see above)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write DIR/results.json")
    args = p.parse_args(argv)
    for flag in ("anchors", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    return args


def data_vocab_size() -> tuple[int, str]:
    """Distinct tokens of the regenerated answers (the recipe's data), or 9000 when they are not here."""
    files = sorted(REGEN.glob("*.jsonl")) if REGEN.is_dir() else []
    if not files:
        return 9000, "assumed (no regenerated answers under build/out)"
    seen: set[int] = set()
    for line in files[0].read_text().splitlines():
        seen.update(json.loads(line)["output_ids"])
    return len(seen), f"the distinct answer tokens of {files[0].relative_to(REPO)}"


def setup(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    import torch

    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.smollm2 import ensure_smollm2
    from dflash_trt.training.forward import LossVocab, make_block_batch, sample_anchors

    torch.manual_seed(0)
    target = ensure_smollm2().target
    drafter = load_drafter(REPO / "dflash_trt" / "assets" / "smollm2-135m" / "drafter", dtype=torch.float32)
    from safetensors.torch import load_file

    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    drafter.bind_target(embed, embed)
    bs, s, block = 8, 384, drafter.block_size
    pool = torch.randperm(embed.shape[0])[:vocab_size]
    ids = pool[torch.randint(0, vocab_size, (bs, s))]
    mask, lengths = torch.ones_like(ids), torch.full((bs,), s)
    g = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(mask[i], length=s, block_size=block, num_anchors=args.anchors, generator=g)
               for i in range(bs)]  # fmt: skip
    return {
        "drafter": drafter,
        "feats": torch.randn(bs, s, drafter.fc.weight.shape[1]).bfloat16() * 10,
        "ids": ids,
        "batch": make_block_batch(ids, mask, lengths, anchors, block_size=block, gamma=7.0),
        "vocab": LossVocab.of(ids, embed.shape[0]),
        "opt": torch.optim.AdamW(drafter.parameters(), lr=1e-6),
    }


def step(state: dict[str, Any], variant: str) -> float:
    import torch

    from dflash_trt.training.forward import dflash_loss, training_forward

    d, bb = state["drafter"], state["batch"]
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant != "fp32"):
        hidden = training_forward(d, state["feats"], state["ids"], bb.anchors, bb.valid)
        loss, _ = dflash_loss(d, hidden, bb, vocab=state["vocab"] if variant == "default" else None)
    state["opt"].zero_grad(set_to_none=True)
    loss.backward()
    state["opt"].step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import torch

    from dflash_trt.utils.device import cpu_model_name

    args = parse_args(argv)
    vocab_size, vocab_from = (args.vocab, "--vocab") if args.vocab else data_vocab_size()
    state = setup(args, vocab_size)
    config = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model_name(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "anchors": args.anchors,
        "label_vocab": vocab_size, "label_vocab_from": vocab_from, "repeats": args.repeats,
    }  # fmt: skip
    print("config:", json.dumps(config))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        step(state, v)  # warm-up
    for r in range(args.repeats):
        for v in VARIANTS:
            times[v].append(step(state, v))
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in VARIANTS), flush=True)
    med = {v: statistics.median(t) for v, t in times.items()}
    for v in VARIANTS:
        print(f"{v:9s} median {med[v]:.3f} s/step   fp32/{v} {med['fp32'] / med[v]:.2f}x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps({**config, "seconds": times, "median": med}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
