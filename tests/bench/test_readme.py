# SPDX-License-Identifier: Apache-2.0
"""bench/README.md documents every metric exactly as summary.json defines it."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_trt.bench.metrics import definitions_markdown

README = Path(__file__).resolve().parents[2] / "bench" / "README.md"
BLOCK = re.compile(r"(<!-- definitions:begin -->\n)(.*?)(<!-- definitions:end -->)", re.S)


def test_readme_definitions_match_the_code(update_goldens: bool) -> None:
    text = README.read_text()
    match = BLOCK.search(text)
    assert match, "bench/README.md lost its definitions markers"
    if update_goldens:
        README.write_text(BLOCK.sub(lambda m: m.group(1) + definitions_markdown() + m.group(3), text))
        return
    assert match.group(2) == definitions_markdown(), (
        "regenerate with: pytest tests/bench/test_readme.py --update-goldens"
    )


def test_readme_keeps_its_first_lines_and_names_the_commands() -> None:
    text = README.read_text()
    assert text.startswith("# bench/: benchmarks and their recorded results\n")
    for cmd in (
        "bench sweep",
        "bench plot",
        "bench compare",
        "python -m tests.bench.scripted_server",
        "bench/client_overhead.py",
    ):
        assert cmd in text, cmd
    for spec in re.findall(r"bench/sweeps/[\w.-]+\.yaml", text):
        assert (README.parent.parent / spec).is_file(), spec
