# SPDX-License-Identifier: Apache-2.0
"""The API-key rules (dflash_trt/utils/api_key.py) and the CLI options that resolve them. The real
servers are exercised in tests/serving/test_api_key.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_trt.errors import UsageError
from dflash_trt.utils.api_key import ENV_VAR, ApiKey, check_key, resolve_api_key

KEY = "s3cret-" + "x" * 20


def test_precedence_flag_then_file_then_env(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text(f"  {KEY}-file\n")
    env = {ENV_VAR: KEY + "-env"}
    assert resolve_api_key(flag=KEY, file=None, env=env) == ApiKey(KEY, "--api-key")
    assert resolve_api_key(flag=None, file=f, env=env) == ApiKey(KEY + "-file", f"--api-key-file={f}")
    assert resolve_api_key(flag=None, file=None, env=env) == ApiKey(KEY + "-env", f"${ENV_VAR}")
    assert resolve_api_key(flag=None, file=None, env={}) is None
    assert resolve_api_key(flag=None, file=None, env={ENV_VAR: ""}) is None
    with pytest.raises(UsageError, match="--api-key and --api-key-file are both set"):
        resolve_api_key(flag=KEY, file=f, env={})


@pytest.mark.parametrize(
    ("secret", "problem"),
    [
        ("short", "5 characters, fewer than 16"),
        ("with space " + "x" * 20, "0x20"),
        ("tab\t" + "x" * 20, "0x09"),
        ("ünïcode-" + "x" * 20, "0xfc"),
        ("x" * 5000, "more than 4096"),
    ],
)
def test_bad_keys_are_named_by_source_never_shown(secret: str, problem: str) -> None:
    with pytest.raises(UsageError) as info:
        check_key(secret, source="$DFLASH_TRT_API_KEY")
    text = str(info.value)
    assert problem in text and text.startswith("$DFLASH_TRT_API_KEY: ") and "fix: " in text
    assert secret not in text


def test_key_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        resolve_api_key(flag=None, file=tmp_path / "missing", env={})
    two = tmp_path / "two"
    two.write_text(f"{KEY}\n{KEY}\n")
    with pytest.raises(UsageError, match="more than one line"):
        resolve_api_key(flag=None, file=two, env={})


def test_repr_hides_the_key_and_bearer_checks_in_constant_time() -> None:
    key = ApiKey(KEY, "--api-key")
    assert KEY not in repr(key) and KEY not in str(key)
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"bearer {KEY}") and key.accepts(f"  Bearer  {KEY} ")
    for wrong in (
        None,
        "",
        KEY,
        f"Basic {KEY}",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        "Bearer",
        f"Bearer ü{KEY}",
    ):
        assert not key.accepts(wrong), wrong
    assert key.http_headers() == {"Authorization": f"Bearer {KEY}"}
    assert key.grpc_metadata() == (("triton-grpc-protocol-authorization", f"Bearer {KEY}"),)


def test_triton_command_restricts_all_but_health(tmp_path: Path) -> None:
    from dflash_trt.triton.server import PROTECTED_APIS, TritonInstall, TritonServer

    install = TritonInstall(Path("/bin/tritonserver"), None, {}, "PATH")
    keyed = TritonServer(model_repository=tmp_path, api_key=ApiKey(KEY, "--api-key"), install=install)
    cmd = keyed.command()
    groups = ",".join((*PROTECTED_APIS, "model-repository"))  # no admin key without control_dir
    assert f"--http-restricted-api={groups}:authorization=Bearer {KEY}" in cmd
    assert f"--grpc-restricted-protocol={groups}:authorization=Bearer {KEY}" in cmd
    assert "health" not in PROTECTED_APIS and KEY not in repr(keyed)
    controlled = TritonServer(model_repository=tmp_path, api_key=ApiKey(KEY, "--api-key"), install=install,
                              control_dir=tmp_path / "control")  # fmt: skip
    restricted = [c for c in controlled.command() if "restricted" in c]
    assert [c.split("=", 1)[1].split(":", 1)[0] for c in restricted] == ["model-repository"] * 2 + [
        ",".join(PROTECTED_APIS)
    ] * 2
    assert not [
        c for c in TritonServer(model_repository=tmp_path, install=install).command() if "restricted" in c
    ]


def _run(argv: list[str], env: dict[str, str], monkeypatch, capsys) -> tuple[int, str]:
    """`dflash-trt ARGV` in this process, as users run it (errors mapped to exit codes)."""
    from dflash_trt.cli import main

    monkeypatch.delenv(ENV_VAR, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    return int(info.value.code or 0), captured.out + captured.err


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", "short"], {}, "--api-key: the API key has 5 characters"),
        (["--api-key", KEY, "--api-key-file", "/nonexistent"], {}, "both set"),
        (["--api-key-file", "/nonexistent/key"], {}, "--api-key-file=/nonexistent/key: no such file"),
        ([], {ENV_VAR: "has space in it, sixteen+"}, "$DFLASH_TRT_API_KEY: the API key contains"),
    ],
)
def test_serve_and_bench_refuse_bad_keys_with_exit_2(
    tmp_path: Path, monkeypatch, capsys, args, env, message
) -> None:
    code, text = _run(["serve", "--bundle", str(tmp_path), *args], env, monkeypatch, capsys)
    assert code == 2 and message in text and "fix:" in text, text
    code, text = _run(["bench", "sweep", "--url", "127.0.0.1:1", "--out", str(tmp_path / "o"), "--isl", "4",
                       "--osl", "4", "--tokenizer", "x", "--concurrency", "1", *args], env, monkeypatch, capsys)  # fmt: skip
    assert code == 2 and message in text, text


def test_a_sweep_spec_cannot_carry_a_key(tmp_path: Path, monkeypatch, capsys) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"runs:\n  - label: a\n    api_key: {KEY}\n")
    code, text = _run(["bench", "sweep", "--spec", str(spec), "--dry-run"], {}, monkeypatch, capsys)
    assert code == 2 and "api_key" in text and KEY not in text, text
