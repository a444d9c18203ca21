# SPDX-License-Identifier: Apache-2.0
"""A compiled graph's C++ kernels built as one unit (engine/kernel_units.py): the same results as
inductor's kernel-per-file build, with one compiler run instead of one per kernel. The rounds
themselves (compiled == eager, saved and reloaded) are covered by test_compiled_rounds.py."""

from __future__ import annotations

import re

import pytest
import torch

from dflash_trt.engine import kernel_units


def _graph(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Three reductions over different axes and a cumulative sum: several C++ kernels on CPU."""
    a = torch.softmax(x, dim=-1) @ y
    b = (x * x).sum(dim=0) + y.amax(dim=1)
    return a.cumsum(dim=0) + b, x.argmax(dim=-1)


def _compiled_builds(monkeypatch, tmp_path, name: str, units: bool) -> tuple[list[str], object]:
    """Compile `_graph` into a fresh inductor cache; the C++ sources inductor was asked to build, and the
    compiled function's outputs."""
    from torch._inductor.codecache import CppCodeCache, CppPythonBindingsCodeCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))
    torch._dynamo.reset()
    built: list[str] = []
    load = CppCodeCache.load_async.__func__  # type: ignore[attr-defined]  # where inductor defines it

    def counting(cls, main_code, *args, **kwargs):
        built.append(main_code)
        return load(cls, main_code, *args, **kwargs)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_async", classmethod(counting))
    fn = torch.compile(_graph, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)
    if units:
        with kernel_units.one_unit_per_graph():
            out = fn(x, y)
    else:
        out = fn(x, y)
    return built, (out, _graph(x, y))


@pytest.mark.slow
def test_a_graphs_kernels_are_built_once_and_compute_what_separate_builds_do(monkeypatch, tmp_path) -> None:
    separate, (got_separate, want) = _compiled_builds(monkeypatch, tmp_path, "separate", units=False)
    assert len(separate) >= 2  # inductor's own build: a compiler run per kernel
    one, (got_one, _) = _compiled_builds(monkeypatch, tmp_path, "unit", units=True)
    assert len(one) == 1 and len(re.findall(r"namespace dflash_unit_\d+ \{", one[0])) == len(separate)
    for got in (got_separate, got_one):
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1])
    assert torch.equal(got_one[0], got_separate[0])  # the same kernels, bit for bit


def test_the_unit_holds_each_kernel_in_its_namespace_with_one_entry_point_each() -> None:
    src = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C"  void  kernel(float* out, const int64_t n)\n{}\n'
    unit = kernel_units.unit_source([(["float*", "const int64_t"], src), (["float*", "const int64_t"], src)])
    assert unit.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"' not in unit.split("PyInit_kernel")[0].split("dflash_data_ptr")[0]
    assert "dflash_unit_0::kernel(dflash_arg<float*>(args, 0), dflash_arg<int64_t>(args, 1))" in unit
    assert '"kernel_1", dflash_entry_1' in unit


def test_a_source_that_is_not_one_kernel_is_built_inductors_way(monkeypatch) -> None:
    from torch._inductor.async_compile import AsyncCompile

    seen: list[str] = []
    monkeypatch.setattr(AsyncCompile, "cpp_pybinding", lambda self, types, src: seen.append(src) or "own")
    two = 'extern "C" void kernel(float* a) {}\nextern "C" void kernel(float* a, float* b) {}'
    with kernel_units.one_unit_per_graph():
        assert AsyncCompile.cpp_pybinding(None, ["float*"], two) == "own"  # type: ignore[arg-type]
        assert AsyncCompile.cpp_pybinding(None, ["float*"], 'extern "C" void kernel(float* a) {}') != "own"  # type: ignore[arg-type]
    guarded = '#ifdef X\n#include <x.h>\n#endif\nextern "C" void kernel(float* a) {}'
    assert not kernel_units.fits(guarded) and kernel_units.fits('extern "C"  void  kernel(float* a) {}')
    assert seen == [two]
    assert AsyncCompile.cpp_pybinding(None, [], "x") == "own"  # type: ignore[arg-type]  # undone on exit
