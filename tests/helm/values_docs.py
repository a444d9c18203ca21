# SPDX-License-Identifier: Apache-2.0
"""The chart README's values table, generated from values.schema.json and values.yaml (a test
helper: `pytest tests/helm --update-helm-goldens` rewrites the table).

The schema is the single source of descriptions: values.yaml repeats them as `# --` comments
and the README table is rendered from them; tests fail when either drifts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

BEGIN = "<!-- values-table:begin (generated from values.schema.json; do not edit) -->"
END = "<!-- values-table:end -->"


def _resolve(node: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/definitions/"):
        target = schema["definitions"][ref.removeprefix("#/definitions/")]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def is_container(node: Mapping[str, Any]) -> bool:
    """A chart-defined group of keys (documented key by key), not a free-form Kubernetes object."""
    return node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is False


def iter_documented(
    schema: Mapping[str, Any], node: Mapping[str, Any] | None = None, prefix: str = ""
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(dotted key, schema node) for every value a user sets, depth first in schema order.

    Chart-defined groups are walked into; free-form objects such as `resources` or `affinity`
    are one value each. Groups whose keys are all pass-through Kubernetes fields (like
    `strategy` or `autoscaling.behavior`) count as one value too.
    """
    node = schema if node is None else node
    for key, child in node.get("properties", {}).items():
        if prefix == "" and key == "global":
            continue
        child = _resolve(child, schema)
        path = f"{prefix}{key}"
        if is_container(child) and not _pass_through(child):
            yield from iter_documented(schema, child, prefix=f"{path}.")
        else:
            yield path, child


def _pass_through(node: Mapping[str, Any]) -> bool:
    return all(not p.get("description") for p in node.get("properties", {}).values())


def type_label(node: Mapping[str, Any]) -> str:
    if "oneOf" in node:
        return " or ".join(type_label(n) for n in node["oneOf"])
    kind = node.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if kind == "array" and isinstance(node.get("items"), Mapping) and "type" in node["items"]:
        return f"list of {node['items']['type']}"
    return str(kind)


def lookup(values: Mapping[str, Any], dotted: str) -> Any:
    current: Any = values
    for part in dotted.split("."):
        current = current[part]
    return current


def _default(value: Any) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    if len(text) > 60:
        text = text[:57] + "..."
    return f"`{text}`".replace("|", "\\|")


def values_table(schema: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    """The Markdown table, between the BEGIN and END markers."""
    rows = [BEGIN, "", "| Key | Type | Default | Description |", "|---|---|---|---|"]
    for key, node in iter_documented(schema):
        desc = str(node.get("description", "")).replace("|", "\\|")
        rows.append(f"| `{key}` | {type_label(node)} | {_default(lookup(values, key))} | {desc} |")
    rows += ["", END]
    return "\n".join(rows)


def replace_table(readme: str, table: str) -> str:
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + table + readme[end:]


def values_comments(text: str) -> dict[str, str]:
    """`# -- text` comments of a values.yaml, keyed by the dotted key on the line after them.

    Only block-style mappings are understood, which is all the chart's values.yaml uses; a
    comment spans consecutive `#` lines after the `# --` line.
    """
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for raw in text.splitlines():
        stripped = raw.strip()
        indent = len(raw) - len(raw.lstrip(" "))
        if stripped.startswith("# --"):
            pending = [stripped.removeprefix("# --").strip()]
            continue
        if stripped.startswith("#") and pending is not None:
            pending.append(stripped.lstrip("#").strip())
            continue
        if not stripped or stripped.startswith(("#", "-")):
            if not stripped.startswith("-"):
                pending = None if not stripped else pending
            continue
        key, sep, _ = stripped.partition(":")
        if not sep:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key.strip().strip("\"'")))
        if pending is not None:
            comments[".".join(k for _, k in stack)] = " ".join(pending)
            pending = None
    return comments
