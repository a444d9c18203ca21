# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt generate`: the batch-1 reference loop from the command line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dflash_trt.cli.options import AUTO_DTYPE_HELP, device_option, dtype_option
from dflash_trt.errors import UsageError


def _parse_ids(value: str | None, flag: str) -> list[int] | None:
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of integers", param_hint=flag
        ) from None
    return ids


@click.command()
@click.option(
    "--target",
    required=True,
    metavar="NAME_OR_DIR",
    help="`tiny`, `smollm2-135m`, a .gguf file, or a transformers model directory.",
)
@click.option(
    "--drafter",
    metavar="NAME_OR_DIR",
    help="z-lab DFlash drafter directory, or a packaged drafter's name such as smollm2-135m-dflash2 "
    "(default: the target's registered drafter).",
)
@click.option("--prompt", metavar="TEXT", help="Prompt text (needs a tokenizer in the target directory).")
@click.option("--prompt-ids", metavar="IDS", help="Prompt as comma-separated token ids, e.g. 5,17,42.")
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    required=True,
    help="Tokens to generate (prompt excluded).",
)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy."
)
@click.option(
    "--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True
)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Sampling seed (sampled runs are reproducible with it).")
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Runtime block size B (<= the drafter's; 1 = no drafting).",
)
@click.option("--no-draft", is_flag=True, help="Run the target alone (plain decoding, the speedup baseline).")
@click.option(
    "--greedy-draft", is_flag=True, help="At T > 0, propose argmax drafts (one-hot rule) instead of sampling."
)
@click.option(
    "--stop-token-ids", metavar="IDS", help="Override the stop ids (default: the target's eos ids)."
)
@click.option("--ignore-eos", is_flag=True, help="Do not stop at eos; generate exactly --max-new-tokens.")
@click.option("--chat", is_flag=True, help="Wrap --prompt in the tokenizer's chat template (thinking off).")
@device_option()
@dtype_option(AUTO_DTYPE_HELP)
@click.option(
    "--engine",
    type=click.Choice(["auto", "embedded", "reference"]),
    default="auto",
    show_default=True,
    help="embedded: the serving engine's native models; reference: the transformers-based reference "
    "loop (the oracle); auto: embedded when the architecture is supported.",
)
@click.option(
    "--tree-budget",
    metavar="N|auto",
    default="0",
    show_default=True,
    help="DDTree: verify a tree of N drafted nodes per round, built from the drafter's distributions, "
    "instead of its argmax chain (0 = linear DFlash). Lossless like linear DFlash. auto: the embedded "
    "engine chooses per round by measured cost (the reference loop needs a number).",
)
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object on stdout.")
def generate(**options: Any) -> None:
    """Generate with DFlash speculative decoding (or plain decoding with --no-draft).

    \b
    Examples:
      dflash-trt generate --target tiny --prompt "def add(a, b):" --max-new-tokens 64
      dflash-trt generate --target tiny --prompt-ids 5,17,42 --max-new-tokens 32 --json
      dflash-trt generate --target tiny --prompt "def add(a, b):" --max-new-tokens 64 --tree-budget 32
      dflash-trt generate --target ./qwen3 --drafter ./qwen3-dflash --prompt "Hi" --max-new-tokens 128 --temperature 0.7 --seed 1

    With --json the output is one object: output_ids (generated ids only), acceptance_lengths
    (per round, bonus token included), text (null without a tokenizer), num_rounds,
    mean_acceptance_length, ttft_s, decode_s, num_draft_tokens, num_overturned_draft_tokens and
    overturn_rate (DFlash 2: drafts whose selector pick is not the drafter's argmax; 0 for v1); with
    --tree-budget also tree_budgets (each round's budget: the one chosen by the engine under auto, 0 for
    a linear round) and tree_mean_acceptance_length (tau over the tree rounds).
    """
    opts = _Options(**options)
    job = _prepare(opts)
    run = _run_embedded if _engine_for(opts.engine, job) == "embedded" else _run_reference
    result = run(job)
    _report(result, job.tokenizer, as_json=opts.as_json, tree_budget=job.tree_budget)


@dataclass(frozen=True)
class _Options:
    """The command's options, as click passes them."""

    target: str
    drafter: str | None
    prompt: str | None
    prompt_ids: str | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    block_size: int | None
    no_draft: bool
    greedy_draft: bool
    stop_token_ids: str | None
    ignore_eos: bool
    chat: bool
    device: str
    dtype: str
    engine: str
    tree_budget: str
    as_json: bool


@dataclass(frozen=True)
class _Job:
    """One resolved request: the models, the prompt ids, the stop ids, and how to decode."""

    models: Any  # ResolvedModels
    tokenizer: Any | None
    ids: list[int]
    sampling: Any  # SamplingConfig
    stops: list[int]
    max_new_tokens: int
    block_size: int | None
    drafting: bool
    mask_id: int | None
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    tree_budget: int | str  # DDTree nodes per round ("auto": the engine chooses); 0 = linear DFlash


def _prepare(opts: _Options) -> _Job:
    """Check the options and resolve models, prompt, stop ids and device (in this order, so that
    the first problem reported is the first one a user would fix)."""
    if (opts.prompt is None) == (opts.prompt_ids is None):
        raise click.UsageError("pass exactly one of --prompt and --prompt-ids")
    ids = _parse_ids(opts.prompt_ids, "--prompt-ids")
    stops = _parse_ids(opts.stop_token_ids, "--stop-token-ids")

    from dflash_trt.models.sources import default_stop_token_ids, load_tokenizer, resolve_models, target_dtype
    from dflash_trt.spec.decoding_config import parse_tree_budget
    from dflash_trt.spec.sampling import SamplingConfig
    from dflash_trt.utils.device import resolve_device

    sampling = SamplingConfig(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed,
                              greedy_draft=opts.greedy_draft)  # fmt: skip
    models = resolve_models(opts.target, opts.drafter)
    tokenizer = load_tokenizer(models.target_dir)
    if ids is None:
        assert opts.prompt is not None
        ids = _tokenize(opts.prompt, tokenizer, chat=opts.chat, where=models.target_dir)
    if not ids:
        raise UsageError("the prompt is empty after tokenisation", hint="pass a non-empty prompt")
    if stops is None:
        stops = [] if opts.ignore_eos else default_stop_token_ids(models.target_dir, tokenizer)
    elif opts.ignore_eos:
        raise click.UsageError("--ignore-eos and --stop-token-ids are mutually exclusive")
    dev = resolve_device(None if opts.device == "auto" else opts.device)
    dt = target_dtype(None if opts.dtype == "auto" else opts.dtype, dev, models.target_dir)
    drafting = not opts.no_draft and opts.block_size != 1
    tree = parse_tree_budget(opts.tree_budget, field_name="--tree-budget")
    if tree != 0 and not drafting:
        raise UsageError(
            f"--tree-budget={opts.tree_budget} needs a drafter", hint="drop --no-draft / --block-size 1"
        )
    return _Job(models=models, tokenizer=tokenizer, ids=ids, sampling=sampling, stops=list(stops),
                max_new_tokens=opts.max_new_tokens, block_size=opts.block_size, drafting=drafting,
                mask_id=_mask_id(opts.target, models, tokenizer, drafting=drafting), device=dev, dtype=dt, tree_budget=tree)  # fmt: skip


def _tokenize(prompt: str, tokenizer: Any | None, *, chat: bool, where: Path) -> list[int]:
    """--prompt as token ids (in the tokenizer's chat template with --chat, thinking off)."""
    if tokenizer is None:
        raise UsageError(
            f"--prompt needs a tokenizer, and {where} has none",
            hint="pass token ids with --prompt-ids, or save a tokenizer into the target directory",
        )
    if not chat:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    from dflash_trt.models.sources import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


def _mask_id(target: str, models: Any, tokenizer: Any | None, *, drafting: bool) -> int | None:
    """The drafter's mask token id when drafting (which needs a drafter), else None."""
    from dflash_trt.models.sources import resolve_mask_token_id

    if drafting and models.drafter_dir is None:
        raise UsageError(
            f"no drafter for --target={target!r}", hint="pass --drafter DIR, or --no-draft for plain decoding"
        )
    return resolve_mask_token_id(models.drafter_dir, tokenizer) if drafting and models.drafter_dir else None


def _engine_for(engine: str, job: _Job) -> str:
    """--engine auto: the embedded engine when it supports the target's architecture."""
    if engine != "auto":
        return engine
    return "embedded" if _embedded_supports(job.models.target_dir) else "reference"


def _report(result: Any, tokenizer: Any | None, *, as_json: bool, tree_budget: int | str = 0) -> None:
    """The text (or ids) on stdout and a one-line summary on stderr; with --json one object."""
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True) if tokenizer is not None else None
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(text)) + "\n")
        return
    click.echo(text if text is not None else " ".join(map(str, result.output_ids)))
    n = len(result.output_ids)
    tps = (n - 1) / result.decode_s if result.decode_s > 0 and n > 1 else float("nan")
    mode = "plain decoding" if result.block_size == 1 else f"DFlash block {result.block_size}"
    if tree_budget != 0 and result.block_size > 1:
        mode += f", DDTree {tree_budget} nodes"
    selector = f", selector overturn rate {result.overturn_rate:.2f}" if result.num_overturned else ""
    click.echo(
        f"[{mode}] {n} tokens, {result.num_rounds} rounds, mean acceptance length "
        f"{result.mean_acceptance_length:.2f}{selector}, ttft {result.ttft_s * 1e3:.1f} ms, "
        f"decode {result.decode_s * 1e3:.1f} ms ({tps:.1f} tok/s), finish={result.finish_reason}",
        err=True,
    )


def _embedded_supports(target_dir: Path) -> bool:
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.checkpoint import read_json
    from dflash_trt.models.target_config import parse_target_config

    try:
        parse_target_config(read_json(target_dir / "config.json", what="target config"))
    except ConfigError:
        return False
    return True


def _run_reference(job: _Job) -> Any:
    """The batch-1 reference loop on a transformers target (the oracle)."""
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.dflash_config import validate_pair
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget

    tgt = HFTarget.from_pretrained(job.models.target_dir, device=job.device, dtype=job.dtype)
    draft_model = None
    if job.drafting:
        assert job.models.drafter_dir is not None
        draft_model = load_drafter(
            job.models.drafter_dir, device=job.device, dtype=job.dtype, mask_token_id=job.mask_id
        )
        validate_pair(draft_model.config, tgt.info, block_size=job.block_size)
    return spec_generate(tgt, draft_model, job.ids, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                         stop_token_ids=job.stops, block_size=job.block_size,
                         tree_budget=job.tree_budget)  # fmt: skip


def _run_embedded(job: _Job) -> Any:
    """One request through the serving engine (native models, paged caches, the same round code)."""
    from dflash_trt.api.llm import LLM, SamplingParams

    spec, b = _speculative_config(job)
    llm = LLM(
        str(job.models.target_dir),
        tokenizer=job.tokenizer,
        speculative_config=spec,
        max_batch_size=1,
        max_num_tokens=max(256, len(job.ids)),
        max_seq_len=len(job.ids) + job.max_new_tokens + 1,
        device=job.device.type,
        dtype=str(job.dtype).removeprefix("torch."),
        compile=False,  # one request: compiling the round (minutes) would cost more than it saves
    )
    s = job.sampling
    try:
        sp = SamplingParams(
            max_tokens=job.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            stop_token_ids=list(job.stops),
            ignore_eos=True,  # the CLI already resolved the stop ids (eos included unless --ignore-eos)
            greedy_draft=s.greedy_draft,
            return_perf_metrics=True,
            detokenize=False,
        )
        out = llm.generate(job.ids, sp).outputs[0]  # type: ignore[union-attr]
    finally:
        llm.shutdown()
    return _result_of(out, block_size=b)


def _speculative_config(job: _Job) -> tuple[dict[str, Any] | None, int]:
    """The LLM's speculative_config for this job and the block it runs (1 without drafting)."""
    from dflash_trt.models.checkpoint import load_drafter_config
    from dflash_trt.models.dflash_config import check_runtime_block_size, max_draft_len_for

    if not job.drafting:
        return None, 1
    cfg = load_drafter_config(job.models.drafter_dir, mask_token_id=job.mask_id)
    b = job.block_size or cfg.block_size
    check_runtime_block_size(cfg, b)
    spec: dict[str, Any] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len_for(b),
        "speculative_model": str(job.models.drafter_dir),
        # every round drafts the block (a schedule for the one request this runs): the rounds and tau
        # reported are this block's, as the reference loop's, not the load policy's choice
        "max_concurrency": 1,
    }
    if job.mask_id is not None:
        spec["mask_token_id"] = job.mask_id
    if job.tree_budget != 0:
        spec["tree_budget"] = job.tree_budget
    return spec, b


def _result_of(out: Any, *, block_size: int) -> Any:
    """The embedded engine's CompletionOutput as the reference loop's GenerationResult."""
    from dflash_trt.reference.generate import GenerationResult

    m = out.request_perf_metrics
    assert m is not None
    t = m.timing_metrics
    assert t.first_token_time is not None and t.last_token_time is not None
    return GenerationResult(
        output_ids=list(out.token_ids),
        acceptance_lengths=list(m.speculative_decoding.acceptance_lengths),
        ttft_s=(t.first_token_time - t.arrival_time).total_seconds(),
        decode_s=(t.last_token_time - t.first_token_time).total_seconds(),
        finish_reason=out.finish_reason or "length",
        num_draft_tokens=m.speculative_decoding.total_draft_tokens,
        num_accepted_draft_tokens=m.speculative_decoding.total_accepted_draft_tokens,
        num_overturned=m.speculative_decoding.total_overturned_draft_tokens,
        block_size=block_size,
        tree_budgets=m.speculative_decoding.tree_budgets,
    )
