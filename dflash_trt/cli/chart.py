# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt chart`: lint and render the Helm chart with a bundle's helm-values.yaml."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click


@click.command()
@click.option(
    "--bundle",
    "bundle_dir",
    required=True,
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Bundle directory written by `dflash-trt build` (reads DIR/helm-values.yaml).",
)
@click.option(
    "--lint", "do_lint", is_flag=True, help="`helm lint --strict` plus a render (the default action)."
)
@click.option(
    "--render",
    "render_out",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    metavar="OUT",
    help="Write the rendered manifests (`helm template`) to OUT; `-` for stdout.",
)
@click.option(
    "-f",
    "--values",
    "values_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Extra values layered over the bundle's, in order (repeatable), as `helm -f`.",
)
@click.option(
    "--helm-binary",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="DFLASH_TRT_HELM_BINARY",
    metavar="PATH",
    help="Use this helm executable instead of helm-python-sdk (`make helm-bin` gives .tools/helm/helm).",
)
@click.option(
    "--chart",
    "chart_dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="DFLASH_TRT_CHART_DIR",
    metavar="DIR",
    help="Chart directory (default: helm/dflash-trt of this checkout).",
)
@click.option("--release", default="dflash-trt", show_default=True, help="Release name used for rendering.")
@click.option("-n", "--namespace", default="default", show_default=True, help="Namespace used for rendering.")
@click.option(
    "--kube-version",
    "kube_versions",
    multiple=True,
    metavar="X.Y.Z",
    help="Also validate the render with `kubernetes-validate --strict` for this version (repeatable).",
)
def chart(
    bundle_dir: Path,
    do_lint: bool,
    render_out: Path | None,
    values_files: tuple[Path, ...],
    helm_binary: Path | None,
    chart_dir: Path | None,
    release: str,
    namespace: str,
    kube_versions: tuple[str, ...],
) -> None:
    """Lint and/or render the dflash-trt Helm chart with a bundle's values, offline.

    Reports go to stderr; manifests go to OUT (stdout with `--render -`).

    \b
    Examples:
      dflash-trt chart --bundle build/out/gpt-oss-120b --lint
      dflash-trt chart --bundle build/out/gpt-oss-120b --render - -f prod.yaml | kubectl apply -f -
      dflash-trt chart --bundle build/out/tiny --render out.yaml --kube-version 1.29.0 --kube-version 1.33.0
    """
    from dflash_trt.deploy import chart as deploy

    chart_dir = chart_dir or deploy.default_chart_dir()
    values = deploy.load_values(bundle_dir, values_files)
    source = str(bundle_dir / deploy.VALUES_FILE) + "".join(f" + {p}" for p in values_files)
    if not do_lint and render_out is None and not kube_versions:
        do_lint = True
    if do_lint:
        _lint(values, chart_dir, source=source, helm_binary=helm_binary, namespace=namespace)
    if render_out is None and not kube_versions:
        return
    rendered = deploy.render_chart(
        values, chart_dir=chart_dir, release=release, namespace=namespace, helm_binary=helm_binary
    )
    if kube_versions:
        _validate(rendered, chart_dir, kube_versions)
    if render_out is not None:
        if str(render_out) == "-":
            sys.stdout.write(rendered.text)
        else:
            from dflash_trt.utils.io import atomic_write_text

            atomic_write_text(render_out, rendered.text)
            click.echo(f"render: wrote {len(rendered.documents)} objects to {render_out}", err=True)


def _lint(values: dict, chart_dir: Path, *, source: str, helm_binary: Path | None, namespace: str) -> None:
    """`helm lint` with the values; every note and problem on stderr, then exit 1 on a problem."""
    from dflash_trt.deploy import chart as deploy

    report = deploy.lint_chart(values, chart_dir=chart_dir, helm_binary=helm_binary, namespace=namespace)
    for line in report.notes:
        click.echo(f"lint: {line}", err=True)
    for line in report.problems:
        click.echo(f"lint: problem: {line}", err=True)
    if not report.ok:
        raise deploy.lint_failure(report, values_source=source)
    click.echo(f"lint: ok: {chart_dir} with {source} ({report.tool})", err=True)


def _validate(rendered: Any, chart_dir: Path, kube_versions: tuple[str, ...]) -> None:
    """kubernetes-validate --strict of the rendered objects for each Kubernetes version."""
    from dflash_trt.deploy import chart as deploy
    from dflash_trt.errors import DFlashTrtError

    problems = deploy.validate_manifests(
        rendered.text, kube_versions=kube_versions, schema_dir=deploy.default_schema_dir(chart_dir)
    )
    for line in problems:
        click.echo(f"validate: problem: {line}", err=True)
    if problems:
        raise DFlashTrtError(
            f"rendered manifests fail kubernetes-validate --strict: {problems[0]}",
            hint="fix the values or templates named above; every problem is listed on stderr",
        )
    kinds = ", ".join(sorted({str(d.get("kind")) for d in rendered.documents}))
    click.echo(
        f"validate: ok: {len(rendered.documents)} objects ({kinds}) for {', '.join(kube_versions)}", err=True
    )
