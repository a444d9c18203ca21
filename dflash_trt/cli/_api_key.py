# SPDX-License-Identifier: Apache-2.0
"""The API-key options shared by `serve` and `bench sweep`: --api-key, --api-key-file and
$DFLASH_TRT_API_KEY, resolved by dflash_trt.utils.api_key (one place for the rule)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dflash_trt.utils.api_key import ENV_VAR, ApiKey, resolve_api_key, world_readable

F = TypeVar("F", bound=Callable[..., Any])


def api_key_options(*, role: str) -> Callable[[F], F]:
    """Add --api-key and --api-key-file. `role` completes their help ("require" / "send")."""

    def wrap(fn: F) -> F:
        fn = click.option(
            "--api-key-file",
            type=click.Path(dir_okay=False, path_type=Path),
            metavar="PATH",
            allow_from_autoenv=False,
            help=f"File holding the API key to {role} (one line). Also ${ENV_VAR}.",
        )(fn)
        return click.option(
            "--api-key",
            metavar="KEY",
            allow_from_autoenv=False,
            help=f"API key to {role} (`Authorization: Bearer KEY`). Shows in process lists: prefer "
            f"--api-key-file or ${ENV_VAR}.",
        )(fn)

    return wrap


def api_key_from_options(api_key: str | None, api_key_file: Path | None) -> ApiKey | None:
    """The resolved key (exit 2 on a bad one), with a warning for a world-readable key file."""
    key = resolve_api_key(flag=api_key, file=api_key_file)
    if api_key_file is not None and world_readable(api_key_file):
        click.echo(f"warning: {api_key_file} is readable by every user; chmod 600 it", err=True)
    return key
