# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt generate`: the JSON contract, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CONTRACT = {
    "output_ids": list,
    "acceptance_lengths": list,
    "text": (str, type(None)),
    "num_rounds": int,
    "mean_acceptance_length": float,
    "ttft_s": float,
    "decode_s": float,
    "num_draft_tokens": int,
    "num_overturned_draft_tokens": int,
    "overturn_rate": float,
}


def test_help_and_import_do_not_load_torch():
    code = (
        "import sys, io, contextlib\n"
        "import dflash_trt\n"
        "from dflash_trt.cli import main\n"
        "for args in (['--help'], ['generate', '--help'], ['--version']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try: main(args)\n"
        "        except SystemExit as e: assert e.code == 0, (args, e.code)\n"
        "heavy = [m for m in ('torch', 'transformers', 'tritonclient', 'modelopt', 'triton', 'matplotlib') if m in sys.modules]\n"
        "print(heavy)\n"
        "import os; print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    # the CLI limits libgomp's spin for itself before any command loads torch (utils/child.py)
    assert out.stdout.split() == ["[]", "1000"], out.stdout + out.stderr


def test_json_contract_on_tiny(cli):
    args = ["generate", "--target", "tiny", "--prompt", "def fib(n):", "--max-new-tokens", "24", "--json"]
    code, out, _ = cli(args)
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1, "exactly one JSON object on stdout"
    data = json.loads(lines[0])
    assert set(data) == set(CONTRACT)
    for key, typ in CONTRACT.items():
        assert isinstance(data[key], typ), key
    assert len(data["output_ids"]) == 24 or data["output_ids"][-1] == 256  # length or eos
    assert data["num_rounds"] == len(data["acceptance_lengths"])
    assert sum(data["acceptance_lengths"]) == len(data["output_ids"]) - 1
    from dflash_trt.tiny import build_byte_tokenizer

    assert data["text"] == build_byte_tokenizer().decode(data["output_ids"], skip_special_tokens=True)
    code, out2, _ = cli([*args, "--no-draft"])
    assert code == 0 and json.loads(out2)["output_ids"] == data["output_ids"]
    assert set(json.loads(out2)["acceptance_lengths"]) <= {1}


def test_prompt_ids_sampling_and_block_size(cli):
    base = ["generate", "--target", "tiny", "--prompt-ids", "5,17,42", "--max-new-tokens", "16", "--json"]
    code, out, _ = cli([*base, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3"])
    assert code == 0
    a = json.loads(out)
    code, out, _ = cli([*base, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3"])
    assert json.loads(out)["output_ids"] == a["output_ids"]
    code, out, _ = cli([*base, "--block-size", "2"])
    assert code == 0 and max(json.loads(out)["acceptance_lengths"]) <= 2


def test_human_output_reports_statistics(cli):
    code, out, err = cli(["generate", "--target", "tiny", "--prompt", "x = ", "--max-new-tokens", "8"])
    assert code == 0 and out
    assert "mean acceptance length" in err and "rounds" in err


def test_local_directories(tmp_models, cli):
    tdir, ddir = tmp_models("llama")
    args = [
        "generate",
        "--target",
        str(tdir),
        "--drafter",
        str(ddir),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "12",
    ]
    code, out, _ = cli([*args, "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["text"] is None and len(data["output_ids"]) == 12
    code, out, _ = cli([*args, "--json", "--no-draft"])
    assert json.loads(out)["output_ids"] == data["output_ids"]


@pytest.mark.parametrize(
    ("extra", "code_want", "pattern"),
    [
        (
            ["--prompt", "hello"],
            2,
            r"error: --prompt needs a tokenizer.*fix: pass token ids with --prompt-ids",
        ),
        (["--prompt-ids", "1,x"], 2, r"--prompt-ids.*not a comma-separated list of integers"),
        (
            ["--prompt-ids", "1,2", "--block-size", "9"],
            2,
            r"block_size=9: exceeds the drafter's trained block_size=4",
        ),
        (["--prompt-ids", "1,2,999"], 2, r"prompt_ids\[2\]=999: out of range for vocab_size=61"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], 2, r"--temperature"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], 2, r"--top-p"),
        (["--prompt", "a", "--prompt-ids", "1"], 2, r"exactly one of --prompt and --prompt-ids"),
    ],
)
def test_usage_errors_are_one_line(tmp_models, cli, extra, code_want, pattern):
    import re

    tdir, ddir = tmp_models("qwen3")
    code, out, err = cli(
        ["generate", "--target", str(tdir), "--drafter", str(ddir), "--max-new-tokens", "4", *extra]
    )
    assert code == code_want
    assert re.search(pattern, err), err
    assert out == ""
    assert "Traceback" not in err


def test_pair_errors(tmp_path, tmp_models, cli):
    from dflash_trt.models.checkpoint import save_drafter
    from tests.conftest import make_drafter, make_target

    tdir, _ = tmp_models("qwen3")
    other = make_target("qwen3", hidden_size=40, head_dim=10)
    save_drafter(make_drafter(other), tmp_path / "wrong")
    code, _, err = cli(
        [
            "generate",
            "--target",
            str(tdir),
            "--drafter",
            str(tmp_path / "wrong"),
            "--prompt-ids",
            "1",
            "--max-new-tokens",
            "2",
        ]
    )
    assert code == 2 and "drafter.hidden_size=40: does not match the target's hidden_size=48" in err
    code, _, err = cli(["generate", "--target", str(tdir), "--prompt-ids", "1", "--max-new-tokens", "2"])
    assert code == 2 and "no drafter for --target" in err and "--no-draft" in err
    code, _, err = cli(
        ["generate", "--target", "no-such-model", "--prompt-ids", "1", "--max-new-tokens", "2"]
    )
    assert code == 2 and "neither a known model name, a .gguf file nor a directory" in err


def test_cuda_requested_without_cuda(tmp_models, cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tdir, _ = tmp_models("qwen3")
    code, _, err = cli(
        [
            "generate",
            "--target",
            str(tdir),
            "--no-draft",
            "--prompt-ids",
            "1",
            "--max-new-tokens",
            "2",
            "--device",
            "cuda",
        ]
    )
    assert code == 3 and "CUDA is not available" in err


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_embedded_engine_equals_reference_loop(tmp_models, cli, arch):
    tdir, ddir = tmp_models(arch)
    base = ["generate", "--target", str(tdir), "--drafter", str(ddir), "--prompt-ids", "4,8,15,16,23,42"]
    base += ["--max-new-tokens", "20", "--json"]
    outs = {}
    for engine in ("embedded", "reference"):
        code, out, err = cli([*base, "--engine", engine])
        assert code == 0, err
        outs[engine] = json.loads(out)
    assert outs["embedded"]["output_ids"] == outs["reference"]["output_ids"]
    assert outs["embedded"]["acceptance_lengths"] == outs["reference"]["acceptance_lengths"]


def test_dflash2_drafter_through_the_embedded_engine(cli):
    """`--drafter tiny-dflash2` on the embedded engine: the reference loop's tokens, rounds and overturned
    picks (greedy and sampled), plain decoding's tokens when greedy, the overturn rate in the JSON."""
    base = ["generate", "--target", "tiny", "--drafter", "tiny-dflash2", "--prompt", "def fib(n):",
            "--max-new-tokens", "48", "--ignore-eos", "--json"]  # fmt: skip
    plain = json.loads(cli([*base, "--no-draft"])[1])
    for sampling in ([], ["--temperature", "0.7", "--seed", "5"]):
        code, out, err = cli([*base, *sampling, "--engine", "embedded"])
        assert code == 0, err
        code, ref_out, err = cli([*base, *sampling, "--engine", "reference"])
        assert code == 0, err
        got, ref = json.loads(out), json.loads(ref_out)
        for key in ("output_ids", "acceptance_lengths", "num_draft_tokens", "num_overturned_draft_tokens"):
            assert got[key] == ref[key], key
        assert got["num_overturned_draft_tokens"] > 0
        assert got["overturn_rate"] == got["num_overturned_draft_tokens"] / got["num_draft_tokens"]
        if not sampling:
            assert got["output_ids"] == plain["output_ids"] and plain["overturn_rate"] == 0.0


def test_no_leak_report_at_exit():
    """An LLM freezes its objects out of the cyclic collector; OpenAI-Triton's bindings (loaded by torch)
    used to report them as leaked at every exit, burying a command's own output. The CLI and a script
    that holds an LLM exit quietly."""
    script = (
        "import sys\n"
        "from dflash_trt.api.llm import LLM\n"
        "llm = LLM('tiny', compile=False)\n"
        "assert 'triton._C.libtriton' in sys.modules, 'the bindings that reported leaks are not loaded'\n"
        "print(llm.generate('def f(').outputs[0].text)\n"
    )
    for cmd in (
        [sys.executable, "-c", script],
        [sys.executable, "-m", "dflash_trt", "generate", "--target", "tiny", "--prompt", "def f(",
         "--max-new-tokens", "8"],
    ):  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert "leaked" not in out.stderr and "nanobind" not in out.stderr, out.stderr[-2000:]
