# SPDX-License-Identifier: Apache-2.0
"""The engine's defaults: which dtype `auto` picks, when rounds are compiled and where the compile
cache lives, and the fused projections (one GEMM for q/k/v and for gate/up) equal the separate ones."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dflash_trt.engine import compile as compile_mod
from dflash_trt.layers.linear import FusedLinear
from dflash_trt.utils import device as device_mod
from dflash_trt.utils.device import CPU_STREAMING_MIN_BYTES, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
STREAMED = CPU_STREAMING_MIN_BYTES // 4  # parameters a step reads from which they are streamed


@pytest.mark.parametrize(
    ("checkpoint", "params", "native", "want"),
    [
        (torch.bfloat16, STREAMED, True, torch.bfloat16),  # the checkpoint's dtype
        (torch.float16, 8 * STREAMED, True, torch.bfloat16),  # half: computed in bf16 on CPU
        (torch.bfloat16, STREAMED, False, torch.float32),  # emulated bf16: fp32
        (torch.bfloat16, STREAMED - 1, True, torch.float32),  # cached weights: per-call costs win
        (torch.float32, 8 * STREAMED, True, torch.float32),  # never narrower than the checkpoint
        (None, 8 * STREAMED, True, torch.float32),  # unknown checkpoint dtype
    ],
)
def test_auto_dtype_on_cpu(monkeypatch, checkpoint, params, native, want) -> None:
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype(None, CPU, checkpoint_dtype=checkpoint, num_step_parameters=params) == want
    assert resolve_dtype("auto", CPU, checkpoint_dtype=checkpoint, num_step_parameters=params) == want


def test_the_real_pairs_fall_on_either_side_of_the_line(monkeypatch) -> None:
    """tiny's weights stay in the caches (fp32); SmolLM2-135M's are streamed (its bf16 checkpoint's dtype)."""
    from dflash_trt.api.llm import LLM

    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: True)
    for name, want in (("tiny", torch.float32), ("smollm2-135m", torch.bfloat16)):
        with LLM(name, compile=False, max_batch_size=1) as llm:
            assert llm.dtype == want, name


def test_auto_dtype_on_cuda_and_explicit_names() -> None:
    assert resolve_dtype(None, CUDA, checkpoint_dtype=torch.float16) == torch.float16
    assert resolve_dtype(None, CUDA, checkpoint_dtype=torch.float32) == torch.bfloat16
    assert resolve_dtype("float32", CUDA, checkpoint_dtype=torch.bfloat16) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(Exception, match=r"--dtype='fp8' is not supported.*fix: use one of"):
        resolve_dtype("fp8", CPU)


def test_native_bf16_reads_the_cpu_flags(monkeypatch) -> None:
    for flags, want in ((frozenset({"avx2", "avx512f"}), False), (frozenset({"avx512_bf16"}), True),
                        (frozenset({"amx_bf16", "amx_tile"}), True)):  # fmt: skip
        monkeypatch.setattr(device_mod, "cpu_flags", lambda flags=flags: flags)
        assert device_mod.cpu_has_native_bf16() is want


def test_cpu_model_name_reads_cpuinfo_and_falls_back_to_the_platform(monkeypatch, tmp_path) -> None:
    import builtins
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core\n")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k)
    )
    assert device_mod.cpu_model_name() == "AMD EPYC 9R14 96-Core"
    info.unlink()  # no /proc/cpuinfo (macOS, Windows): the platform module's answer
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert device_mod.cpu_model_name() == "arm"


def test_the_llm_loads_the_checkpoint_dtype_by_the_policy(monkeypatch) -> None:
    """tiny's checkpoint is bf16 and narrow: float32 by the policy, bf16 when asked."""
    from dflash_trt.api.llm import LLM

    with LLM("tiny") as llm:
        assert llm.dtype == torch.float32
    with LLM("tiny", dtype="bfloat16") as llm:
        assert llm.dtype == torch.bfloat16
        assert llm.engine.target.model.embed_tokens.weight.dtype == torch.bfloat16


def test_compile_default_follows_the_machine_and_the_environment(monkeypatch, tmp_path, caplog) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from dflash_trt.api.llm import _compile_wanted

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # torch's own: ours replaces it
    monkeypatch.delenv("DFLASH_TRT_KERNEL_CACHE", raising=False)  # use_cache_root sets it: unset afterwards
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "0")
    assert _compile_wanted(None, CPU, str(tmp_path)) == (False, None)  # opted out
    monkeypatch.delenv(compile_mod.COMPILE_ENV)
    monkeypatch.setattr(compile_mod, "unsupported_reason", lambda device: None)
    cache = tmp_path / compile_mod.machine_key(CPU)
    assert _compile_wanted(None, CPU, str(tmp_path)) == (True, str(cache))  # the default where it can run
    with caplog.at_level(logging.INFO):
        assert _compile_wanted(None, CUDA, str(tmp_path)) == (False, None)  # a GPU: CUDA graphs, eager rounds
    assert "on a GPU rounds run eagerly in CUDA graphs" in caplog.text
    assert cache.is_dir() and str(cache) == __import__("os").environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setattr(compile_mod, "unsupported_reason", lambda device: "no C++ compiler on PATH")
    with caplog.at_level(logging.WARNING):
        assert _compile_wanted(True, CPU, str(tmp_path)) == (False, None)  # asked for, impossible: eager
    assert "compiled rounds are off: no C++ compiler on PATH" in caplog.text
    assert _compile_wanted(False, CPU, str(tmp_path)) == (False, None)
    # the user's inductor cache: kept, for inductor's own caches only
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    other = tmp_path / "other" / compile_mod.machine_key(CPU)
    assert compile_mod.use_cache_root(tmp_path / "other", CPU) == other and other.is_dir()
    assert __import__("os").environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_no_compiler_is_a_reason_not_to_compile(monkeypatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "no C++ compiler" in (compile_mod.unsupported_reason(CPU) or "")
    assert "not used on meta" in (compile_mod.unsupported_reason(torch.device("meta")) or "")


def test_the_cache_is_keyed_by_torch_and_the_cpu_isa(monkeypatch) -> None:
    import dflash_trt.utils.device as dev

    monkeypatch.setattr(dev, "cpu_flags", lambda: frozenset({"avx2"}))
    avx2 = compile_mod.machine_key(CPU)
    monkeypatch.setattr(dev, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    avx512 = compile_mod.machine_key(CPU)
    assert avx2 != avx512 and torch.__version__.split("+")[0] in avx2


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_the_separate_linears_and_shares_their_weights(bias) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(16, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(3, 5, 16)
    want = [m(x) for m in linears]
    fused = FusedLinear.of(linears)
    got = fused(x)
    for w, g, m in zip(want, got, linears):
        torch.testing.assert_close(g, w)
        assert m.weight.data_ptr() != 0 and m.weight.untyped_storage().data_ptr() == (
            fused.weight.untyped_storage().data_ptr()
        )  # a view: no second copy of the weights
    with torch.no_grad():
        linears[1].weight.add_(1.0)  # an update through the original reaches the fused GEMM
    torch.testing.assert_close(fused(x)[1], linears[1](x))
    tail = fused.tail(1)
    torch.testing.assert_close(torch.cat(tail(x), -1), torch.cat([m(x) for m in linears[1:]], -1))
    with pytest.raises(ValueError, match="either every linear has a bias or none"):
        FusedLinear.of([nn.Linear(4, 2, bias=True), nn.Linear(4, 2, bias=False)])


@pytest.mark.parametrize(
    ("device", "saves", "env", "expected"),
    [
        ("cpu", True, "1", "background"),
        ("cpu", True, "0", "foreground+helpers"),
        ("cpu", False, "1", "foreground"),
        ("cuda", True, "1", "foreground"),
    ],
    ids=["cpu", "cpu-foreground", "cpu-torch-without-aot", "gpu"],
)
def test_where_a_cold_cache_is_compiled(monkeypatch, tmp_path, device, saves, env, expected) -> None:
    """A cold compile cache: a background process on the CPU when torch can save compiled rounds for it
    to hand over; in the foreground (before ready) when asked ($DFLASH_TRT_COMPILE_BACKGROUND=0), with
    helper processes beside it (engine/precompile.py), on a GPU (a second process would load the
    weights onto the device again) and with a torch that cannot save them (nothing to hand over), both
    without helpers."""
    from types import SimpleNamespace

    from dflash_trt.api import llm as llm_mod
    from dflash_trt.engine import precompile

    events: list[str] = []
    executor = SimpleNamespace(
        directory=tmp_path,
        on_disk=lambda classes: False,
        expect=lambda c: events.append("expect"),
        freeze=lambda: events.append("freeze"),
    )
    engine = SimpleNamespace(
        device=torch.device(device), executor=executor, warm_up_classes=lambda: [("k", True)]
    )
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, env)
    monkeypatch.setattr(compile_mod, "saves_compiled_rounds", lambda: saves)
    monkeypatch.setattr(precompile, "spawn", lambda request, directory: events.append("spawn") or "child")
    monkeypatch.setattr(llm_mod, "_warm_up_compiled",
                        lambda e, request: events.append("foreground" + ("+helpers" if request else "")))  # fmt: skip
    child = llm_mod._start_compiled(engine, lambda e: "request")
    background = expected == "background"
    assert events == (["freeze", "expect", "spawn"] if background else [expected])
    assert child == ("child" if background else None)


def test_the_dtype_help_says_what_the_policy_does(monkeypatch, cli) -> None:
    """--dtype's help (cli/options.py) names the line and the pairs on either side of it: held to
    resolve_dtype through target_dtype, which generate and LLM both use."""
    from dflash_trt.cli.options import AUTO_DTYPE_HELP
    from dflash_trt.models.sources import resolve_models, target_dtype

    assert f"more than {CPU_STREAMING_MIN_BYTES >> 20} MB of fp32 weights" in AUTO_DTYPE_HELP
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: True)
    for name, want in (("smollm2-135m", torch.bfloat16), ("tiny", torch.float32)):
        assert f"float32 ({name}" in AUTO_DTYPE_HELP or f"({name})" in AUTO_DTYPE_HELP
        assert target_dtype(None, CPU, resolve_models(name).target_dir) == want, name
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: False)
    assert target_dtype(None, CPU, resolve_models("smollm2-135m").target_dir) == torch.float32  # "other CPUs"
    code, out, _ = cli(["generate", "--help"])
    assert code == 0 and " ".join(AUTO_DTYPE_HELP.split()[:6]) in " ".join(out.split())
