# SPDX-License-Identifier: Apache-2.0
"""Inductor's C++ kernels of a compiled graph built as one translation unit, not one each.

On CPU inductor writes every fused kernel of a graph as its own C++ file and runs g++ on each. Each
run loads inductor's precompiled header of ATen's vector code (~150 MB) and instantiates its
templates again: an empty kernel costs 1.3 s of the 1.7-2.5 s a typical one takes (2-core AMD EPYC,
g++ 12; bench/README.md, "The cold compile, 2026-12-08"). A round's graph has 10-15 such kernels
per shape class, so most of a cold compile's C++ time is that fixed cost, paid again per kernel.

`one_unit_per_graph()` is a context manager under which the kernels a graph registers
(`AsyncCompile.cpp_pybinding`, which hands back a future that the graph's module resolves when it
loads) are collected; the first one the module asks for builds all of them as one file: each
kernel in a namespace of its own, and one Python extension module with an entry point per kernel.
It goes through inductor's own `CppPythonBindingsCodeCache.load_async`, so the compiler flags, the
vector ISA, the precompiled header and the on-disk cache (keyed by the file's text) are inductor's:
loading a saved round re-forms the same unit and finds it built. The generated kernels, their
arguments and their calls are unchanged, so rounds compute exactly what they computed before.

A kernel whose source is not one `extern "C" void kernel(...)` definition without conditional
preprocessing (what inductor emits for CPU today: `fits`), or a process where inductor compiles
without futures (one compile thread), is built inductor's way, as is every kernel with
$DFLASH_TRT_KERNEL_UNITS=0. Used around compiling and loading a round (engine/compile.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

UNITS_ENV = "DFLASH_TRT_KERNEL_UNITS"  # "0": inductor's kernel-per-file build (a fallback, and the A/B)
_ENTRY = re.compile(r'extern "C"\s+void\s+kernel\s*\(')

# The unit's Python side: one extension module named `kernel` (the name inductor's loader imports),
# whose function kernel_<i> parses its arguments as inductor's own binding does (tensors by data
# pointer through dynamo's helper, whose address inductor's loader puts in the environment) and calls
# the i-th kernel.
_PRELUDE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

static void* (*dflash_data_ptr)(PyObject* tensor);

template <typename T> static inline T dflash_arg(PyObject* args, Py_ssize_t i) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer or a scalar");
    return static_cast<T>(dflash_data_ptr(PyTuple_GET_ITEM(args, i)));
}
template <> inline int64_t dflash_arg<int64_t>(PyObject* args, Py_ssize_t i) {
    Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, i));
    if (v == -1 && PyErr_Occurred()) throw std::runtime_error("an int argument expected");
    return v;
}
template <> inline uintptr_t dflash_arg<uintptr_t>(PyObject* args, Py_ssize_t i) {
    void* v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, i));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("an address expected");
    return reinterpret_cast<uintptr_t>(v);
}
template <> inline float dflash_arg<float>(PyObject* args, Py_ssize_t i) {
    double v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, i));
    if (v == -1.0 && PyErr_Occurred()) throw std::runtime_error("a float argument expected");
    return static_cast<float>(v);
}
"""

_ENTRY_POINT = """
static PyObject* dflash_entry_{i}(PyObject*, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes {n} arguments in a tuple");
        dflash_unit_{i}::kernel({parsed});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}
"""

_MODULE = """
static PyMethodDef dflash_methods[] = {{
{methods}
    {{nullptr, nullptr, 0, nullptr}}}};
static struct PyModuleDef dflash_module = {{PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, dflash_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char* end = nullptr;
    errno = 0;
    uintptr_t value = address ? std::strtoull(address, &end, 10) : 0;
    if (value == 0 || errno != 0 || end == address) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    dflash_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(value);
    return PyModule_Create(&dflash_module);
}}
"""


def fits(source: str) -> bool:
    """Whether a kernel source can join a unit: one `extern "C" void kernel(` definition and no
    conditional preprocessing (its includes move to the top of the unit)."""
    return len(_ENTRY.findall(source)) == 1 and not re.search(r"^\s*#\s*if", source, re.MULTILINE)


def unit_source(kernels: list[tuple[list[str], str]]) -> str:
    """One C++ file holding every (argument types, kernel source) of `kernels`: the sources' includes
    first, each kernel in namespace dflash_unit_<i> with C++ linkage, then the extension module."""
    includes: dict[str, None] = {}
    bodies = []
    for i, (_, source) in enumerate(kernels):
        lines = source.splitlines()
        includes.update((line, None) for line in lines if line.lstrip().startswith("#include"))
        body = "\n".join(line for line in lines if not line.lstrip().startswith("#include"))
        body = _ENTRY.sub("void kernel(", body, count=1)
        bodies.append(f"namespace dflash_unit_{i} {{\n{body}\n}}  // namespace dflash_unit_{i}")
    entries = [
        _ENTRY_POINT.format(i=i, n=len(types), parsed=", ".join(
            f"dflash_arg<{t.replace('const ', '')}>(args, {j})" for j, t in enumerate(types)))
        for i, (types, _) in enumerate(kernels)
    ]  # fmt: skip
    methods = "\n".join(
        f'    {{"kernel_{i}", dflash_entry_{i}, METH_VARARGS, ""}},' for i in range(len(kernels))
    )
    return "\n".join([*includes, *bodies, _PRELUDE, *entries, _MODULE.format(methods=methods)])


class _Unit:
    """The kernels one graph registered so far; built (once) when the first is asked for."""

    def __init__(self) -> None:
        self.kernels: list[tuple[list[str], str]] = []
        self._lock = threading.Lock()
        self._module: Any = None

    @property
    def started(self) -> bool:
        return self._module is not None

    def add(self, argtypes: list[str], source: str) -> int:
        self.kernels.append((list(argtypes), source))
        return len(self.kernels) - 1

    def function(self, i: int) -> Callable[..., Any]:
        with self._lock:
            if self._module is None:
                from torch._inductor.codecache import CppPythonBindingsCodeCache

                self._module = CppPythonBindingsCodeCache.load_async(unit_source(self.kernels), "cpu")()
        return getattr(self._module, f"kernel_{i}")


class _Collector(threading.local):
    unit: _Unit | None = None


@contextlib.contextmanager
def one_unit_per_graph() -> Iterator[None]:
    """Inside: the C++ kernels a graph registers are built as one unit (module docstring). Nested
    uses are one; the patch is undone when the outermost ends."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch._inductor.codecache import LambdaFuture

    original = AsyncCompile.cpp_pybinding
    off = os.environ.get(UNITS_ENV, "1") == "0"
    if off or getattr(original, "_dflash_units", False) or get_compile_threads() <= 1:
        yield
        return
    collector = _Collector()

    def cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
        if not fits(source_code):
            return original(self, argtypes, source_code)
        unit = collector.unit
        if unit is None or unit.started:
            unit = collector.unit = _Unit()
        i = unit.add(argtypes, source_code)
        return LambdaFuture(lambda: unit.function(i))

    cpp_pybinding._dflash_units = True  # type: ignore[attr-defined]
    AsyncCompile.cpp_pybinding = cpp_pybinding  # type: ignore[method-assign]
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding = original  # type: ignore[method-assign]
