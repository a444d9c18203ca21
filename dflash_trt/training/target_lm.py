# SPDX-License-Identifier: Apache-2.0
"""A small plain causal-LM trainer: how the `tiny` target is made.

Documents are tokenised, joined with an end-of-text token into one stream, and each step draws
`batch_size` random windows of `seq_len + 1` tokens (seeded, so a run is reproducible on a fixed
thread count). AdamW, linear warm-up, cosine decay to 10 %, gradient clip 1.0; the held-out
loss is reported at the end. The result is a transformers `save_pretrained` directory with the
tokenizer and a generation config, i.e. an ordinary DFlash target.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LMTrainConfig:
    steps: int = 1500
    batch_size: int = 8  # sequences per step
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_batches: int = 16


def token_stream(texts: Sequence[str], tokenizer: Any, *, eos_id: int) -> torch.Tensor:
    """Documents -> one stream [N] of token ids, each document followed by `eos_id`."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """stream: [N]; starts: [b] -> [b, length] int64."""
    offsets = torch.arange(length)
    return stream[starts[:, None] + offsets[None, :]].long()


def lr_at(step: int, *, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to `peak * min_ratio` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_causal_lm(
    model: torch.nn.Module,
    train_stream: torch.Tensor,
    eval_stream: torch.Tensor | None,
    cfg: LMTrainConfig,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train `model` (a transformers causal LM) in place. Streams: [N] token ids.

    Returns {"train_loss": last smoothed loss, "eval_loss": held-out loss or None, "seconds"}.
    """
    if train_stream.numel() <= cfg.seq_len + 1:
        raise ValueError(f"training stream has {train_stream.numel()} tokens, need more than seq_len + 1")
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "norm" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    smoothed = float("nan")
    t0 = time.perf_counter()
    high = train_stream.numel() - cfg.seq_len - 1
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(
                step, total=cfg.steps, warmup=cfg.warmup_steps, peak=cfg.lr, min_ratio=cfg.min_lr_ratio
            )
        starts = torch.randint(0, high, (cfg.batch_size,), generator=gen)
        batch = _windows(train_stream, starts, cfg.seq_len + 1)  # [b, S + 1]
        out = model(input_ids=batch[:, :-1])
        logits = out.logits.float()  # [b, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        value = float(loss.detach())
        smoothed = value if math.isnan(smoothed) else 0.98 * smoothed + 0.02 * value
        if progress is not None:
            progress(step + 1, smoothed)
    model.eval()
    eval_loss = evaluate_lm(model, eval_stream, cfg) if eval_stream is not None else None
    return {"train_loss": smoothed, "eval_loss": eval_loss, "seconds": time.perf_counter() - t0}


@torch.no_grad()
def evaluate_lm(model: torch.nn.Module, stream: torch.Tensor, cfg: LMTrainConfig) -> float:
    """Mean next-token cross entropy (nats/token) over fixed evenly spaced windows of `stream`."""
    n = min(cfg.eval_batches * cfg.batch_size, max(1, (stream.numel() - 1) // (cfg.seq_len + 1)))
    starts = torch.linspace(0, stream.numel() - cfg.seq_len - 2, n).long()
    total, count = 0.0, 0
    for chunk in starts.split(cfg.batch_size):
        batch = _windows(stream, chunk, cfg.seq_len + 1)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        )
        count += batch[:, 1:].numel()
    return total / count


def save_target(
    model: Any, tokenizer: Any, out: Path, *, eos_id: int, dtype: torch.dtype, info: dict
) -> None:
    """save_pretrained the target (weights in `dtype`), its tokenizer and a generation config."""
    from transformers import GenerationConfig

    from dflash_trt.utils.io import atomic_dir

    with atomic_dir(out, overwrite=True) as tmp:
        model.generation_config = GenerationConfig(eos_token_id=eos_id)
        # Round-trips through `dtype` in place: the model in memory afterwards equals the saved
        # one (loaded as float32), which is what the drafter must be trained against.
        model.to(dtype).save_pretrained(tmp)
        model.to(torch.float32)
        tokenizer.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
