# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt`: one Click group; subcommands are imported only when used.

Errors print one line on stderr (`error: <field>=<value>: <problem>; fix: <hint>`) and exit
with 2 for usage errors, 1 for runtime failures, 3 for a missing optional environment.
Set DFLASH_TRT_DEBUG=1 for the full traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from dflash_trt import __version__
from dflash_trt.errors import DFlashTrtError
from dflash_trt.utils.child import limit_openmp_spin

# name -> (module:attribute, one-line help). Listing help here keeps `--help` import-free.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "dflash_trt.cli.generate:generate",
        "Generate text with DFlash (or plain decoding) on CPU or GPU.",
    ),
    "bench": (
        "dflash_trt.cli.bench:bench",
        "Benchmarks: throughput-vs-interactivity sweeps, Pareto plots, comparisons.",
    ),
    "chart": ("dflash_trt.cli.chart:chart", "Lint or render the Helm chart with a bundle's values."),
    "build": (
        "dflash_trt.cli.build:build",
        "Build a deployment bundle (TensorRT-LLM config, checkpoints, Triton repo, Helm).",
    ),
    "models": ("dflash_trt.cli.build:models", "List the published DFlash drafters and their targets."),
    "serve": (
        "dflash_trt.cli.serve:serve",
        "Serve a bundle with a real Triton Inference Server (gRPC/HTTP/metrics).",
    ),
    "precompile": (
        "dflash_trt.cli.precompile:precompile",
        "Compile a bundle's rounds into its compile cache before serving (a pre-warm Job).",
    ),
    "import": (
        "dflash_trt.cli.import_gguf:import_gguf",
        "Convert a GGUF file (Llama, Qwen) into a checkpoint directory, once (cached).",
    ),
    "train-drafter": (
        "dflash_trt.cli.train:train_drafter",
        "Train a DFlash drafter for a target (z-lab checkpoint format).",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module_name, _, attr = COMMANDS[cmd_name][0].partition(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in sorted(COMMANDS)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DFLASH_TRT"},
)
@click.version_option(__version__, "--version", prog_name="dflash-trt")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """DFlash speculative decoding, from checkpoint to production.

    \b
    Quickstart:
      dflash-trt generate --target tiny --prompt "def fib(n):" --max-new-tokens 64 --json
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    debug = os.environ.get("DFLASH_TRT_DEBUG") == "1"
    limit_openmp_spin()  # before any command imports torch (utils/child.py)
    try:
        rv = cli.main(args=argv, prog_name="dflash-trt", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except DFlashTrtError as exc:
        if debug:
            raise
        click.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        click.echo(
            f"error: unexpected {type(exc).__name__}: {first}; set DFLASH_TRT_DEBUG=1 for the traceback",
            err=True,
        )
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)
