# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt build`: golden plans for real targets (offline config fixtures), every validation
error, the LLM-API field check, and atomic bundle writes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trt.builder.llm_api import validate_against_field_list, validate_llm_api
from dflash_trt.errors import ConfigError
from tests.conftest import INTERRUPTIBLE_CLI

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures" / "configs"
GOLDEN = HERE / "golden"

PLANS = {
    "gpt-oss-120b-b200-tp8": ["--target", "gpt-oss-120b", "--gpu", "b200", "--tp", "8"],
    "gpt-oss-120b-h200-tp8": ["--target", "gpt-oss-120b", "--gpu", "h200", "--tp", "8"],
    "qwen3-8b-h100-fp8": ["--target", "qwen3-8b", "--gpu", "h100", "--quant", "fp8"],
    "llama-3.1-8b-b200-nvfp4": ["--target", "llama-3.1-8b", "--gpu", "b200", "--quant", "nvfp4"],
}


@pytest.fixture(autouse=True)
def _fixture_configs(monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CONFIG_DIR", str(FIXTURES))


def stable(plan: dict) -> dict:
    """The plan without provenance: package versions and which copy of the configs was read (the
    same plan comes from the shipped copies, the Hub or $DFLASH_TRT_CONFIG_DIR: test_offline.py)."""
    plan = json.loads(json.dumps(plan))
    plan.pop("versions", None)
    plan.pop("config_sources", None)
    return plan


@pytest.mark.parametrize("name", sorted(PLANS))
def test_golden_plans(name, cli, update_goldens):
    code, out, err = cli(["build", *PLANS[name], "--dry-run", "--json"])
    assert code == 0, err
    raw = json.loads(out)
    for role in ("target", "drafter"):
        source = raw["config_sources"][role]
        assert source["source"] == "config-dir" and source["path"].startswith(str(FIXTURES)), source
        assert source["matches_shipped"] is True, source
    plan = stable(raw)
    path = GOLDEN / f"{name}.json"
    if update_goldens:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    assert plan == json.loads(path.read_text()), (
        f"plan drifted from {path}; rerun with --update-goldens and review"
    )
    # whatever the golden says, the LLM-API config must pass TensorRT-LLM's field list
    validate_against_field_list(plan["llm_api"])
    assert plan["validation"]["llm_api"]["method"] == "pinned field list"
    assert plan["validation"]["llm_api"]["commit"] == "0004396720054fd8e205cbf616f21f0b57c6b412"


@pytest.mark.parametrize("flag", [[], ["--no-prefix-caching"]])
def test_prefix_caching_is_written_into_both_backends_configs(cli, flag):
    """kv_cache_config.enable_block_reuse: on by default (TensorRT-LLM's), off with --no-prefix-caching;
    the manifest records only the change."""
    on = not flag
    trt = json.loads(cli(["build", *PLANS["qwen3-8b-h100-fp8"], *flag, "--dry-run", "--json"])[1])
    cpu = json.loads(cli(["build", "--target", "tiny", *flag, "--dry-run", "--json"])[1])
    for plan in (trt, cpu):
        assert plan["llm_api"]["kv_cache_config"]["enable_block_reuse"] is on
        assert ("prefix_caching" in plan["inputs"]) is not on


@pytest.mark.parametrize("flag", [[], ["--no-guided-decoding"]])
def test_guided_decoding_is_written_into_both_backends_configs(cli, flag):
    """guided_decoding_backend: xgrammar by default (structured outputs), left out with --no-guided-decoding;
    the manifest records only the change, and the TensorRT-LLM plan says what the backend costs there."""
    on = not flag
    trt = json.loads(cli(["build", *PLANS["qwen3-8b-h100-fp8"], *flag, "--dry-run", "--json"])[1])
    cpu = json.loads(cli(["build", "--target", "tiny", *flag, "--dry-run", "--json"])[1])
    for plan in (trt, cpu):
        assert plan["llm_api"].get("guided_decoding_backend") == ("xgrammar" if on else None)
        assert ("guided_decoding" in plan["inputs"]) is not on
        assert "use_rejection_sampling" not in plan["llm_api"]["speculative_config"]
    assert any("use_rejection_sampling" in note for note in trt["notes"]) is on


def test_rejection_sampling_beside_a_guided_decoding_backend_is_refused():
    """TorchLlmArgs raises on an explicit use_rejection_sampling: true beside guided_decoding_backend."""
    spec = {
        "decoding_type": "DFlash",
        "max_draft_len": 7,
        "speculative_model": "d",
        "use_rejection_sampling": True,
    }
    validate_against_field_list({"model": "m", "speculative_config": spec})
    with pytest.raises(ConfigError, match=r"use_rejection_sampling.*guided_decoding_backend='xgrammar'"):
        validate_against_field_list(
            {"model": "m", "speculative_config": spec, "guided_decoding_backend": "xgrammar"}
        )
    validate_against_field_list({"model": "m", "speculative_config": {**spec, "use_rejection_sampling": False},
                                 "guided_decoding_backend": "xgrammar"})  # fmt: skip


def test_gpt_oss_120b_profiles(cli):
    b200 = json.loads(cli(["build", *PLANS["gpt-oss-120b-b200-tp8"], "--dry-run", "--json"])[1])
    h200 = json.loads(cli(["build", *PLANS["gpt-oss-120b-h200-tp8"], "--dry-run", "--json"])[1])
    for plan in (b200, h200):
        spec = plan["llm_api"]["speculative_config"]
        assert spec == {"decoding_type": "DFlash", "max_draft_len": 9, "speculative_model": "z-lab/gpt-oss-120b-DFlash",
                        "mask_token_id": 200000, "target_layer_ids": [1, 9, 17, 25, 33]}  # fmt: skip
        assert plan["llm_api"]["backend"] == "pytorch" and plan["llm_api"]["tensor_parallel_size"] == 8
        assert plan["quantization"]["target"]["format"] == "mxfp4" and plan["gpu"]["count"] == 8
    assert (
        b200["llm_api"]["moe_config"] == {"backend": "TRTLLM"}
        and b200["llm_api"]["kv_cache_config"]["dtype"] == "fp8"
    )
    assert (
        h200["llm_api"]["moe_config"] == {"backend": "TRITON"}
        and h200["llm_api"]["kv_cache_config"]["dtype"] == "auto"
    )
    assert b200["quantization"]["target"]["trtllm_quant_algo"] == "W4A8_MXFP4_MXFP8"
    assert h200["quantization"]["target"]["trtllm_quant_algo"] == "W4A16_MXFP4"
    assert "engine/serve-trtllm.sh" in b200["will_write"]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--target", "qwen3-8b", "--gpu", "h100", "--quant", "nvfp4"], r"NVFP4 W4A4 needs Blackwell"),
        (
            ["--target", "gpt-oss-120b", "--gpu", "h200", "--tp", "8", "--quant", "nvfp4"],
            r"NVFP4 W4A4 needs Blackwell",
        ),
        (["--target", "qwen3-8b", "--gpu", "a100", "--quant", "fp8"], r"FP8 compute needs sm89 or newer"),
        (
            ["--target", "gpt-oss-120b", "--gpu", "a100", "--tp", "8"],
            r"runs MXFP4 \(gpt-oss\) weights on Hopper",
        ),
        (
            ["--target", "gpt-oss-120b", "--gpu", "b200", "--tp", "8", "--quant", "fp8"],
            r"up-casts its 4-bit experts",
        ),
        (
            ["--target", "gpt-oss-120b", "--gpu", "h100"],
            r"memory: weights 65.25 GB .* > 72.0 GB usable on h100.*fix: --tp 2",
        ),
        (
            ["--target", "qwen3-8b", "--gpu", "h100", "--tp", "3"],
            r"--tp=3 does not divide the target's num_attention_heads=32",
        ),
        (
            ["--target", "gpt-oss-120b", "--gpu", "gb200", "--tp", "8", "--ep", "3"],
            r"--ep=3 must divide --tp=8",
        ),
        (
            ["--target", "qwen3-8b", "--gpu", "h100", "--ep", "2", "--tp", "2"],
            r"--ep=2: the target is not a mixture of experts",
        ),
        (
            ["--target", "qwen3-8b", "--gpu", "h100", "--block-size", "17"],
            r"block_size=17: exceeds the drafter's trained block_size=16",
        ),
        (
            ["--target", "gpt-oss-120b", "--gpu", "b200", "--tp", "8", "--block-size", "11"],
            r"block_size=11: exceeds .* block_size=10",
        ),
        (
            ["--target", "qwen3-8b", "--backend", "trtllm", "--gpu", "cpu"],
            r"--backend trtllm needs a GPU profile",
        ),
        (
            ["--target", "qwen3-8b", "--backend", "torch", "--tp", "2"],
            r"the embedded \(torch\) engine runs on one device",
        ),
        (
            ["--target", "no-such-model"],
            r"is not `tiny`, a directory, a registered name or a Hugging Face id",
        ),
        (
            ["--target", "mistralai/Unknown-Model", "--offline"],
            r"config.json is not in the local cache .* nor shipped with dflash-trt, and --offline forbids downloading",
        ),
        (["--target", "qwen3-8b", "--gpu", "h100"], r"--output is required"),
    ],
)
def test_validation_errors_are_one_line_exit_2(args, pattern, cli):
    dry = [] if pattern.startswith("--output") else ["--dry-run"]
    code, out, err = cli(["build", *args, *dry])
    assert code == 2, (code, err)
    assert re.search(pattern, err), err
    assert err.count("\n") == 1 and err.startswith("error: ") and out == ""


def test_parallelism_checks_on_odd_head_counts():
    from dflash_trt.builder.gpus import get_profile
    from dflash_trt.builder.plan import BuildRequest
    from dflash_trt.builder.trtllm_backend import check_parallelism
    from dflash_trt.errors import UsageError

    cfg = {"num_attention_heads": 24, "num_key_value_heads": 6}
    assert check_parallelism(BuildRequest(target="x", tp=6), cfg, get_profile("h100")) == 6
    with pytest.raises(UsageError, match=r"--tp=4 and num_key_value_heads=6: one must divide the other"):
        check_parallelism(BuildRequest(target="x", tp=4), cfg, get_profile("h100"))
    with pytest.raises(UsageError, match=r"--tp=12 spans nodes of 8 h100 GPUs unevenly"):
        check_parallelism(BuildRequest(target="x", tp=12), cfg, get_profile("h100"))


def _pair_dirs(tmp_path, **drafter_changes):
    from dflash_trt.models.checkpoint import save_drafter
    from tests.conftest import drafter_hf_config, make_drafter, make_target

    target = make_target("qwen3")
    tdir = tmp_path / "t"
    target.save_pretrained(tdir)
    ddir = tmp_path / "d"
    save_drafter(make_drafter(target), ddir)
    cfg = json.loads((ddir / "config.json").read_text())
    for key, value in drafter_changes.items():
        if key.startswith("dc_"):
            cfg["dflash_config"][key[3:]] = value
        else:
            cfg[key] = value
    (ddir / "config.json").write_text(json.dumps(cfg))
    _ = drafter_hf_config
    return tdir, ddir


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"hidden_size": 40, "head_dim": 10},
            r"drafter.hidden_size=40: does not match the target's hidden_size=48",
        ),
        (
            {"dc_mask_token_id": 61},
            r"mask_token_id=61: is not a row of the target's embedding \(vocab_size=61\)",
        ),
        ({"dc_target_layer_ids": [1, 6]}, r"target_layer_ids\[1\]=6: out of range"),
        ({"block_size": 1}, r"block_size=1: must be an integer >= 2"),
    ],
)
def test_incompatible_pairs_fail_before_heavy_work(tmp_path, cli, changes, pattern):
    tdir, ddir = _pair_dirs(tmp_path, **changes)
    code, _, err = cli(
        ["build", "--target", str(tdir), "--drafter", str(ddir), "--output", str(tmp_path / "b")]
    )
    assert code == 2 and re.search(pattern, err), err
    assert not (tmp_path / "b").exists()


def test_llm_api_check_rejects_unknown_keys_and_values():
    good = {
        "model": "m",
        "backend": "pytorch",
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 3},
    }
    assert validate_llm_api(good)["method"] == "pinned field list"
    bad = [
        ({**good, "kv_cache_free_gpu_memory_fraction": 0.9}, r"llm_api.kv_cache_free_gpu_memory_fraction"),
        ({**good, "kv_cache_config": {"dtype": "int4"}}, r"kv_cache_config.dtype='int4': must be one of"),
        ({**good, "moe_config": {"backend": "FAST"}}, r"moe_config.backend='FAST'"),
        ({**good, "cuda_graph_config": {"padding": True}}, r"cuda_graph_config.padding.*CudaGraphConfig"),
        ({**good, "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 3, "block_size": 4}},
         r"speculative_config.block_size.*DFlashDecodingConfig"),
        ({**good, "speculative_config": {"decoding_type": "Medusa2", "max_draft_len": 3}}, r"decoding_type='Medusa2'"),
        ({**good, "speculative_config": {"decoding_type": "DFlash"}}, r"max_draft_len=None: must be set and > 0"),
    ]  # fmt: skip
    for cfg, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            validate_llm_api(cfg)


def test_models_command(cli):
    code, out, _ = cli(["models", "--json"])
    rows = json.loads(out)
    names = {r["name"] for r in rows}
    assert {
        "gpt-oss-120b",
        "gpt-oss-20b",
        "qwen3-4b",
        "qwen3-8b",
        "llama-3.1-8b",
        "qwen3-coder-30b-a3b",
    } <= names
    assert any(n.startswith("qwen3.5") for n in names) and any(n.startswith("gemma-4") for n in names)
    assert "kimi-k2.5" in names
    gpt = next(r for r in rows if r["name"] == "gpt-oss-120b")
    assert gpt["drafter_id"] == "z-lab/gpt-oss-120b-DFlash" and gpt["block_size"] == 10
    offline = {r["name"] for r in rows if r["shipped_configs"]}
    assert offline == {"gpt-oss-120b", "qwen3-8b", "llama-3.1-8b", "qwen3.8-27b"}
    code, out, _ = cli(["models"])
    assert code == 0 and "gpt-oss-120b" in out and "z-lab/Qwen3-8B-DFlash-b16" in out
    assert sum(line.endswith("(offline)") for line in out.splitlines()) == 4


def test_tiny_bundle_layout_and_idempotent_rebuild(tmp_path, cli):
    out = tmp_path / "b"
    code, _, err = cli(["build", "--target", "tiny", "--output", str(out)])
    assert code == 0, err
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {"manifest.json", "engine/llm_api.yaml", "helm-values.yaml", "bench-plan.yaml", "BUNDLE.md",
            "model_repository/tensorrt_llm/config.pbtxt", "model_repository/tensorrt_llm/1/model.py",
            "model_repository/tensorrt_llm/1/model.yaml"} <= files  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["backend"] == "torch"
        and manifest["speculative"]["max_draft_len"] == manifest["speculative"]["block_size"] - 1
    )
    # 64 sequences in flight by default: a served c=64 is one batch, not four waves of 16
    served = yaml.safe_load((out / "model_repository/tensorrt_llm/1/model.yaml").read_text())
    assert served["max_batch_size"] == 64 and "max_tokens" not in served["kv_cache_config"]
    code, _, err = cli(["build", "--target", "tiny", "--output", str(out)])
    assert code == 2 and "already holds a bundle" in err and "--force" in err
    before = {f: (out / f).read_bytes() for f in files}
    code, _, _ = cli(["build", "--target", "tiny", "--output", str(out), "--force"])
    assert code == 0
    after = {f: (out / f).read_bytes() for f in files}
    changed = {f for f in files if before[f] != after[f]}
    assert changed <= {"manifest.json"}  # only created_utc differs
    m2 = json.loads((out / "manifest.json").read_text())
    m2.pop("created_utc"), manifest.pop("created_utc")
    assert m2 == manifest
    # the bench plan is a valid sweep spec
    from dflash_trt.cli.bench import bench  # noqa: F401  (the spec loader lives behind the CLI)

    spec = subprocess.run([sys.executable, "-m", "dflash_trt", "bench", "sweep", "--spec", str(out / "bench-plan.yaml"),
                           "--only", "DFlash", "--dry-run", "--json"], capture_output=True, text=True)  # fmt: skip
    assert spec.returncode == 0, spec.stderr


def test_failed_build_leaves_nothing_and_keeps_the_old_bundle(tmp_path, cli, monkeypatch):
    out = tmp_path / "b"
    assert cli(["build", "--target", "tiny", "--output", str(out)])[0] == 0
    old = (out / "manifest.json").read_text()

    def boom(*a, **k):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr("dflash_trt.triton.repository.render_repository", boom)
    code, _, err = cli(["build", "--target", "tiny", "--output", str(out), "--force"])
    assert code == 1 and "disk full" in err
    assert (out / "manifest.json").read_text() == old  # untouched
    code, _, _ = cli(["build", "--target", "tiny", "--output", str(tmp_path / "new")])
    assert code == 1 and not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary leftovers


def test_interrupted_build_leaves_no_partial_bundle(tmp_path):
    """SIGINT while ModelOpt is quantizing (the slow part): no bundle, no temporary directory."""
    import signal
    import time

    out = tmp_path / "b"
    proc = subprocess.Popen([*INTERRUPTIBLE_CLI, "build", "--target", "tiny", "--quant", "fp8",
                             "--calib-samples", "12", "--output", str(out)], stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    seen = ""
    # Interrupt once the temporary bundle holds the linked drafter: the build is in its quantization
    # step then (heavy imports, calibration), the slow part.
    while time.monotonic() < deadline:
        tmps = [p for p in tmp_path.iterdir() if p.name.startswith(".b.tmp-")]
        if (tmps and (tmps[0] / "engine" / "checkpoints" / "drafter").exists()) or proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, seen = proc.communicate(timeout=60)
    assert proc.returncode in (130, 1), seen
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_a_library_swallows_still_stops_the_build(tmp_path, cli, monkeypatch):
    """Ctrl-C caught and dropped inside a step (as third-party code can do) is not lost: the build
    stops at its next step boundary, exits 130 and leaves the existing bundle as it was."""
    import signal
    import threading

    assert threading.current_thread() is threading.main_thread()  # where signal handlers run
    out = tmp_path / "b"
    assert cli(["build", "--target", "tiny", "--output", str(out)])[0] == 0
    old = (out / "manifest.json").read_text()
    from dflash_trt.triton import repository

    real = repository.render_repository
    swallowed = []

    def render_and_swallow(*a, **k):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            swallowed.append(True)  # a library that drops it
        return real(*a, **k)

    monkeypatch.setattr("dflash_trt.triton.repository.render_repository", render_and_swallow)
    # Python's own SIGINT handler, as under an interactive shell: a run in a shell's background
    # inherits SIGINT ignored, and then the build, rightly, does not watch for it.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = cli(["build", "--target", "tiny", "--output", str(out), "--force"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the build put it back
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert swallowed == [True]
    assert code == 130 and "aborted" in err, err
    assert (out / "manifest.json").read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary leftovers


RECIPES = sorted((Path(__file__).resolve().parents[2] / "build" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_checked_in_recipes_plan(recipe, cli):
    code, out, err = cli(["build", "-c", str(recipe), "--dry-run", "--json"])
    assert code == 0, err
    plan = json.loads(out)
    assert plan["speculative"]["decoding_type"] == "DFlash"
    if plan["backend"] == "trtllm":
        validate_against_field_list(plan["llm_api"])


def test_recipe_keys_are_checked_and_flags_override(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: tiny\nturbo: true\n")
    code, _, err = cli(["build", "-c", str(bad), "--dry-run"])
    assert code == 2 and "'turbo' is not a build option" in err
    recipe = Path(__file__).resolve().parents[2] / "build" / "recipes" / "qwen3-8b-h100-fp8.yaml"
    code, out, _ = cli(["build", "-c", str(recipe), "--max-batch-size", "8", "--dry-run", "--json"])
    assert code == 0 and json.loads(out)["limits"]["max_batch_size"] == 8
