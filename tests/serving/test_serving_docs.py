# SPDX-License-Identifier: Apache-2.0
"""docs/serving.md lists every Triton input and every field each OpenAI endpoint takes, as the code has
them: the model's ports (triton/repository.py) and the front's accepted keys (openai_front/protocol.py)."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_trt.openai_front import protocol as P
from dflash_trt.triton.repository import INPUTS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()


def _section(heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    start = DOC.index(heading + "\n")
    level = heading.split(" ")[0]
    rest = DOC[start + len(heading) :]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)]
    return rest[: ends[0]] if ends else rest


def test_the_inputs_table_is_the_models_ports() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (TYPE_\w+) \| \[(-?\d+)\] \| (\w+) \|",
                      _section("## Inputs (all optional except `text_input`)"), flags=re.M)  # fmt: skip
    documented = [(name, kind, (int(dim),), origin == "ours") for name, kind, dim, origin in rows]
    assert documented == [(p.name, p.data_type, p.dims, p.ours) for p in INPUTS]


def test_the_fields_table_is_what_each_endpoint_serves() -> None:
    section = _section("### Request fields, per endpoint")
    rows = re.findall(r"^\| `(\w+)` \| *(✓?) *\| *(✓?) *\|", section, flags=re.M)
    off_only = set(P._OFF_ONLY)
    assert {f for f, c, _ in rows if c} == P._COMPLETIONS_KEYS - (off_only - {"echo"})  # echo: served there
    assert {f for f, _, c in rows if c} == P._CHAT_KEYS - off_only
    off_paragraph = section.split("Accepted only with the value that means")[1]
    assert all(f"`{key}`" in off_paragraph for key in off_only)
