# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt precompile`: fill a bundle's compile cache before any server starts (a pre-warm Job).

`serve` never waits for a compilation: with a cold cache it is ready in seconds, serves eager rounds
and loads each compiled shape class as a background process saves it (engine/precompile.py). This
command does the compiling up front and exits, so that every server started afterwards on the same
bundle, machine type and torch version loads all its rounds from the cache (`docs/serving.md`,
"Compiled rounds and their cache"). It builds the engine exactly as the bundle's Triton model does
(the same `model.yaml` arguments, so the same fingerprint), compiles or loads every warm-up class in
this process and reports what it did.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click


@click.command("precompile")
@click.option(
    "--bundle", type=click.Path(path_type=Path), required=True, help="A bundle from `dflash-trt build`."
)
@click.option("--no-draft", is_flag=True, help="Compile the rounds of `serve --no-draft` (the target alone).")
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The compile cache root [default: what `serve` uses: $DFLASH_TRT_COMPILE_CACHE, else "
    "<bundle>/compile-cache when the bundle is writable, else ~/.cache/dflash-trt].",
)
def precompile(bundle: Path, no_draft: bool, cache_dir: Path | None) -> None:
    """Compile the bundle's rounds into its compile cache, then exit (0: every class is cached).

    Takes minutes on a small CPU the first time (about five for `tiny` on 2 cores) and seconds when
    the cache already holds every class. Run it as a Kubernetes Job or init container on the volume
    that holds the bundle, or in an image build, before the servers start.

    \b
    Example:
      dflash-trt build --target tiny --output /tmp/tiny && dflash-trt precompile --bundle /tmp/tiny
    """
    from dflash_trt.bundle import bundle_path, load_manifest
    from dflash_trt.engine.compile import bundle_cache_root
    from dflash_trt.errors import UsageError

    manifest = load_manifest(bundle)
    if manifest["backend"] != "torch":
        raise UsageError(
            f"--bundle={str(bundle)!r} has backend {manifest['backend']!r}; only the embedded engine "
            "(backend 'torch') compiles rounds",
            hint="TensorRT-LLM bundles need no precompile step",
        )
    root = cache_dir or bundle_cache_root(bundle)
    cfg = model_args(bundle_path(bundle, manifest, "model_repository"), bundle, manifest, no_draft=no_draft)
    if root is not None:
        cfg["compile_cache"] = str(root.resolve())
    click.echo(f"precompile: {manifest['name']}{' (no drafter)' if no_draft else ''}: compiling or loading "
               "every warm-up round; minutes the first time on a small CPU", err=True)  # fmt: skip
    sys.exit(_run(cfg))


def model_args(repo: Path, bundle: Path, manifest: dict[str, Any], *, no_draft: bool) -> dict[str, Any]:
    """The LLM arguments the bundle's Triton model passes (its model.yaml without triton_config),
    relative paths resolved against the bundle, compile on."""
    import yaml

    from dflash_trt.errors import UsageError

    path = repo / manifest["serving"]["model_name"] / "1" / "model.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{path} could not be read ({exc})", hint="rebuild the bundle with --force") from exc
    cfg.pop("triton_config", None)
    for key in ("model", "tokenizer"):
        if isinstance(cfg.get(key), str) and (bundle / cfg[key]).exists():
            cfg[key] = str((bundle / cfg[key]).resolve())
    spec = cfg.get("speculative_config")
    if no_draft:
        cfg.pop("speculative_config", None)
    elif isinstance(spec, dict):
        for key in ("speculative_model", "speculative_model_dir"):
            if isinstance(spec.get(key), str) and (bundle / spec[key]).exists():
                spec[key] = str((bundle / spec[key]).resolve())
    cfg["compile"] = True
    return cfg


def _run(cfg: dict[str, Any]) -> int:
    import torch

    from dflash_trt import LLM
    from dflash_trt.engine.compile import foreground_compile, saves_compiled_rounds

    if not saves_compiled_rounds():
        click.echo(f"error: torch {torch.__version__} cannot save compiled rounds (no aot_compile): each server "
                   "compiles its own at start; nothing to precompile (use a newer torch to cache them)",
                   err=True)  # fmt: skip
        return 1
    t0 = time.perf_counter()
    with foreground_compile(), LLM(**cfg) as llm:
        rounds = llm.engine.executor.rounds
        if rounds is None:
            click.echo("error: compiling the rounds failed (see the warning above); servers of this bundle "
                       "will run eager rounds", err=True)  # fmt: skip
            return 1
        where = rounds.directory
        compiled = rounds.compiled + rounds.helped  # by this process and by its helpers (side by side)
        click.echo(
            f"precompile: {compiled} compiled, {rounds.loaded - rounds.helped} already cached, "
            f"{time.perf_counter() - t0:.1f} s; cache: {where if where is not None else 'none (memory only)'}"
        )
        return 0 if where is not None else 1
