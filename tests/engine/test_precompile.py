# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds refused by their guards when made for another engine, the compile lock that keeps a
second compiler from starting, and `dflash-trt precompile` filling the cache `serve` reads
(engine/compile.py, engine/precompile.py). The small pair is conftest.py's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.engine import compile as compile_mod
from dflash_trt.engine import precompile
from tests.engine.conftest import BATCH_1_CLASSES, small_llm, tokens


def _precompile(where: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("dflash-trt")
    return subprocess.run([str(exe), "precompile", "--bundle", str(where)], capture_output=True, text=True,
                          timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def precompiled(small_pair, tmp_path_factory):
    """A bundle of the small pair for batch 1 (two classes to compile, not six) and the output of its
    first `dflash-trt precompile`, from a cold cache, by two processes side by side (the command's and
    one helper: engine/precompile.py): the rounds both tests below use."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    tdir, ddir = small_pair
    bundle = tmp_path_factory.mktemp("precompiled") / "bundle"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(compile_mod.COMPILE_ENV, "1")
        mp.delenv(compile_mod.CACHE_ENV, raising=False)
        mp.setenv(compile_mod.BACKGROUND_ENV, "1")  # the command itself turns background compiling off
        mp.setenv(precompile.WORKERS_ENV, "2")  # whatever the machine's cores: one helper
        args = [
            "--target",
            str(tdir),
            "--drafter",
            str(ddir),
            "--max-batch-size",
            "1",
            "--output",
            str(bundle),
        ]
        built = CliRunner().invoke(cli, ["build", *args])
        assert built.exit_code == 0, built.output
        return bundle, _precompile(bundle)


@pytest.mark.slow
def test_a_compiled_round_made_for_another_engine_is_refused_by_its_guards(
    small_pair, precompiled, tmp_path
) -> None:
    """The bundle's compiled rounds (float32 for the batch-1 bundle) put where a bfloat16 engine of
    other sizes looks for its own: their guards refuse every round, which then runs eagerly with the
    bf16 engine's own tokens instead of running wrong code."""
    bundle, cold = precompiled
    assert cold.returncode == 0, cold.stdout + cold.stderr
    saved = sorted((bundle / compile_mod.BUNDLE_CACHE_DIR).rglob(f"*{compile_mod.ARTIFACT_SUFFIX}"))
    assert len(saved) == BATCH_1_CLASSES, saved
    source = saved[0].parent
    with small_llm(small_pair, tmp_path, max_batch_size=1, compile=False, dtype="bfloat16") as bf16:
        want = tokens(bf16)
        executor = bf16.engine.executor
        executor.compile_dir = str(tmp_path / "cache")  # a cache of its own: the bundle's stays as it is
        executor.enable_compile()
        target = executor.rounds.directory
        assert target != source
        shutil.copytree(source, target)
        executor.freeze()
        assert tokens(bf16) == want
        rounds = executor.rounds
        assert rounds.loaded >= 1 and not rounds._fns and rounds._refused  # loaded, refused, dropped


def test_a_held_lock_keeps_a_second_compiler_from_starting(tmp_path) -> None:
    """Two servers of one bundle: the second finds the compile lock taken and waits for the results;
    the child's command line is checked."""
    import fcntl

    directory = tmp_path / "rounds-dir"
    directory.mkdir()
    with open(directory / precompile.LOCK_NAME, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        request = precompile.PrecompileRequest(
            target_dir="unused", drafter_dir=None, spec=None, engine={}, device="cpu", dtype="float32",
            cpu_threads=1, compile_root=str(tmp_path), eos_token_ids=(),
        )  # fmt: skip
        assert precompile.spawn(request, directory) is None  # somebody compiles there already
    for args in ([], ["request.json", "--claims", "../x"], ["request.json", "--claims"]):
        bad = subprocess.run([sys.executable, "-m", "dflash_trt.engine.precompile", *args],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert bad.returncode == 2 and "usage" in bad.stderr, (args, bad.stderr)


def test_a_containers_cgroup_limits_bound_the_compile_workers(tmp_path, monkeypatch) -> None:
    """Inside a pod /proc/meminfo shows the host: the cgroup's memory.max minus memory.current and its
    cpu.max quota bound the helpers instead; "max" (no limit) or no cgroup files leave the machine's."""
    assert precompile._cgroup_cpus(tmp_path) is None  # no cgroup files
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert precompile._cgroup_cpus(tmp_path) == 3
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert precompile._cgroup_cpus(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{4 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{3 * 2**30}\n")
    available, rss = precompile._memory(2**30, tmp_path)
    assert (
        rss == 2**30 and available is not None and available <= 2**30
    )  # the pod's 1 GiB left, not the host's
    (tmp_path / "memory.max").write_text("max\n")
    available, _ = precompile._memory(2**30, tmp_path)
    assert available is None or available > 2**30  # the machine's MemAvailable (None without /proc)


def test_each_warm_up_batch_is_claimed_by_one_process_of_its_session(tmp_path) -> None:
    """Side-by-side compilers split the warm-up by claiming batches: the first claim of a batch wins,
    another session (token) claims independently, and release removes only its own session's files."""
    first, second = precompile.Claims(tmp_path), precompile.Claims(tmp_path)
    helper = precompile.Claims(tmp_path, first.token)  # what a helper started with --claims TOKEN holds
    assert first(0) and not helper(0) and helper(1) and not first(1)
    assert second(0) and second(1)  # a session of its own
    first.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".claim-{second.token}-{n}" for n in (0, 1)]


def test_compile_workers_one_per_core_batch_and_engine_copy_that_memory_holds(monkeypatch) -> None:
    """How many processes compile side by side: the cores, the warm-up's batches and the free memory
    (each helper builds the engine again) bound it; $DFLASH_TRT_COMPILE_WORKERS sets it."""
    from dflash_trt.errors import ConfigError

    monkeypatch.delenv(precompile.WORKERS_ENV, raising=False)
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    monkeypatch.setattr(precompile, "_memory", lambda rss: (10 * 2**30, rss))
    assert precompile.compile_workers(12, rss_bytes=2**20) == 8  # the cores
    assert precompile.compile_workers(3, rss_bytes=2**20) == 3  # the batches
    assert precompile.compile_workers(12, rss_bytes=3 * 2**30) == 3  # itself + two copies in 80 % of 10 GiB
    assert precompile.compile_workers(12, rss_bytes=20 * 2**30) == 1  # no copy fits: no helper
    monkeypatch.setattr(precompile, "_cgroup_cpus", lambda: 3)  # a pod's CPU limit of 2.5 cores
    assert precompile.compile_workers(12, rss_bytes=2**20) == 3
    monkeypatch.setenv(precompile.WORKERS_ENV, "5")
    assert precompile.compile_workers(12) == 5
    assert precompile.compile_workers(2) == 2
    for bad in ("0", "two"):
        monkeypatch.setenv(precompile.WORKERS_ENV, bad)
        with pytest.raises(ConfigError, match=precompile.WORKERS_ENV):
            precompile.compile_workers(12)


@pytest.mark.slow
def test_precompile_fills_the_cache_that_serve_reads(precompiled, tmp_path, monkeypatch) -> None:
    """`dflash-trt precompile` (a pre-warm Job) builds the engine as the bundle's Triton model does and
    compiles every warm-up class into <bundle>/compile-cache; a second run finds all of them there."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    bundle, cold = precompiled
    assert cold.returncode == 0, cold.stdout + cold.stderr
    assert f"{BATCH_1_CLASSES} compiled, 0 already cached" in cold.stdout
    saved = list((bundle / compile_mod.BUNDLE_CACHE_DIR).rglob(f"*{compile_mod.ARTIFACT_SUFFIX}"))
    assert len(saved) == BATCH_1_CLASSES, (saved, cold.stdout)
    # a helper ran beside the command and took the warm-up batches it claimed (maybe none: the command
    # claims the first before the helper has started, and may finish it before the helper claims one)
    helper_log = (saved[0].parent / precompile.LOG_NAME).read_text()
    assert "compiled rounds (a helper): " in helper_log, helper_log
    assert not list(saved[0].parent.glob(".claim-*")), "the session's claims are released"
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    monkeypatch.delenv(compile_mod.CACHE_ENV, raising=False)
    warm = _precompile(bundle)
    assert warm.returncode == 0 and f"0 compiled, {BATCH_1_CLASSES} already cached" in warm.stdout, (
        warm.stdout + warm.stderr
    )

    missing = _precompile(tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith("error: --bundle="), missing.stderr

    monkeypatch.setattr(compile_mod, "saves_compiled_rounds", lambda: False)  # a torch without aot_compile
    old_torch = CliRunner().invoke(cli, ["precompile", "--bundle", str(bundle)])
    assert old_torch.exit_code == 1 and "cannot save compiled rounds" in old_torch.output, old_torch.output


def test_fingerprint_ignores_docstrings_and_comments_but_not_code():
    """An edit to a docstring, a comment or the layout keeps saved rounds valid; a change of code,
    down to one constant, makes the fingerprint of the sources new."""
    base = b'"""Module."""\nimport torch\n\n\ndef f(x):\n    """Doc."""\n    return x * 2  # twice\n'
    same = (b'"""The module, reworded."""\nimport torch\n# a new comment\n\n\n\ndef f(x):\n'
            b'    """Other words."""\n    return x*2\n')  # fmt: skip
    other = base.replace(b"x * 2", b"x * 3")
    digest = compile_mod._code_digest
    assert digest(same) == digest(base)
    assert digest(other) != digest(base)
    assert digest(b"def broken(:\n") != digest(b"def broken( :\n")  # unparsable: byte for byte


def test_shape_rules_set_the_setting_only_inside_and_restore_it_on_errors():
    """The round's shape rule is on inside `shape_rules` only (torch's setting is process-wide), and
    what was there before comes back, also after an exception and when nested."""
    import torch.fx.experimental._config as fx_config

    before = fx_config.backed_size_oblivious
    with compile_mod.shape_rules():
        assert fx_config.backed_size_oblivious is True
        with compile_mod.shape_rules():
            assert fx_config.backed_size_oblivious is True
        assert fx_config.backed_size_oblivious is True
    assert fx_config.backed_size_oblivious == before
    with pytest.raises(KeyError), compile_mod.shape_rules():
        raise KeyError("inside")
    assert fx_config.backed_size_oblivious == before
    with compile_mod.compile_rules():
        assert fx_config.backed_size_oblivious is True and fx_config.use_duck_shape is False
    assert fx_config.backed_size_oblivious == before


def test_a_failed_share_stops_the_helpers_and_releases_the_claims(monkeypatch, tmp_path) -> None:
    """A compile that fails (or is interrupted) in the starting process stops its helpers instead of
    waiting minutes for shares nobody will use, and leaves no claims behind."""
    from types import SimpleNamespace

    class Helper:
        pid, returncode, terminated = 4242, None, False

        def terminate(self) -> None:
            self.terminated = True

        def wait(self) -> int:
            self.returncode = -15 if self.terminated else 0
            return self.returncode

    started = [Helper()]
    monkeypatch.setattr(precompile, "helpers", lambda request, claims, workers: started)
    monkeypatch.setattr(precompile, "compile_workers", lambda batches: 2)

    def warm_up(claim=None) -> float:
        assert claim is not None and claim(0)  # its own first batch, then the compiler fails
        raise RuntimeError("inductor failed")

    rounds = SimpleNamespace(on_disk=lambda keys: False, compiled=0, helped=0)
    engine = SimpleNamespace(executor=SimpleNamespace(rounds=rounds), warm_up_classes=lambda: [("k",)],
                             warm_up_size=lambda: 2, warm_up=warm_up)  # fmt: skip
    with pytest.raises(RuntimeError, match="inductor failed"):
        precompile.warm_up_shared(engine, None, tmp_path)
    assert started[0].terminated and started[0].returncode == -15
    assert not list(tmp_path.glob(".claim-*"))
