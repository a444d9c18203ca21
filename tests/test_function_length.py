# SPDX-License-Identifier: Apache-2.0
"""Code short enough to read at once, and parts that keep to their own business:
- no function in dflash_trt/ over 60 lines, outside the OpenAI-Triton kernels (functions decorated with
  `@jit`, written as one program each);
- no class in engine/ or triton/ over 300 lines (issue 43: the engine's parts each do one job);
- no private method of a class in engine/ called from another module (`obj._name(...)` where `_name` is
  a method some engine class defines): a part that needs another's help asks its public methods."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
MAX_CLASS_LINES = 300
PACKAGE = Path(__file__).resolve().parents[1] / "dflash_trt"
PARTS = ("engine", "triton")  # where classes are held to MAX_CLASS_LINES


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _long_functions() -> dict[str, int]:
    found = {}
    for path, tree in _trees().items():
        for parent in ast.walk(tree):
            for node in ast.iter_child_nodes(parent):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                kernel = any(isinstance(d, ast.Name) and d.id == "jit" for d in node.decorator_list)
                if length > MAX_LINES and not kernel:
                    owner = f"{parent.name}." if isinstance(parent, ast.ClassDef) else ""
                    found[f"{path.relative_to(PACKAGE)}:{owner}{node.name}"] = length
    return found


def test_no_function_is_over_sixty_lines_outside_the_kernels():
    found = _long_functions()
    assert not found, f"functions over {MAX_LINES} lines: {found}; split them into named parts"


def test_no_class_in_the_engine_or_the_triton_model_is_over_three_hundred_lines():
    found = {}
    for path, tree in _trees().items():
        if path.relative_to(PACKAGE).parts[0] not in PARTS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    found[f"{path.relative_to(PACKAGE)}:{node.name}"] = length
    assert not found, f"classes over {MAX_CLASS_LINES} lines: {found}; give each job a class of its own"


def test_no_private_method_of_an_engine_class_is_called_from_another_module():
    trees = _trees()
    private: dict[str, set[Path]] = {}  # private method name -> the engine modules defining it
    for path, tree in trees.items():
        if path.relative_to(PACKAGE).parts[0] != "engine":
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if (
                    isinstance(fn, ast.FunctionDef)
                    and fn.name.startswith("_")
                    and not fn.name.startswith("__")
                ):
                    private.setdefault(fn.name, set()).add(path)
    calls = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in private and path not in private[node.func.attr]
                    and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("self", "cls"))):  # fmt: skip
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {node.func.attr}")
    assert not calls, f"private engine methods called from other modules: {calls}"
