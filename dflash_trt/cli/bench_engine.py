# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt bench engine`: offline AR vs DFlash on the embedded engine (no server)."""

from __future__ import annotations

import json
import sys

import click


def _ints(value: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of integers", param_hint=flag
        ) from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"{value!r}: need positive integers", param_hint=flag)
    return out


@click.command()
@click.option("--target", default="tiny", show_default=True, metavar="NAME_OR_DIR")
@click.option(
    "--drafter", metavar="DIR", help="Drafter directory (default: the target's registered drafter)."
)
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Runtime block size (default: trained)."
)
@click.option(
    "--batch-sizes", default="1,2,4,8,16,32,64", show_default=True, help="Comma-separated batch sizes."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="Output tokens per request.",
)
@click.option("--modes", type=click.Choice(["both", "ar", "dflash"]), default="both", show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True
)
@click.option(
    "--tree-budget",
    metavar="N|auto",
    default="0",
    show_default=True,
    help="DFlash mode verifies a DDTree of N drafted nodes per round (0 = linear DFlash; auto = chosen by "
    "the engine). Not in the embedded engine yet: a non-zero budget is refused.",
)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON result to this file.")
def engine(
    target: str,
    drafter: str | None,
    block_size: int | None,
    batch_sizes: str,
    max_tokens: int,
    modes: str,
    device: str,
    dtype: str,
    tree_budget: str,
    enforce_eager: bool,
    as_json: bool,
    out: str | None,
) -> None:
    """Offline throughput of the embedded engine: plain decoding (AR) vs DFlash.

    Each point submits `batch` greedy requests at once (ignore_eos, fixed output length) and
    reports output tokens/s, decode tokens/s, mean acceptance length (tau, bonus included), the
    round time split (draft / verify / accept / other) and peak memory, with the configuration.

    \b
    Example:
      dflash-trt bench engine --target tiny --batch-sizes 1,8,32 --max-tokens 128
    """
    sizes = _ints(batch_sizes, "--batch-sizes")
    from dflash_trt.bench.engine_bench import format_table, run_engine_benchmark

    chosen = ("ar", "dflash") if modes == "both" else (modes,)

    def progress(point) -> None:
        click.echo(
            f"  {point.mode} batch {point.batch_size}: {point.output_tokens_per_s:.1f} tok/s", err=True
        )

    result = run_engine_benchmark(
        target=target,
        drafter=drafter,
        block_size=block_size,
        batch_sizes=sizes,
        max_tokens=max_tokens,
        modes=chosen,
        device=device,
        dtype=dtype,
        tree_budget=tree_budget,
        enforce_eager=enforce_eager,
        progress=progress,
    )
    if out:
        from pathlib import Path

        from dflash_trt.utils.io import atomic_write_text

        atomic_write_text(Path(out), json.dumps(result, indent=2) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        click.echo(format_table(result))
