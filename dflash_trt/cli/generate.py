# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt generate`: the batch-1 reference loop from the command line."""

from __future__ import annotations

import json
import sys

import click

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
    "--target", required=True, metavar="NAME_OR_DIR", help="`tiny`, or a transformers model directory."
)
@click.option(
    "--drafter",
    metavar="DIR",
    help="z-lab DFlash drafter directory (default: the target's registered drafter).",
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
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "auto"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 on CUDA.",
)
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
    metavar="N",
    default="0",
    show_default=True,
    help="DDTree: verify a tree of N drafted nodes per round, built from the drafter's distributions, "
    "instead of its argmax chain (0 = linear DFlash). Lossless like linear DFlash. The reference "
    "loop has it; the embedded engine does not yet.",
)
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object on stdout.")
def generate(
    target: str,
    drafter: str | None,
    prompt: str | None,
    prompt_ids: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    block_size: int | None,
    no_draft: bool,
    greedy_draft: bool,
    stop_token_ids: str | None,
    ignore_eos: bool,
    chat: bool,
    device: str,
    dtype: str,
    engine: str,
    tree_budget: str,
    as_json: bool,
) -> None:
    """Generate with DFlash speculative decoding (or plain decoding with --no-draft).

    \b
    Examples:
      dflash-trt generate --target tiny --prompt "def add(a, b):" --max-new-tokens 64
      dflash-trt generate --target tiny --prompt-ids 5,17,42 --max-new-tokens 32 --json
      dflash-trt generate --target ./qwen3 --drafter ./qwen3-dflash --prompt "Hi" --max-new-tokens 128 --temperature 0.7 --seed 1
      dflash-trt generate --target tiny --prompt "def add(a, b):" --max-new-tokens 64 --engine reference --tree-budget 32

    With --json the output is one object: output_ids (generated ids only), acceptance_lengths
    (per round, bonus token included), text (null without a tokenizer), num_rounds,
    mean_acceptance_length, ttft_s, decode_s.
    """
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("pass exactly one of --prompt and --prompt-ids")
    ids = _parse_ids(prompt_ids, "--prompt-ids")
    stops = _parse_ids(stop_token_ids, "--stop-token-ids")

    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.dflash_config import validate_pair
    from dflash_trt.models.sources import (
        default_stop_token_ids,
        load_tokenizer,
        resolve_mask_token_id,
        resolve_models,
    )
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.spec.decoding_config import parse_tree_budget
    from dflash_trt.spec.sampling import SamplingConfig
    from dflash_trt.utils.device import resolve_device, resolve_dtype

    sampling = SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, greedy_draft=greedy_draft
    )
    models = resolve_models(target, drafter)
    tokenizer = load_tokenizer(models.target_dir)
    if ids is None:
        if tokenizer is None:
            raise UsageError(
                f"--prompt needs a tokenizer, and {models.target_dir} has none",
                hint="pass token ids with --prompt-ids, or save a tokenizer into the target directory",
            )
        assert prompt is not None
        if chat:
            ids = list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    tokenize=True,
                    enable_thinking=False,
                    return_dict=False,
                )
            )
        else:
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not ids:
        raise UsageError("the prompt is empty after tokenisation", hint="pass a non-empty prompt")
    if stops is None:
        stops = [] if ignore_eos else default_stop_token_ids(models.target_dir, tokenizer)
    elif ignore_eos:
        raise click.UsageError("--ignore-eos and --stop-token-ids are mutually exclusive")

    dev = resolve_device(None if device == "auto" else device)
    dt = resolve_dtype(None if dtype == "auto" else dtype, dev)
    drafting = not no_draft and block_size != 1
    tree = parse_tree_budget(tree_budget, field_name="--tree-budget")
    if tree != 0 and not drafting:
        raise UsageError(
            f"--tree-budget={tree_budget} needs a drafter", hint="drop --no-draft / --block-size 1"
        )
    if drafting and models.drafter_dir is None:
        raise UsageError(
            f"no drafter for --target={target!r}", hint="pass --drafter DIR, or --no-draft for plain decoding"
        )
    mask_id = (
        resolve_mask_token_id(models.drafter_dir, tokenizer) if drafting and models.drafter_dir else None
    )
    if engine == "auto":
        engine = "embedded" if _embedded_supports(models.target_dir) else "reference"
    if engine == "embedded":
        result = _run_embedded(
            models,
            tokenizer,
            ids,
            sampling,
            stops,
            max_new_tokens,
            block_size,
            drafting,
            mask_id,
            dev,
            dt,
            tree,
        )
    else:
        tgt = HFTarget.from_pretrained(models.target_dir, device=dev, dtype=dt)
        draft_model = None
        if drafting:
            assert models.drafter_dir is not None
            draft_model = load_drafter(models.drafter_dir, device=dev, dtype=dt, mask_token_id=mask_id)
            validate_pair(draft_model.config, tgt.info, block_size=block_size)
        result = spec_generate(
            tgt,
            draft_model,
            ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=stops,
            block_size=block_size,
            tree_budget=tree,
        )
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True) if tokenizer is not None else None
    if as_json:
        sys.stdout.write(json.dumps(result.to_json(text)) + "\n")
        return
    if text is not None:
        click.echo(text)
    else:
        click.echo(" ".join(map(str, result.output_ids)))
    n = len(result.output_ids)
    tps = (n - 1) / result.decode_s if result.decode_s > 0 and n > 1 else float("nan")
    mode = "plain decoding" if result.block_size == 1 else f"DFlash block {result.block_size}"
    if tree != 0 and result.block_size > 1:
        mode += f", DDTree {tree} nodes"
    click.echo(
        f"[{mode}] {n} tokens, {result.num_rounds} rounds, mean acceptance length "
        f"{result.mean_acceptance_length:.2f}, ttft {result.ttft_s * 1e3:.1f} ms, "
        f"decode {result.decode_s * 1e3:.1f} ms ({tps:.1f} tok/s), finish={result.finish_reason}",
        err=True,
    )


def _embedded_supports(target_dir) -> bool:
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.checkpoint import read_json
    from dflash_trt.models.target_config import parse_target_config

    try:
        parse_target_config(read_json(target_dir / "config.json", what="target config"))
    except ConfigError:
        return False
    return True


def _run_embedded(
    models, tokenizer, ids, sampling, stops, max_new_tokens, block_size, drafting, mask_id, dev, dt, tree
):
    """One request through the serving engine (native models, paged caches, the same round code)."""
    from dflash_trt.api.llm import LLM, SamplingParams
    from dflash_trt.models.checkpoint import load_drafter_config
    from dflash_trt.models.dflash_config import check_runtime_block_size
    from dflash_trt.reference.generate import GenerationResult

    spec = None
    b = 1
    if drafting:
        cfg = load_drafter_config(models.drafter_dir, mask_token_id=mask_id)
        b = block_size or cfg.block_size
        check_runtime_block_size(cfg, b)
        spec = {
            "decoding_type": "DFlash",
            "max_draft_len": b - 1,
            "speculative_model": str(models.drafter_dir),
        }
        if mask_id is not None:
            spec["mask_token_id"] = mask_id
        if tree != 0:
            spec["tree_budget"] = tree
    llm = LLM(
        str(models.target_dir),
        tokenizer=tokenizer,
        speculative_config=spec,
        max_batch_size=1,
        max_num_tokens=max(256, len(ids)),
        max_seq_len=len(ids) + max_new_tokens + 1,
        device=dev.type,
        dtype=str(dt).removeprefix("torch."),
    )
    try:
        sp = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_token_ids=list(stops),
            ignore_eos=True,  # the CLI already resolved the stop ids (eos included unless --ignore-eos)
            greedy_draft=sampling.greedy_draft,
            return_perf_metrics=True,
            detokenize=False,
        )
        out = llm.generate(ids, sp).outputs[0]  # type: ignore[union-attr]
    finally:
        llm.shutdown()
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
        block_size=b,
    )
