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


def _prompts(value: str, target: str) -> tuple[str, ...]:
    """--prompts: the built-in set, the packaged pair's held-out prompts, or the texts of a JSONL file."""
    from pathlib import Path

    from dflash_trt.bench.engine_bench import DEFAULT_PROMPTS

    if value == "builtin":
        return DEFAULT_PROMPTS
    if value == "heldout":
        from dflash_trt import pairs

        if not pairs.is_packaged(target):
            raise click.BadParameter(
                f"heldout: --target {target!r} is not a packaged pair ({', '.join(pairs.pair_names())})",
                param_hint="--prompts",
            )
        return tuple(pairs.heldout_texts(target))
    from dflash_trt.utils.jsonl import iter_jsonl

    path = Path(value)
    if not path.is_file():
        raise click.BadParameter(f"{value!r} is not builtin, heldout or a JSONL file", param_hint="--prompts")
    records = iter_jsonl(path, name=f"--prompts={value}", hint='one {"text": ...} object per line')
    texts = tuple(r["text"] for _, r in records if isinstance(r, dict) and isinstance(r.get("text"), str))
    if not texts:
        raise click.BadParameter(f"{value!r} has no line with a 'text' string", param_hint="--prompts")
    return texts


@click.command()
@click.option("--target", default="tiny", show_default=True, metavar="NAME_OR_DIR")
@click.option(
    "--drafter",
    metavar="DIR",
    help="Drafter directory, or tiny-dflash2 (default: the target's registered drafter).",
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
    metavar="N|auto[,...]",
    default="0",
    show_default=True,
    help="DFlash modes, comma-separated: 0 = linear DFlash, N = DDTree of N drafted nodes per round, "
    "auto = the budget the engine chooses by measured cost (e.g. 0,16,32,64,auto). One engine each.",
)
@click.option(
    "--draft-len",
    metavar="auto|G[,...]",
    default="auto",
    show_default=True,
    help="Linear DFlash modes, comma-separated: auto = the draft length the engine chooses per batch by "
    "measured cost (the default), G = G drafts per round at every batch size (e.g. auto,15,7,3). One engine each.",
)
@click.option(
    "--prompts",
    "prompt_set",
    default="builtin",
    show_default=True,
    metavar="builtin|heldout|FILE.jsonl",
    help="builtin: 8 short code prompts; heldout: the packaged pair's held-out prompts (tiny: 32 Python "
    "prompts; smollm2-135m: 244 chats, rendered with its template); or a JSONL file with a 'text' per line. Every batch size runs every prompt (in batches of its size).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Passes over the modes per batch size, interleaved; each point pools its passes.",
)
@click.option(
    "--compile/--eager",
    "compile_rounds",
    default=None,
    help="Compiled rounds (torch.compile) or eager ones.  [default: the engine's: compiled where it can run]",
)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON result to this file.")
def engine(
    target: str, drafter: str | None, block_size: int | None, batch_sizes: str, max_tokens: int, modes: str,
    device: str, dtype: str, tree_budget: str, draft_len: str, prompt_set: str, repeats: int,
    compile_rounds: bool | None, enforce_eager: bool, as_json: bool, out: str | None,
) -> None:  # fmt: skip
    """Offline throughput of the embedded engine: plain decoding (AR) vs DFlash (linear and DDTree).

    Each point submits `batch` greedy requests at once (ignore_eos, fixed output length) and
    reports output tokens/s, decode tokens/s, mean acceptance length (tau, bonus included), the DFlash 2
    selector's overturn rate (drafts whose pick is not the drafter's argmax), the round time split
    (draft / verify / accept / other), peak memory and, for DDTree, the budgets the rounds ran, with the
    configuration; then each mode's ratio to AR and to linear DFlash.

    \b
    Examples:
      dflash-trt bench engine --target tiny --batch-sizes 1,8,32 --max-tokens 128
      dflash-trt bench engine --target tiny --batch-sizes 1,16 --tree-budget 0,16,32,64,auto --repeats 3
      dflash-trt bench engine --target tiny --batch-sizes 1,4,16 --draft-len auto,15,7,3
    """
    sizes = _ints(batch_sizes, "--batch-sizes")
    from dflash_trt.bench.engine_bench import format_table, run_engine_benchmark

    chosen = ("ar", "dflash") if modes == "both" else (modes,)

    def progress(point) -> None:
        click.echo(
            f"  {point.mode} batch {point.batch_size}: {point.output_tokens_per_s:.1f} tok/s", err=True
        )

    prompts = _prompts(prompt_set, target)
    result = run_engine_benchmark(
        target=target, drafter=drafter, block_size=block_size, batch_sizes=sizes, max_tokens=max_tokens,
        modes=chosen, device=device, dtype=dtype,
        tree_budget=[b.strip() for b in tree_budget.split(",") if b.strip()] or ["0"],
        draft_len=[g.strip() for g in draft_len.split(",") if g.strip()] or ["auto"],
        enforce_eager=enforce_eager, compile=compile_rounds, repeats=repeats, prompts=prompts, progress=progress,
    )  # fmt: skip
    if out:
        from pathlib import Path

        from dflash_trt.utils.io import atomic_write_text

        atomic_write_text(Path(out), json.dumps(result, indent=2) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        click.echo(format_table(result))
