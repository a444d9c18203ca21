# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt train-drafter`: train a DFlash drafter for a frozen target."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dflash_trt.cli.options import device_option, dtype_option
from dflash_trt.errors import UsageError


def _layer_ids(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        ids = tuple(int(x) for x in value.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise UsageError(
            f"--target-layer-ids={value!r} is not a comma-separated list of integers",
            hint="e.g. --target-layer-ids 1,9,17,25,33",
        ) from None
    if not ids:
        raise UsageError("--target-layer-ids is empty", hint="e.g. --target-layer-ids 1,9,17")
    return ids


def _prompt_len(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        a = int(lo)
        b = int(hi) if sep else a
    except ValueError:
        raise UsageError(
            f"--regen-prompt-len={value!r} is not MIN:MAX (or N)", hint="e.g. --regen-prompt-len 16:256"
        ) from None
    return a, b


@click.command("train-drafter")
@click.option(
    "--target",
    required=True,
    metavar="NAME_OR_DIR",
    help="`tiny`, `smollm2-135m`, a .gguf file, or a transformers model directory (frozen).",
)
@click.option(
    "--data",
    required=True,
    metavar="FILE_OR_DIR",
    help='JSONL ({"messages": [...]} chat: loss on assistant turns; {"text": ...}), a text file, or a directory of text files.',
)
@click.option(
    "--out", required=True, metavar="DIR", help="Output: the z-lab drafter checkpoint plus training state."
)
@click.option(
    "--drafter-config", metavar="FILE_OR_DIR", help="A z-lab config.json to start from (flags override it)."
)
@click.option(
    "--num-layers", type=click.IntRange(min=1), help="Draft layers L [default: 5, at most T/4, at least 1]."
)
@click.option(
    "--block-size", type=click.IntRange(min=2), help="Block size B (anchor + B-1 drafts)  [default: 16]"
)
@click.option(
    "--target-layer-ids",
    metavar="IDS",
    help="Tapped target layers, e.g. 1,9,17 [default: spread over 1..T-3].",
)
@click.option(
    "--mask-token-id",
    type=click.IntRange(min=0),
    help="Mask id [default: <|MASK|>, else the first spare embedding row].",
)
@click.option(
    "--dflash2",
    is_flag=True,
    help="Train a DFlash 2 drafter (DFlash2DraftModel: per-layer dynamic convs and a candidate selector); "
    "implied by a DFlash 2 --drafter-config.",
)
@click.option("--conv-kernel-size", type=click.IntRange(min=1), help="DFlash 2 conv taps  [default: 2]")
@click.option(
    "--conv-group-size",
    type=click.IntRange(min=1),
    help="DFlash 2 channels per dynamic coefficient; must divide the hidden size  [default: 16]",
)
@click.option(
    "--selector-rank", type=click.IntRange(min=1), help="DFlash 2 selector codebook rank  [default: 256]"
)
@click.option(
    "--selector-top-k", type=click.IntRange(min=1), help="DFlash 2 candidates per slot  [default: 16]"
)
@click.option(
    "--selector-loss-weight",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="DFlash 2: weight of the selector's K-way cross entropy.",
)
@click.option(
    "--feature-scaling/--no-feature-scaling",
    default=True,
    show_default=True,
    help="Train fc on the target's features divided by each channel's RMS, folded back into fc on export "
    "(the checkpoint's layout is unchanged).",
)
@click.option(
    "--loss-vocab",
    type=click.Choice(["data", "full"]),
    default="data",
    show_default=True,
    help="The softmax of the loss runs over every token the training samples hold (data), or over the "
    "target's whole vocabulary (full). Drafting always uses the whole head.",
)
@click.option(
    "--num-anchors",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Anchors (blocks) per sequence.",
)
@click.option(
    "--gamma",
    type=float,
    default=7.0,
    show_default=True,
    help="Loss decay exp(-(k-1)/gamma); 4 suits block 8.",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=4),
    default=2048,
    show_default=True,
    help="Tokens per training sequence.",
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences per step."
)
@click.option(
    "--lr", type=float, default=6e-4, show_default=True, help="Peak AdamW learning rate (cosine decay)."
)
@click.option("--warmup-ratio", type=click.FloatRange(0.0, 1.0), default=0.04, show_default=True)
@click.option("--weight-decay", type=click.FloatRange(min=0.0), default=0.01, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (instead of --epochs).")
@click.option("--epochs", type=click.IntRange(min=1), help="Passes over the data  [default: 6]")
@click.option(
    "--max-samples", type=click.IntRange(min=1), help="Use at most this many sequences (a seeded subset)."
)
@click.option(
    "--regenerate", is_flag=True, help="Train on answers generated by the target itself (cached under --out)."
)
@click.option(
    "--regen-temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy."
)
@click.option("--regen-top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option(
    "--regen-prompt-len",
    default="16:256",
    show_default=True,
    metavar="MIN:MAX",
    help="Text data: the target continues the first MIN..MAX tokens of each window.",
)
@click.option("--regen-batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--regen-cache", metavar="DIR", help="Where regenerated answers are kept [default: OUT/regenerated]."
)
@click.option(
    "--feature-cache",
    metavar="DIR",
    help="Keep the target's features of each sample here: later epochs, and other runs on the same target "
    "and data (a DFlash 2 drafter after v1), skip the target's forward pass.",
)
@click.option(
    "--eval-prompts",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Held-out prompts for the final tau (0 = skip).",
)
@click.option(
    "--eval-data",
    metavar="FILE_OR_DIR",
    help="Prompts for the final tau (same formats as --data; text = a prompt).",
)
@click.option("--eval-max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Checkpoint every N steps.",
)
@click.option("--log-every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option(
    "--save-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
)
@click.option("--seed", type=int, default=0, show_default=True)
@device_option()
@dtype_option("Target dtype (auto: float32 on CPU, bfloat16 on CUDA, with autocast for the drafter).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
def train_drafter(**opts: object) -> None:
    """Train a DFlash drafter for a frozen target (the objective of arXiv 2602.06036).

    The target's embedding and LM head are shared and frozen; the drafter learns to fill blocks
    [anchor, MASK, ...] at random anchors inside the loss-masked tokens, conditioned on the
    target's features, with the position-decayed cross entropy. With --dflash2 it is a DFlash 2
    drafter: its convolutions start as the identity and its selector learns a K-way cross entropy
    over the drafter's top-K (true predecessor fed in, the label added when it is missing).
    The result in --out is a z-lab
    checkpoint (config.json + model.safetensors) for `generate --drafter`, the engine, or the
    reference `dflash` package; it ends with tau on held-out prompts.

    \b
    Examples:
      dflash-trt train-drafter --target ./qwen3-4b --data chats.jsonl --regenerate --out ./qwen3-4b-dflash
      dflash-trt train-drafter --target tiny --data ./corpus --num-layers 1 --seq-len 512 \\
          --num-anchors 64 --steps 200 --out ./tiny-drafter
      dflash-trt train-drafter --target tiny --data ./corpus ... --out ./tiny-drafter --resume

    Progress bars go to stderr when it is a terminal; otherwise one line per --log-every steps.
    """
    from dflash_trt.training.trainer import TrainConfig
    from dflash_trt.training.trainer import train_drafter as run

    as_json = bool(opts.pop("as_json"))
    opts["target_layer_ids"] = _layer_ids(opts["target_layer_ids"])  # type: ignore[arg-type]
    opts["regen_prompt_len"] = _prompt_len(str(opts["regen_prompt_len"]))
    cfg = TrainConfig(**opts)  # type: ignore[arg-type]
    tty = sys.stderr.isatty()
    result = run(cfg, progress=tty, report=None if tty else _report_line)
    _print_result(result, as_json=as_json)


def _report_line(entry: dict) -> None:
    """One stderr line per report when stderr is not a terminal (no progress bars then)."""
    if entry.get("phase") == "regenerate":
        click.echo(f"regenerate {entry['done']}/{entry['total']}", err=True)
    else:
        click.echo(
            f"step {entry['step']}/{entry['total']} loss {entry['loss']:.4f} "
            f"tau~{entry['tau_estimate']:.2f} lr {entry['lr']:.2e}"
            + (f" overturn {entry['overturn']:.2f}" if "overturn" in entry else "")
            + f" ({entry['elapsed_s']:.0f} s)",
            err=True,
        )


def _print_result(result: Any, *, as_json: bool) -> None:
    ev = result.eval
    if as_json:
        summary = {
            "out": str(result.out),
            "steps": result.steps,
            "final_loss": result.final_loss,
            "tau": ev["tau"] if ev else None,
            "tau_pooled": ev["tau_pooled"] if ev else None,
            "eval_prompts": ev["num_prompts"] if ev else 0,
            "seconds": round(result.seconds, 1),
        }
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    tau = (
        f"{ev['tau']:.2f} on {ev['num_prompts']} held-out prompts"
        if ev and ev["tau"] is not None
        else "not measured"
    )
    click.echo(
        f"drafter written to {result.out} after {result.steps} steps (loss {result.final_loss:.4f}); "
        f"tau {tau}; {result.seconds:.0f} s"
    )
