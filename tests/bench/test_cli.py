# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt bench ...`: lazy subcommands, flags and YAML specs, usage errors, plot and compare."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash_trt.cli import cli
from tests.bench.scripted_server import Script

FAST = Script(ttft_s=0.01, chunk_gap_s=0.005, tokens_per_chunk=(4,))
REPO = Path(__file__).resolve().parents[2]


def test_help_imports_nothing_heavy() -> None:
    code = textwrap.dedent(
        """
        import sys
        from dflash_trt.cli import main
        for argv in (["--help"], ["bench", "--help"], ["bench", "sweep", "--help"]):
            try:
                main(argv)
            except SystemExit:
                pass
        heavy = sorted(m for m in ("torch", "aiohttp", "matplotlib", "tritonclient", "grpc", "numpy", "transformers", "yaml") if m in sys.modules)
        print("HEAVY", heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "sweep" in out.stdout and "engine" in out.stdout and "--concurrency" in out.stdout
    assert "scripted-server" not in out.stdout  # a test double, not a command (tests/bench/)


def test_bench_group_resolves_added_subcommands_lazily(tmp_path, monkeypatch) -> None:
    import dflash_trt.cli.bench as bench_cli

    (tmp_path / "fake_bench_engine.py").write_text(
        "import click\n\n@click.command()\ndef engine():\n    'Offline engine benchmark.'\n    click.echo('engine ran')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench_cli.SUBCOMMANDS, "engine", "fake_bench_engine:engine")  # the one-line change
    # help then comes from the command itself
    monkeypatch.delitem(bench_cli.SUBCOMMAND_HELP, "engine", raising=False)
    runner = CliRunner()
    result = runner.invoke(cli, ["bench", "engine"])
    assert result.exit_code == 0 and "engine ran" in result.output
    result = runner.invoke(cli, ["bench", "--help"])
    assert "engine" in result.output and "Offline engine benchmark." in result.output


def test_sweep_by_flags_json_output(scripted, tmp_path, byte_tokenizer_dir) -> None:
    with scripted(FAST) as server:
        argv = [
            "bench", "sweep", "--url", server.grpc_url, "--protocol", "triton-grpc", "--concurrency", "1,3",
            "--num-requests", "3", "--warmup", "1", "--isl", "12", "--osl", "9", "--tokenizer", str(byte_tokenizer_dir),
            "--slo-ttft", "1", "--num-gpus", "2", "--label", "DFlash", "--meta", "gpu=none", "--out", str(tmp_path / "r"), "--json",
        ]  # fmt: skip
        result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    (summary,) = data["runs"]
    assert summary["label"] == "DFlash" and summary["config"]["num_gpus"] == 2
    assert [p["concurrency"] for p in summary["points"]] == [1, 3]
    p = summary["points"][1]
    assert p["total_tokens_per_s_per_gpu"] == pytest.approx(p["total_tokens_per_s"] / 2)
    assert p["good_fraction"] == 1.0 and p["mean_acceptance_length"] == pytest.approx(4.0)


def test_sweep_human_output(scripted, tmp_path, byte_tokenizer_dir) -> None:
    with scripted(FAST) as server:
        argv = [
            "bench", "sweep", "--url", server.http_url, "--protocol", "triton-http", "--concurrency", "2",
            "--num-requests", "2", "--warmup", "0", "--isl", "12", "--osl", "9", "--tokenizer", str(byte_tokenizer_dir),
            "--out", str(tmp_path / "r"), "--progress",
        ]  # fmt: skip
        result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    assert (
        "concurrency=2:" in result.output
        and "tok/s/user p50" in result.output
        and "tau 4.00" in result.output
    )


def _write_spec(tmp_path: Path, server: Any, tok: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        textwrap.dedent(
            f"""\
            description: two runs of one workload
            defaults:
              url: {server.http_url}
              protocol: triton-http
              tokenizer: {tok}
              isl: 12
              osl: 9
              concurrency: [1, 2]
              num-requests: 2
              warmup: 0
              meta: {{gpu: none}}
            runs:
              - label: DFlash
                out: {tmp_path / "dflash"}
              - label: AR
                out: {tmp_path / "ar"}
                concurrency: "1"
            """
        )
    )
    return spec


def test_spec_runs_only_and_flag_overrides(scripted, tmp_path, byte_tokenizer_dir, cli) -> None:
    with scripted(FAST) as server:
        spec = _write_spec(tmp_path, server, byte_tokenizer_dir)
        code, out, err = cli(["bench", "sweep", "--spec", str(spec), "--json"])
        assert code == 0, err
        runs = json.loads(out)["runs"]
        assert [r["label"] for r in runs] == ["DFlash", "AR"]
        assert [len(r["points"]) for r in runs] == [2, 1]
        assert runs[0]["config"]["meta"] == {"gpu": "none"}
        # flags beat the spec; --out with several runs gives one directory per label
        code, out, err = cli(
            [
                "bench",
                "sweep",
                "--spec",
                str(spec),
                "--only",
                "AR",
                "--osl",
                "5",
                "--out",
                str(tmp_path / "o"),
                "--json",
            ]
        )
        assert code == 0, err
    (ar,) = json.loads(out)["runs"]
    assert ar["config"]["osl"] == 5 and ar["points"][0]["output_tokens_mean"] == 5
    assert ar["config"]["out"] == str(tmp_path / "o")  # one run selected: the flag replaces its out
    code, out, err = cli(
        ["bench", "sweep", "--spec", str(spec), "--out", str(tmp_path / "many"), "--dry-run"]
    )
    assert code == 0
    assert [r["out"] for r in json.loads(out)["runs"]] == [
        str(tmp_path / "many" / "dflash"),
        str(tmp_path / "many" / "ar"),
    ]


def test_checked_in_specs_resolve(cli) -> None:
    for spec in sorted((REPO / "bench" / "sweeps").glob("*.yaml")):
        code, out, err = cli(["bench", "sweep", "--spec", str(spec), "--dry-run"])
        assert code == 0, f"{spec.name}: {err}"
        runs = json.loads(out)["runs"]
        assert runs and all(r["points"] for r in runs)
    code, out, _ = cli(
        ["bench", "sweep", "--spec", str(REPO / "bench/sweeps/tiny-dflash-vs-ar.yaml"), "--dry-run"]
    )
    dflash, ar = json.loads(out)["runs"]
    assert (dflash["label"], ar["label"]) == ("DFlash", "AR")
    # the same workload: only the url, out and label differ
    assert {k: v for k, v in dflash["config"].items() if k not in ("url", "out", "label")} == {
        k: v for k, v in ar["config"].items() if k not in ("url", "out", "label")
    }
    assert dflash["fingerprint"] != ar["fingerprint"]  # different servers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--url",
                "h:1",
                "--concurrency",
                "1",
                "--request-rate",
                "1",
                "--isl",
                "4",
                "--osl",
                "4",
                "--tokenizer",
                "t",
            ],
            "exactly one of --concurrency and --request-rate",
        ),
        (["--url", "h:1", "--concurrency", "1", "--isl", "4", "--osl", "4"], "--isl needs --tokenizer"),
        (
            ["--url", "h:1", "--concurrency", "1", "--osl", "4", "--tokenizer", "t"],
            "synthetic prompts need --isl and --osl",
        ),
        (
            [
                "--url",
                "h:1",
                "--concurrency",
                "1",
                "--isl",
                "4",
                "--osl",
                "4",
                "--tokenizer",
                "t",
                "--num-requests",
                "3",
                "--duration",
                "2",
            ],
            "mutually exclusive",
        ),
        (
            ["--url", "h:1", "--concurrency", "0", "--isl", "4", "--osl", "4", "--tokenizer", "t"],
            "values must be >= 1",
        ),
        (
            [
                "--url",
                "h:1",
                "--concurrency",
                "1",
                "--isl",
                "4",
                "--osl",
                "4",
                "--tokenizer",
                "t",
                "--extra-inputs",
                "[1]",
            ],
            "expected a JSON object",
        ),
        (["--only", "AR", "--url", "h:1"], "--only selects runs of a --spec"),
        (
            [
                "--url",
                "h:1",
                "--concurrency",
                "1,8",
                "--num-requests",
                "4",
                "--isl",
                "4",
                "--osl",
                "4",
                "--tokenizer",
                "t",
            ],
            "--num-requests=4 is below --concurrency=8",
        ),
    ],
)
def test_usage_errors_exit_2(argv, message, cli, tmp_path) -> None:
    code, _, err = cli(["bench", "sweep", "--out", str(tmp_path / "o"), *argv])
    assert code == 2 and message in err, err
    assert err.startswith("error: ") and "fix:" in err


def test_spec_errors(tmp_path, cli) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  concurency: [1]\n")
    code, _, err = cli(["bench", "sweep", "--spec", str(bad)])
    assert code == 2 and "defaults.concurency is not a `bench sweep` option" in err and "concurrency" in err
    bad.write_text("runs:\n  - label: A\n    concurrency: one\n")
    code, _, err = cli(["bench", "sweep", "--spec", str(bad)])
    assert code == 2 and "runs[0].concurrency='one'" in err
    code, _, err = cli(["bench", "sweep", "--spec", str(bad), "--only", "B"])
    assert code == 2


def test_missing_tokenizer_exits_2_unreachable_server_exits_1(tmp_path, byte_tokenizer_dir, cli) -> None:
    base = ["bench", "sweep", "--url", "http://127.0.0.1:9", "--protocol", "triton-http", "--concurrency", "1",
            "--isl", "4", "--osl", "4", "--out", str(tmp_path / "o")]  # fmt: skip
    code, _, err = cli([*base, "--tokenizer", str(tmp_path / "nope")])
    assert code == 2 and "--tokenizer=" in err
    code, _, err = cli([*base, "--tokenizer", str(byte_tokenizer_dir)])
    assert code == 1 and "cannot reach the server at --url=http://127.0.0.1:9" in err and "fix:" in err


@pytest.mark.timing
def test_plot_and_compare_cli(scripted, tmp_path, byte_tokenizer_dir, cli) -> None:
    with (
        # 20 ms gaps: long enough that scheduler jitter on a busy 2-core machine stays small
        scripted(Script(ttft_s=0.01, chunk_gap_s=0.02, tokens_per_chunk=(4,))) as fast,
        scripted(Script(ttft_s=0.01, chunk_gap_s=0.02, tokens_per_chunk=(1,))) as slow,
    ):
        for server, name in ((fast, "dflash"), (slow, "ar")):
            code, _, err = cli(["bench", "sweep", "--url", server.http_url, "--protocol", "triton-http", "--concurrency", "1,2",
                 "--num-requests", "2", "--warmup", "0", "--isl", "12", "--osl", "9", "--tokenizer", str(byte_tokenizer_dir),
                 "--label", name.upper() if name == "ar" else "DFlash", "--out", str(tmp_path / name)])  # fmt: skip
            assert code == 0, err
    code, out, err = cli(
        ["bench", "plot", str(tmp_path / "dflash"), str(tmp_path / "ar"), "--out", str(tmp_path / "p.html")]
    )
    assert code == 0, err
    html = (tmp_path / "p.html").read_text()
    assert ">DFlash</text>" in html and ">AR</text>" in html
    code, out, err = cli(["bench", "plot", str(tmp_path / "dflash"), "--out", str(tmp_path / "p.png")])
    assert code == 0 and (tmp_path / "p.png").stat().st_size > 0
    code, out, err = cli(
        ["bench", "compare", str(tmp_path / "dflash"), str(tmp_path / "ar"), "--gpu-hour-usd", "2", "--json"]
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["a"] == "DFlash" and result["b"] == "AR"
    per_c = {r["concurrency"]: r for r in result["per_concurrency"]}
    # the comparison is the two runs' own points (4 tokens per chunk vs 1 on an idle machine: about 4x
    # the tokens/s/user; how close is a benchmark's result, not this test's)
    x, y = "tokens_per_s_per_user_p50", "total_tokens_per_s_per_gpu"
    pa, pb = ({q["concurrency"]: q for q in json.loads((tmp_path / n / "summary.json").read_text())["points"]}[1]
              for n in ("dflash", "ar"))  # fmt: skip
    assert per_c[1]["interactivity_ratio"] == pytest.approx(pa[x] / pb[x])
    assert per_c[1]["throughput_ratio"] == pytest.approx(pa[y] / pb[y])
    assert per_c[1]["cost_per_mtok_a"] == pytest.approx(2 / (pa[y] * 3600) * 1e6)
    code, out, err = cli(["bench", "compare", str(tmp_path / "dflash"), str(tmp_path / "ar")])
    assert code == 0 and "Per concurrency:" in out
    code, _, err = cli(
        ["bench", "plot", str(tmp_path / "dflash"), "--out", str(tmp_path / "x.png"), "--x", "bogus"]
    )
    assert code == 2 and "--x='bogus'" in err
    code, _, err = cli(["bench", "compare", str(tmp_path), str(tmp_path / "ar")])
    assert code == 2 and "no summary.json" in err


def test_committed_tiny_cpu_results_still_load_and_compare(cli) -> None:
    """bench/results/tiny-cpu/ (the recorded Triton sweep) stays readable by today's harness."""
    results = REPO / "bench" / "results" / "tiny-cpu"
    code, out, err = cli(["bench", "compare", str(results / "dflash"), str(results / "ar"), "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["a"] == "DFlash" and data["b"] == "AR"
    per_c = {r["concurrency"]: r for r in data["per_concurrency"]}
    assert sorted(per_c) == [1, 2, 4, 8, 16]
    for name in ("dflash", "ar"):
        summary = json.loads((results / name / "summary.json").read_text())
        assert summary["status"] == "complete" and all(p["num_errors"] == 0 for p in summary["points"])
