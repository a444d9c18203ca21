# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt build` and `dflash-trt models`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _load_recipe(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """--config FILE.yaml: option defaults from a recipe (keys are option names); flags override."""
    if value is None:
        return
    import yaml

    try:
        data = yaml.safe_load(Path(value).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"cannot read {value}: {exc}", param_hint="--config") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{value} must hold a mapping of option names", param_hint="--config")
    known = {p.name for p in ctx.command.params if p.name}
    out = {}
    for key, val in data.items():
        name = str(key).replace("-", "_")
        if name not in known or name == "config":
            raise click.BadParameter(f"{value}: {key!r} is not a build option", param_hint="--config")
        out[name] = val
    ctx.default_map = {**(ctx.default_map or {}), **out}


@click.command()
@click.option(
    "--config",
    "-c",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_recipe,
    help="A recipe YAML (build/recipes/*.yaml): option defaults; flags override.",
)
@click.option(
    "--target",
    required=True,
    metavar="NAME_OR_DIR",
    help="gpt-oss-120b, qwen3-8b, an HF id, a directory, or a packaged pair: tiny, smollm2-135m.",
)
@click.option("--drafter", metavar="DIR_OR_HF_ID", help="Override the registered drafter.")
@click.option("--gpu", type=click.Choice(["a100", "h100", "h200", "b200", "b300", "gb200", "gb300", "cpu"]), default=None,
              help="Deployment GPU profile (default: detected with nvidia-smi, else cpu).")  # fmt: skip
@click.option(
    "--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor parallel size (GPUs)."
)
@click.option(
    "--ep", type=click.IntRange(min=1), default=1, show_default=True, help="Expert parallel size (MoE)."
)
@click.option("--quant", type=click.Choice(["auto", "none", "fp8", "nvfp4"]), default="auto", show_default=True,
              help="Target weights: auto = NVFP4 on Blackwell, FP8 on Hopper, native MXFP4 for gpt-oss, none on CPU.")  # fmt: skip
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True)
@click.option("--quantize-drafter", is_flag=True, help="Also quantize the drafter (FP8 weight-only).")
@click.option(
    "--calib-data", type=click.Path(dir_okay=False), help="JSONL calibration texts (default: built-in set)."
)
@click.option("--calib-samples", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--block-size",
    type=click.IntRange(min=2),
    default=None,
    help="Runtime block size (<= trained; max_draft_len = B - 1).",
)
@click.option(
    "--tree-budget",
    metavar="N|auto",
    default=None,
    help="torch backend: verify a DDTree of N drafted nodes per round instead of the argmax chain "
    "(0 = linear DFlash, the default; auto = chosen by the engine from round cost). TensorRT-LLM has no "
    "tree verification.",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    help="Reuse the KV pages (and the drafter's context) of prompts seen before: kv_cache_config."
    "enable_block_reuse in the bundle's LLM-API config (on, TensorRT-LLM's default).",
)
@click.option(
    "--guided-decoding/--no-guided-decoding",
    default=True,
    help="Accept structured-output requests (JSON schema, regex, grammar): guided_decoding_backend: xgrammar "
    "in the bundle's LLM-API config (on). TensorRT-LLM does not combine it with DFlash's rejection sampling.",
)
@click.option(
    "--max-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences in flight (default 64, both backends; on the CPU the KV cache holds 16 of "
    "max_seq_len tokens, and requests beyond it wait for pages).",
)
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None)
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=None)
@click.option("--backend", type=click.Choice(["trtllm", "torch"]), default=None,
              help="trtllm: TensorRT-LLM (GPU); torch: the embedded engine (CPU or one GPU). Default by GPU.")  # fmt: skip
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, help="torch backend: device."
)
@click.option(
    "--output", "-o", type=click.Path(file_okay=False, path_type=Path), help="Bundle directory to write."
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Resolve and validate only (configs are read or downloaded, weights never).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the plan (or the written manifest) as one JSON object."
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --output.")
@click.option(
    "--offline",
    is_flag=True,
    help="Never contact the Hub (also HF_HUB_OFFLINE=1): configs come from $DFLASH_TRT_CONFIG_DIR, the "
    "Hugging Face cache, or the copies shipped with dflash-trt.",
)
@click.option(
    "--no-remote-code",
    is_flag=True,
    help="Refuse checkpoints whose config needs their repository's own Python code (TensorRT-LLM's "
    "trust_remote_code). Without it, trust_remote_code is set only when a config needs it; the plan's "
    "notes say which and why.",
)
def build(**kw) -> None:
    """Build a deployment bundle: validated TensorRT-LLM DFlash config, checkpoints, Triton
    repository, Helm values and a benchmark plan.

    TensorRT-LLM runs DFlash in its PyTorch backend from checkpoints plus an LLM-API config
    (DFlashDecodingConfig); there is no TensorRT engine to compile, so none is produced.

    Hub access: HF_ENDPOINT names a mirror, HF_TOKEN authenticates for gated repos. Without a
    route to the Hub, registered pairs plan from the configs shipped with dflash-trt.

    \b
    Examples:
      dflash-trt build --target gpt-oss-120b --gpu b200 --tp 8 --dry-run --json
      dflash-trt build --target qwen3-8b --gpu h100 --quant fp8 --output bundles/qwen3-8b
      dflash-trt build --target tiny --output bundles/tiny          # embedded engine, CPU
    """
    from dflash_trt.builder.plan import BuildRequest
    from dflash_trt.builder.planner import make_plan

    output, dry, as_json, force = kw.pop("output"), kw.pop("dry_run"), kw.pop("as_json"), kw.pop("force")
    req = BuildRequest(**kw)
    plan = make_plan(req)
    for w in [*plan.notices, *plan.warnings]:
        click.echo(f"warning: {w}", err=True)
    if dry:
        data = plan.to_json()
        if as_json:
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
        else:
            _print_plan(data)
        return
    from dflash_trt.builder.writer import write_bundle

    manifest = write_bundle(plan, output, force=force)
    if as_json:
        sys.stdout.write(json.dumps(manifest, indent=2) + "\n")
    else:
        click.echo(
            f"{output}: {plan.backend} bundle for {plan.name} (block {plan.speculative['block_size']})"
        )


def _print_plan(data: dict) -> None:
    t, d, g, q = data["target"], data["drafter"], data["gpu"], data["quantization"]["target"]
    click.echo(f"bundle:   {data['name']} ({data['backend']} backend)")
    click.echo(f"target:   {t['ref']}  [{t['architecture']}, {q['format']} via {q['source']}]")
    click.echo(f"drafter:  {d['ref']}  [block {data['speculative']['block_size']}, "
               f"max_draft_len {data['speculative']['max_draft_len']}]")  # fmt: skip
    click.echo(f"gpu:      {g['profile']} x {g['count']} (tp {g['tp']}, ep {g['ep']})")
    mem = data["validation"].get("memory")
    if mem:
        click.echo(f"memory:   {mem['per_gpu_gb']} GB per GPU of {mem['budget_per_gpu_gb']} GB usable")
    sources = data.get("config_sources") or {}
    if sources:
        click.echo(
            "configs:  " + ", ".join(f"{role} from {src.get('source')}" for role, src in sources.items())
        )
    click.echo(f"llm_api:  {json.dumps(data['llm_api'])}")
    click.echo("files:    " + ", ".join(data["will_write"]))
    for n in data["notes"]:
        click.echo(f"note:     {n}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json: bool) -> None:
    """List the published z-lab DFlash drafters and their targets (short names for --target)."""
    from dflash_trt.builder.configs import shipped_index
    from dflash_trt.builder.registry import ENTRIES

    shipped = shipped_index()

    def offline(e) -> bool:
        return e.target_id in shipped and e.drafter_id in shipped

    if as_json:
        rows = [{**e.to_dict(), "shipped_configs": offline(e)} for e in ENTRIES]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    click.echo(f"{'name':<20} {'target':<34} {'drafter':<44} {'B':>3} {'L':>2} {'GiB':>5}  attention")
    for e in ENTRIES:
        mark = ("" if e.verified_ids else " *") + (" (offline)" if offline(e) else "")
        click.echo(f"{e.name:<20} {e.target_id:<34} {e.drafter_id:<44} {e.block_size:>3} {e.draft_layers:>2} "
                   f"{e.drafter_gib:>5.2f}  {e.attention}{mark}")  # fmt: skip
    click.echo(
        "* target id inferred from the drafter's name (unverified); (offline): configs shipped with "
        "dflash-trt, plans without the Hub; plus the packaged pairs `tiny` and `smollm2-135m`"
    )
