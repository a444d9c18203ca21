# SPDX-License-Identifier: Apache-2.0
"""trust_remote_code is written only when a repository's config needs its own code; the plan's
notes say which repository and why; --no-remote-code refuses such a plan (exit 2)."""

from __future__ import annotations

import json

from tests.build.test_build import _pair_dirs

CUSTOM = {
    "AutoConfig": "configuration_acme.AcmeConfig",
    "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM",
}


def _plan(args: list[str], cli) -> dict:
    code, out, err = cli(["build", *args, "--dry-run", "--json"])
    assert code == 0, err
    return json.loads(out)


def test_published_pairs_do_not_trust_remote_code(cli) -> None:
    plan = _plan(["--target", "gpt-oss-120b", "--gpu", "b200", "--tp", "8"], cli)
    assert "trust_remote_code" not in plan["llm_api"]
    (note,) = [n for n in plan["notes"] if "trust_remote_code" in n]
    # the z-lab drafter maps AutoModel to dflash.DFlashDraftModel; its model type is qwen3
    assert "not set" in note and "drafter z-lab/gpt-oss-120b-DFlash (model_type='qwen3')" in note


def _custom_target(tmp_path, auto_map: dict, model_type: str):
    tdir, ddir = _pair_dirs(tmp_path)
    cfg = json.loads((tdir / "config.json").read_text())
    cfg.update(auto_map=auto_map, model_type=model_type)
    (tdir / "config.json").write_text(json.dumps(cfg))
    return tdir, ddir


def test_a_model_type_transformers_lacks_needs_its_code_and_the_flag_refuses_it(tmp_path, cli) -> None:
    tdir, ddir = _custom_target(tmp_path, CUSTOM, "acme_lm")
    args = ["--target", str(tdir), "--drafter", str(ddir), "--backend", "trtllm", "--gpu", "h100"]
    plan = _plan(args, cli)
    assert plan["llm_api"]["trust_remote_code"] is True
    (note,) = [n for n in plan["notes"] if "trust_remote_code" in n]
    assert f"target {tdir.resolve()}: config.json maps AutoConfig -> configuration_acme.AcmeConfig" in note
    assert (
        "and model_type='acme_lm' is not one transformers ships" in note
        and "--no-remote-code refuses this" in note
    )
    assert "AutoModelForCausalLM" not in note  # TensorRT-LLM builds the model with its own classes

    code, out, err = cli(["build", *args, "--no-remote-code", "--dry-run"])
    assert code == 2 and out == "", err
    assert err.startswith("error: --no-remote-code: target ") and "fix: review that code" in err
    assert len(err.strip().splitlines()) == 1


def test_an_auto_map_on_a_native_model_type_is_not_trusted(tmp_path, cli) -> None:
    tdir, ddir = _custom_target(tmp_path, CUSTOM, "qwen3")
    args = ["--target", str(tdir), "--drafter", str(ddir), "--backend", "trtllm", "--gpu", "h100"]
    plan = _plan([*args, "--no-remote-code"], cli)
    assert "trust_remote_code" not in plan["llm_api"] and plan["inputs"]["no_remote_code"] is True
    (note,) = [n for n in plan["notes"] if "trust_remote_code" in n]
    assert f"target {tdir.resolve()} (model_type='qwen3')" in note


def test_without_transformers_a_code_mapping_is_trusted_and_said_so() -> None:
    from dflash_trt.builder.remote_code import _needs

    cfg = {"model_type": "qwen3", "auto_map": {"AutoConfig": "c.C", "AutoModel": "m.M"}}
    reason = _needs("target", "org/repo", cfg, None)
    assert reason == ("target org/repo: config.json maps AutoConfig -> c.C to the repository's code and "
                      "transformers is not installed to tell whether model_type='qwen3' is one it ships")  # fmt: skip
    assert _needs("target", "org/repo", cfg, frozenset({"qwen3"})) is None
    assert (
        _needs("drafter", "org/d", {"model_type": "x", "auto_map": {"AutoModel": "m.M"}}, frozenset()) is None
    )


def test_planning_a_published_pair_imports_neither_torch_nor_transformers() -> None:
    """No config of the pair maps code, so transformers' model types are not needed: `build --dry-run`
    stays a sub-second command (importing transformers pulled torch in: 4-5 s on a 2-core CPU)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\nfrom dflash_trt.cli import main\n"
        "try:\n    main(['build', '--target', 'gpt-oss-120b', '--gpu', 'h200', '--tp', '8', '--dry-run', '--json'])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED []"
