# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny random targets of every supported architecture and matching drafters.

Sizes are odd on purpose (vocab 61, intermediate 37-ish) so shape bugs cannot hide behind
powers of two. Everything is float32 on CPU, where greedy speculative decoding must equal plain
greedy decoding bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# One compute thread per process: the suite runs on 2 cores next to test servers and subprocesses,
# and oversubscribed OpenMP threads made tiny-model tests ~30x slower. Subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines default to compiled rounds; most tests start engines and servers by the dozen, so they run
# eager rounds (DFLASH_TRT_COMPILE=0, inherited by servers). Tests of the compiled default unset it.
os.environ.setdefault("DFLASH_TRT_COMPILE", "0")
# A compile happens in one process: the suite already keeps both cores busy (pytest-xdist), so helper
# processes (engine/precompile.py) would only add their start-up. test_precompile runs them.
os.environ.setdefault("DFLASH_TRT_COMPILE_WORKERS", "1")
# Inductor's own caches (FX graphs, AOTAutograd, C++ kernels) persist between runs of the suite: a
# warm `make test` skips their code generation and C compiles (the compile test of the small pair:
# 208 -> 169 s). The compiled rounds themselves (engine/compile.py's RoundCache) stay in each test's
# own directory, cold where a test says so.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "torchinductor")
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# `dflash-trt ...` as a subprocess with Python's own SIGINT handler, for the tests that interrupt it: a
# test run started in a shell's background inherits SIGINT ignored (so would `python -m dflash_trt`),
# and the CLI rightly leaves an ignored SIGINT alone.
INTERRUPTIBLE_CLI = [
    sys.executable,
    "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from dflash_trt.cli import main; main(sys.argv[1:])",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens", action="store_true", help="rewrite golden files instead of comparing"
    )
    parser.addoption(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run every test marked `timing` next to N busy processes (one spinning core each): "
        "they must pass on a loaded machine (make test-under-load)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    n = int(config.getoption("--busy"))
    return f"timing tests run beside {n} busy processes (--busy {n})" if n > 0 else None


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture(autouse=True)
def _busy_neighbours(request: pytest.FixtureRequest) -> Iterator[None]:
    """With --busy N, a `timing` test runs while N processes spin on the CPU at the same priority."""
    n = int(request.config.getoption("--busy"))
    if n <= 0 or request.node.get_closest_marker("timing") is None:
        yield
        return
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[[Sequence[str]], tuple[int, str, str]]:
    """`code, out, err = cli(["build", ...])`: `dflash-trt ARGS` in this process, with its exit code
    and what it wrote to stdout and stderr."""
    from dflash_trt.cli import main

    def run(args: Sequence[str]) -> tuple[int, str, str]:
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


VOCAB = 61
ARCHS = ("qwen3", "llama", "gpt_oss")


def make_target(arch: str = "qwen3", *, seed: int = 0, vocab: int = VOCAB, layers: int = 6, **overrides: Any):
    """A random float32 transformers causal LM of the given architecture."""
    import torch
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=37,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=1024,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = Qwen3Config(**common)
        cls = Qwen3ForCausalLM
    elif arch == "llama":
        cfg = LlamaConfig(**common)
        cls = LlamaForCausalLM
    elif arch == "gpt_oss":
        # transformers' grouped-GEMM experts need 16-byte strides: keep the expert width a multiple of 4.
        common["intermediate_size"] = overrides.get("intermediate_size", 40)
        common.setdefault("num_local_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("sliding_window", 8)
        common.setdefault(
            "rope_parameters",
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "rope_theta": 150000.0,
            },
        )
        cfg = GptOssConfig(**common)
        cls = GptOssForCausalLM
    else:  # pragma: no cover
        raise ValueError(arch)
    cfg.architectures = [cls.__name__]
    model = cls(cfg).eval()
    # Sharper-than-default logits make greedy ties (and thus flaky equality) vanishingly rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


def drafter_hf_config(
    target: Any,
    *,
    variant: str = "plain",
    layers: int = 2,
    block_size: int = 4,
    dflash2: bool | dict[str, int] = False,
    **extra: Any,
) -> dict[str, Any]:
    """A z-lab v1 drafter config.json dict fitting `target`.

    variants: plain | gpt_oss (attention bias + yarn) | swa (sliding + full layers) |
    scaled (input_embedding_scale, output_multiplier, softcap) | llama3 (llama3 rope)
    dflash2: make it a DFlash2DraftModel (True: DFLASH2_KEYS; a dict overrides some of them).
    """
    t = target.config
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "intermediate_size": 29,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "block_size": block_size,
        "num_target_layers": t.num_hidden_layers,
        "vocab_size": t.vocab_size,
        "dflash_config": {
            "mask_token_id": t.vocab_size - 1,
            "target_layer_ids": [1, t.num_hidden_layers - 2],
        },
    }
    if variant == "gpt_oss":
        cfg.update(
            attention_bias=True,
            num_attention_heads=6,
            head_dim=10,  # H * d = 60 != D = 48, as in the gpt-oss drafters
            rope_theta=150000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
    elif variant == "swa":
        cfg.update(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=5,
            use_sliding_window=True,
        )
    elif variant == "scaled":
        cfg["dflash_config"].update(
            input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=4.0
        )
    elif variant == "llama3":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    elif variant != "plain":  # pragma: no cover
        raise ValueError(variant)
    if dflash2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
        cfg["dflash_config"].update({**DFLASH2_KEYS, **(dflash2 if isinstance(dflash2, dict) else {})})
    cfg.update(extra)
    return cfg


# Small DFlash 2 sizes for hidden 48: 3 taps (the published 2 would leave the third tap untested),
# 6 groups of 8 channels, codebooks of rank 6, 4 candidates per slot.
DFLASH2_KEYS = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 4}


def make_drafter(target: Any, *, seed: int = 1, std: float = 0.3, **kwargs: Any):
    from dflash_trt.models.dflash2 import drafter_class
    from dflash_trt.models.dflash_config import parse_dflash_config

    cfg = parse_dflash_config(hf_config=drafter_hf_config(target, **kwargs))
    return drafter_class(cfg).random(cfg, seed=seed, std=std).eval()


@pytest.fixture
def tmp_models(tmp_path: Path):
    """Factory: save a random target (+ byte tokenizer optionally) and drafter to disk."""

    def _make(arch: str = "qwen3", *, tokenizer: bool = False, **kw: Any) -> tuple[Path, Path]:
        from dflash_trt.models.checkpoint import save_drafter

        target = make_target(arch, **kw)
        drafter = make_drafter(target)
        tdir, ddir = tmp_path / f"{arch}-target", tmp_path / f"{arch}-drafter"
        target.save_pretrained(tdir)
        if tokenizer:
            from dflash_trt.tiny import build_byte_tokenizer

            build_byte_tokenizer().save_pretrained(tdir)
        save_drafter(drafter, ddir)
        return tdir, ddir

    return _make
