# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt bench`: throughput-vs-interactivity sweeps, Pareto plots and A/B comparisons.

Subcommands are resolved lazily from `SUBCOMMANDS` (name -> "module:attr"), so another module
can add one with a one-line change, e.g. "engine": "dflash_trt.cli.bench_engine:engine". Only
click and the standard library are imported at the top of this module.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from dflash_trt.cli._api_key import api_key_from_options, api_key_options
from dflash_trt.errors import UsageError

# name -> "module:attribute"
SUBCOMMANDS: dict[str, str] = {
    "sweep": "dflash_trt.cli.bench:sweep",
    "plot": "dflash_trt.cli.bench:plot",
    "compare": "dflash_trt.cli.bench:compare",
    "engine": "dflash_trt.cli.bench_engine:engine",
}
# Optional one-line help per subcommand (keeps `bench --help` from importing the module).
SUBCOMMAND_HELP: dict[str, str] = {
    "sweep": "Sweep concurrency (or request rate) against a server; write summary.json, requests.jsonl, points.csv.",
    "plot": "Pareto frontiers (tokens/s/GPU vs tokens/s/user) of several runs: PNG or self-contained HTML.",
    "compare": "Run A vs run B: speedup at matched interactivity/throughput, cost, crossover concurrency.",
    "engine": "Offline embedded-engine benchmark: plain decoding vs DFlash across batch sizes.",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is not None:
            module_name, _, attr = target.partition(":")
            cmd = getattr(importlib.import_module(module_name), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            text = SUBCOMMAND_HELP.get(name)
            if text is None:
                cmd = self.get_command(ctx, name)
                text = cmd.get_short_help_str(limit=90) if cmd is not None else ""
            rows.append((name, text))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_LazyGroup)
def bench() -> None:
    """Benchmarks: throughput-vs-interactivity sweeps, Pareto plots, comparisons.

    \b
    Typical session (DFlash vs the same server without drafting):
      dflash-trt bench sweep --spec bench/sweeps/tiny-dflash-vs-ar.yaml
      dflash-trt bench plot bench/results/tiny-cpu/dflash bench/results/tiny-cpu/ar --out pareto.png
      dflash-trt bench compare bench/results/tiny-cpu/dflash bench/results/tiny-cpu/ar --gpu-hour-usd 2.5
    """


# ---------------------------------------------------------------------------------------- types
class _NumberList(click.ParamType):
    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.name = "INTS" if kind is int else "NUMBERS"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[Any, ...]:
        if isinstance(value, tuple):
            return value
        items = (
            value
            if isinstance(value, list)
            else [value]
            if isinstance(value, (int, float))
            else str(value).replace(" ", "").split(",")
        )
        try:
            out = tuple(self.kind(v) for v in items if v != "")
        except (TypeError, ValueError):
            self.fail(
                f"{value!r} is not a comma-separated list of {'integers' if self.kind is int else 'numbers'}",
                param,
                ctx,
            )
        if not out:
            self.fail("the list is empty", param, ctx)
        return out


INTS = _NumberList(int)
NUMBERS = _NumberList(float)
PROTOCOL_CHOICES = ("triton-grpc", "triton-http", "openai-completions", "openai-chat")


def _json_object(value: Any, flag: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{flag}={value!r}: not JSON ({exc.msg})", hint=f"""e.g. {flag} '{{"key": 1}}'"""
        ) from None
    if not isinstance(obj, dict):
        raise UsageError(f"{flag}={value!r}: expected a JSON object", hint=f"""e.g. {flag} '{{"key": 1}}'""")
    return obj


def _key_values(values: Any, flag: str) -> dict[str, str]:
    if isinstance(values, dict):
        return {str(k): str(v) for k, v in values.items()}
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, val = str(item).partition("=")
        if not sep or not key:
            raise UsageError(f"{flag}={item!r}: expected KEY=VALUE", hint=f"e.g. {flag} draft_len=15")
        out[key] = val
    return out


# ---------------------------------------------------------------------------------------- sweep
# Options that only steer the command itself (not valid in a YAML spec).
# Not sweep settings: never read from a spec file nor written to a run (the API key above all).
_COMMAND_ONLY = frozenset(
    {"spec", "only", "dry_run", "as_json", "progress", "overwrite", "api_key", "api_key_file"}
)
# option name -> SweepConfig field where they differ
_FIELD = {
    "duration": "duration_s",
    "slo_ttft": "slo_ttft_s",
    "slo_tpot": "slo_tpot_s",
    "slo_e2el": "slo_e2el_s",
    "request_timeout": "request_timeout_s",
}


@click.command()
@click.option(
    "--spec",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML spec under bench/sweeps/ (keys = option names; flags override).",
)
@click.option(
    "--only",
    multiple=True,
    metavar="LABEL",
    help="With --spec: run only the runs with this label (repeatable).",
)
@click.option(
    "--url",
    metavar="URL",
    help="Server URL: http://HOST:8000 (Triton HTTP, OpenAI) or HOST:8001 (Triton gRPC).",
)
@click.option("--protocol", type=click.Choice(PROTOCOL_CHOICES), default="triton-grpc", show_default=True)
@click.option(
    "--model", default="tensorrt_llm", show_default=True, help="Triton model name, or the OpenAI model id."
)
@click.option("--concurrency", type=INTS, help="Closed loop: requests kept in flight, e.g. 1,2,4,8,16.")
@click.option("--request-rate", type=NUMBERS, help="Open loop: Poisson arrivals per second, e.g. 0.5,1,2.")
@click.option(
    "--max-concurrency", type=click.IntRange(min=1), help="With --request-rate: cap on requests in flight."
)
@click.option(
    "--burstiness",
    type=float,
    default=1.0,
    show_default=True,
    help="Gamma shape of inter-arrival times (1 = Poisson).",
)
@click.option(
    "--num-requests",
    type=click.IntRange(min=1),
    help="Measured requests per point [default: 10 x concurrency].",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Seconds per point instead of --num-requests.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    help="Warm-up requests per point, reported separately [default: 2 x concurrency].",
)
@click.option(
    "--isl", type=click.IntRange(min=1), help="Synthetic prompts of exactly this many input tokens."
)
@click.option("--osl", type=click.IntRange(min=1), help="Output tokens requested per request.")
@click.option(
    "--range-ratio",
    type=float,
    default=1.0,
    show_default=True,
    help="Draw ISL/OSL uniformly from [ratio*N, N] (InferenceX: 0.8).",
)
@click.option(
    "--system-prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Every chat starts with one shared system prompt of about N tokens (a prefix cache serves it).",
)
@click.option(
    "--turns",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Multi-turn chats: turn k resends turns 0..k-1 (user, and an OSL-token assistant reply); a "
    "conversation's turns go one after another (closed loop only).",
)
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False),
    help="JSONL prompts: {prompt|text|messages, output_tokens?} per line.",
)
@click.option(
    "--tokenizer",
    metavar="NAME_OR_DIR",
    help="The served model's tokenizer (HF name or dir; `tiny` = the embedded tiny model).",
)
@click.option(
    "--chat/--no-chat",
    default=False,
    show_default=True,
    help="Wrap prompts in the tokenizer's chat template.",
)
@click.option(
    "--thinking/--no-thinking",
    default=False,
    show_default=True,
    help="enable_thinking for the chat template.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of prompts and arrivals (same seed = same workload).",
)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0), default=None)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--sampling-seed", type=int, default=None, help="Seed sent to the server's sampler.")
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="Fixed output length where the server supports it.",
)
@click.option(
    "--num-gpus",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="GPUs behind the URL (tp*pp*...), for per-GPU throughput.",
)
@click.option(
    "--slo-ttft", type=click.FloatRange(min=0.0, min_open=True), help="Goodput SLO on TTFT, seconds."
)
@click.option(
    "--slo-tpot", type=click.FloatRange(min=0.0, min_open=True), help="Goodput SLO on TPOT, seconds."
)
@click.option(
    "--slo-e2el",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Goodput SLO on end-to-end latency, seconds.",
)
@click.option("--label", metavar="TEXT", help="Name of this run in plots and comparisons (e.g. DFlash, AR).")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Run directory (resumed when it holds the same configuration).",
)
@click.option("--overwrite", is_flag=True, help="Discard whatever run --out holds and start afresh.")
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0.0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds per request.",
)
@click.option(
    "--extra-inputs",
    metavar="JSON",
    help="Extra request fields/inputs merged into every request, as a JSON object.",
)
@click.option(
    "--meta",
    multiple=True,
    metavar="KEY=VALUE",
    help="Free-form facts stored in summary.json (GPU, TP, draft length...).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bars on stderr [default: when stderr is a terminal].",
)
@api_key_options(role="send with every request")
@click.option("--dry-run", is_flag=True, help="Print the resolved runs and points as JSON; send nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as one JSON object on stdout.")
@click.pass_context
def sweep(ctx: click.Context, **kwargs: Any) -> None:
    """Sweep concurrency (closed loop) or request rate (Poisson) against a streaming server.

    Each point measures TTFT, TPOT, inter-token and inter-chunk latency, throughput per GPU,
    tokens/s per user, goodput and the mean acceptance length, with tokens counted from the
    server (never one per chunk). Points are written as they complete: Ctrl-C keeps them and the
    same command resumes. Definitions of every metric: bench/README.md and summary.json.

    \b
    Examples:
      dflash-trt bench sweep --url localhost:8001 --protocol triton-grpc --tokenizer Qwen/Qwen3-8B \\
          --isl 1024 --osl 1024 --concurrency 1,2,4,8,16,32,64 --label DFlash --out bench/runs/q3-dflash
      dflash-trt bench sweep --url http://localhost:8000 --protocol openai-chat --model qwen3 \\
          --dataset prompts.jsonl --tokenizer Qwen/Qwen3-8B --request-rate 1,2,4 --out bench/runs/rate
      dflash-trt bench sweep --spec bench/sweeps/tiny-dflash-vs-ar.yaml --only AR
    """
    runs = _resolve_runs(ctx, kwargs)
    from dflash_trt.bench.sweep import SweepConfig

    configs = [SweepConfig(**r) for r in runs]
    for cfg in configs:
        cfg.validate()
    key = api_key_from_options(kwargs["api_key"], kwargs["api_key_file"])
    if kwargs["dry_run"]:
        click.echo(json.dumps({"runs": [_dry_run(c) for c in configs]}, indent=2))
        return
    progress = kwargs["progress"]
    if progress is None:
        progress = sys.stderr.isatty()
    as_json = kwargs["as_json"]
    summaries = [
        _run_one(cfg, overwrite=kwargs["overwrite"], progress=progress, as_json=as_json, api_key=key)
        for cfg in configs
    ]
    if as_json:
        click.echo(json.dumps({"runs": summaries}, default=str))


def _dry_run(c: Any) -> dict[str, Any]:
    """What --dry-run prints for one run: its resolved configuration and points."""
    return {
        "label": c.label,
        "out": c.out,
        "fingerprint": c.fingerprint(),
        "config": c.to_json(),
        "points": [
            {"key": p.key, "num_requests": p.num_requests, "duration_s": p.duration_s, "warmup": p.warmup}
            for p in c.points()
        ],
    }


def _run_one(cfg: Any, *, overwrite: bool, progress: bool, as_json: bool, api_key: Any) -> dict[str, Any]:
    """One run (a line per point as it completes, unless --json); Ctrl-C says what was kept."""
    from dflash_trt.bench.sweep import run_sweep

    name = cfg.label or cfg.out

    def show(p: dict[str, Any]) -> None:
        if not as_json:
            click.echo(_point_line(name, p))

    try:
        summary = run_sweep(cfg, overwrite=overwrite, progress=progress, on_point=show, api_key=api_key)
    except KeyboardInterrupt:
        done = _count_points(cfg.out)
        click.echo(
            f"interrupted: {done} completed point(s) kept in {cfg.out}; run the same command again to resume",
            err=True,
        )
        raise
    if not as_json:
        click.echo(f"[{name}] wrote {cfg.out}/summary.json, requests.jsonl, points.csv")
    return summary


def _count_points(out: str) -> int:
    try:
        return len(json.loads((Path(out) / "summary.json").read_text()).get("points", []))
    except (OSError, ValueError):
        return 0


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _point_line(name: str, p: dict[str, Any]) -> str:
    return (
        f"[{name}] {p['key']}: {_num(p.get('tokens_per_s_per_user_p50'))} tok/s/user p50 | "
        f"{_num(p.get('total_tokens_per_s_per_gpu'))} tok/s/GPU ({_num(p.get('output_tokens_per_s_per_gpu'))} output) | "
        f"TTFT p50 {_ms(p.get('ttft_p50_s'))} | TPOT p50 {_ms(p.get('tpot_p50_s'))} | "
        f"tau {_num(p.get('mean_acceptance_length'), '{:.2f}')} | "
        + (
            f"overturn {p['overturn_rate_pooled']:.2f} | "
            if p.get("overturn_rate_pooled") is not None
            else ""
        )
        + f"errors {p.get('num_errors')}/{p.get('num_requests')}"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "run"


def _resolve_runs(ctx: click.Context, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Merge click defaults < spec defaults < spec run < explicit flags, into SweepConfig kwargs."""
    params = {p.name: p for p in ctx.command.params if p.name}
    explicit = {
        name
        for name in kwargs
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    spec_runs: list[dict[str, Any]] = [{}]
    spec_path: Path | None = kwargs["spec"]
    if spec_path is not None:
        spec_runs = _load_spec(spec_path, ctx, params)
    if kwargs["only"]:
        if spec_path is None:
            raise UsageError("--only selects runs of a --spec", hint="pass --spec FILE.yaml, or drop --only")
        labels = [r.get("label") for r in spec_runs]
        spec_runs = [r for r in spec_runs if r.get("label") in kwargs["only"]]
        if not spec_runs:
            raise UsageError(
                f"--only={','.join(kwargs['only'])}: no run of {spec_path} has that label",
                hint=f"labels in the spec: {', '.join(map(str, labels))}",
            )
    resolved = []
    for run in spec_runs:
        values = {k: v for k, v in kwargs.items() if k not in _COMMAND_ONLY}
        for k, v in run.items():
            if k not in explicit:
                values[k] = v
        resolved.append(values)
    if len(resolved) > 1 and "out" in explicit:
        for values in resolved:
            values["out"] = str(Path(kwargs["out"]) / _slug(str(values.get("label") or "run")))
    return [_to_config_kwargs(v) for v in resolved]


def _to_config_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        out[_FIELD.get(k, k)] = v
    out["concurrency"] = tuple(out.get("concurrency") or ())
    out["request_rate"] = tuple(out.get("request_rate") or ())
    out["extra_inputs"] = tuple(_json_object(out.get("extra_inputs"), "--extra-inputs").items())
    out["meta"] = tuple(_key_values(out.get("meta"), "--meta").items())
    for key in ("dataset", "out"):
        if out.get(key) is not None:
            out[key] = str(out[key])
    if out.get("url") is None:
        out["url"] = ""
    if out.get("out") is None:
        out["out"] = ""
    return out


def _load_spec(path: Path, ctx: click.Context, params: dict[str, click.Parameter]) -> list[dict[str, Any]]:
    import yaml

    if not path.is_file():
        raise UsageError(f"--spec={path}: no such file", hint="see bench/sweeps/ for examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"--spec={path}: not YAML ({exc})", hint="check the file's syntax") from None
    if not isinstance(data, dict):
        raise UsageError(
            f"--spec={path}: expected a mapping", hint="top-level keys: description, defaults, runs"
        )
    data = dict(data)
    data.pop("description", None)
    runs = data.pop("runs", None)
    defaults = data.pop("defaults", None) or {}
    defaults = {**data, **defaults}  # a flat spec is one run; top-level keys act as defaults
    if runs is None:
        runs = [{}]
    if (
        not isinstance(runs, list)
        or not all(isinstance(r, dict) for r in runs)
        or not isinstance(defaults, dict)
    ):
        raise UsageError(
            f"--spec={path}: `runs` must be a list of mappings and `defaults` a mapping",
            hint="see bench/sweeps/",
        )
    out = []
    for i, run in enumerate(runs):
        merged: dict[str, Any] = {}
        for where, block in (("defaults", defaults), (f"runs[{i}]", run)):
            for raw_key, value in block.items():
                key = str(raw_key).replace("-", "_")
                param = params.get(key)
                if param is None or key in _COMMAND_ONLY:
                    valid = sorted(n.replace("_", "-") for n in params if n not in _COMMAND_ONLY)
                    raise UsageError(
                        f"--spec={path}: {where}.{raw_key} is not a `bench sweep` option",
                        hint=f"valid keys: {', '.join(valid)}",
                    )
                if value is None or key in ("extra_inputs", "meta"):
                    merged[key] = value
                    continue
                try:
                    merged[key] = param.type_cast_value(ctx, value)
                except click.BadParameter as exc:
                    raise UsageError(
                        f"--spec={path}: {where}.{raw_key}={value!r}: {exc.message}",
                        hint="fix the value in the spec",
                    ) from None
        out.append(merged)
    return out


# ---------------------------------------------------------------------------------------- plot
@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="FILE.png (matplotlib) or FILE.html (self-contained).",
)
@click.option(
    "--x",
    "x_key",
    default="tokens_per_s_per_user_p50",
    show_default=True,
    help="Interactivity metric (a key of the points).",
)
@click.option(
    "--y",
    "y_key",
    default="total_tokens_per_s_per_gpu",
    show_default=True,
    help="Throughput metric (e.g. output_tokens_per_s_per_gpu).",
)
@click.option("--log", is_flag=True, help="Logarithmic axes.")
def plot(run_dirs: tuple[str, ...], out: Path, x_key: str, y_key: str, log: bool) -> None:
    """Pareto frontiers of several runs on one chart, points annotated with tau.

    \b
    Example:
      dflash-trt bench plot bench/runs/dflash bench/runs/ar --out pareto.html
    """
    from dflash_trt.bench.plot import plot_runs
    from dflash_trt.bench.sweep import load_summary

    summaries = [
        (Path(d).name if Path(d).is_dir() else Path(d).parent.name, load_summary(d)) for d in run_dirs
    ]
    _check_axes(summaries, x_key, y_key)
    path = plot_runs(summaries, out, x=x_key, y=y_key, log=log)
    click.echo(f"wrote {path}")


def _check_axes(summaries: list[tuple[str, dict[str, Any]]], x_key: str, y_key: str) -> None:
    for flag, key in (("--x", x_key), ("--y", y_key)):
        if not any(key in p for _, s in summaries for p in s.get("points", [])):
            keys = sorted(
                {
                    k
                    for _, s in summaries
                    for p in s.get("points", [])
                    for k, v in p.items()
                    if isinstance(v, (int, float))
                }
            )
            raise UsageError(
                f"{flag}={key!r}: no point has this metric",
                hint=f"numeric point keys: {', '.join(keys[:40])}",
            )


# ---------------------------------------------------------------------------------------- compare
@click.command()
@click.argument("run_a", type=click.Path(exists=True))
@click.argument("run_b", type=click.Path(exists=True))
@click.option(
    "--gpu-hour-usd",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Price of one GPU hour, for cost per million tokens.",
)
@click.option(
    "--x", "x_key", default="tokens_per_s_per_user_p50", show_default=True, help="Interactivity metric."
)
@click.option(
    "--y", "y_key", default="total_tokens_per_s_per_gpu", show_default=True, help="Throughput-per-GPU metric."
)
@click.option(
    "--at",
    "levels",
    type=NUMBERS,
    help="Interactivity levels to compare at [default: a grid over the common range + 50,100,200,500].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def compare(
    run_a: str,
    run_b: str,
    gpu_hour_usd: float | None,
    x_key: str,
    y_key: str,
    levels: tuple[float, ...] | None,
    as_json: bool,
) -> None:
    """Speedup of run A over run B at matched interactivity and matched throughput.

    Also: per-concurrency ratios with tau, cost per million tokens, and the concurrency where
    speculation stops paying (A's throughput per GPU falls below B's).

    \b
    Example:
      dflash-trt bench compare bench/runs/dflash bench/runs/ar --gpu-hour-usd 2.5
    """
    from dflash_trt.bench.compare import compare_runs, format_text
    from dflash_trt.bench.sweep import load_summary

    a, b = load_summary(run_a), load_summary(run_b)
    a.setdefault("label", None)
    b.setdefault("label", None)
    a["label"] = a["label"] or Path(run_a).name
    b["label"] = b["label"] or Path(run_b).name
    _check_axes([("A", a), ("B", b)], x_key, y_key)
    result = compare_runs(a, b, x=x_key, y=y_key, gpu_hour_usd=gpu_hour_usd, levels=levels)
    click.echo(json.dumps(result, indent=2) if as_json else format_text(result), nl=as_json)
