# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds (engine/compile.py, engine/precompile.py): equal to eager rounds, saved per shape
class and loaded by the next start, compiled in a background process while a cold engine serves
eagerly and picked up as each class lands, refused by their guards when sizes differ."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine import compile as compile_mod
from dflash_trt.engine import precompile
from dflash_trt.models.checkpoint import save_drafter
from tests.conftest import make_drafter, make_target

BLOCK = 5
# The warm-up's shape classes for this pair (the default, automatic draft length): the full block at
# batch 1 and the candidate draft lengths 4 and 0 at batch 2+, each greedy and sampled.
CLASSES = 6
BATCH_1_CLASSES = 2  # with max_batch_size=1: the full block, greedy and sampled
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2]]
SP = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """Two target layers and one drafter layer: every shape class compiles in about a minute on 2 cores."""
    root = tmp_path_factory.mktemp("small-pair")
    target = make_target("qwen3", seed=7, vocab=37, layers=2)
    target.save_pretrained(root / "target")
    save_drafter(make_drafter(target, block_size=BLOCK, seed=8, std=0.5), root / "drafter")
    return root / "target", root / "drafter"


def small_llm(pair, cache: Path, **kw) -> LLM:
    tdir, ddir = pair
    spec = {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir)}
    kw.setdefault("max_batch_size", 4)
    return LLM(str(tdir), speculative_config=spec, compile_cache=str(cache), **kw)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


class FakeChild:
    """Stands for the background compiler: `finish()` puts its results in place."""

    def __init__(self, saved: Path, directory: Path) -> None:
        self.saved, self.directory = saved, directory

    def finish(self) -> None:
        for f in self.saved.iterdir():
            shutil.copy(f, self.directory / f.name)

    def poll(self) -> int:
        return 0


@pytest.mark.slow
def test_compiled_rounds_are_saved_reloaded_and_picked_up_from_a_background_compile(
    small_pair, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    with small_llm(small_pair, tmp_path, compile=False) as eager:
        want = tokens(eager)

    # 1. A cold cache, background compiling off: every warm-up class compiled here, then saved.
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, "0")
    with small_llm(small_pair, tmp_path) as llm:
        rounds = llm.engine.runner.rounds
        assert (rounds.loaded, rounds.compiled) == (0, CLASSES) == (0, len(llm.engine.warm_up_classes()))
        assert llm.drain_round_times() == []  # warm-up rounds are not reported as traffic
        assert tokens(llm) == want
        alone = llm.generate(PROMPTS[1], SP).outputs[0].token_ids
        # a class the warm-up did not compile (top-k filtering) runs eagerly: serving never stalls
        filtered = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=1))
        assert all(len(o.outputs[0].token_ids) == 20 for o in filtered)
        assert rounds.compiled == CLASSES
        directory = rounds.directory
    assert alone == want[1]
    saved = sorted(p.name for p in directory.glob(f"*{compile_mod.ARTIFACT_SUFFIX}"))
    assert len(saved) == CLASSES, saved

    # 2. The next start loads them (seconds, no tracing) and gives the same tokens.
    monkeypatch.delenv(compile_mod.BACKGROUND_ENV)
    with small_llm(small_pair, tmp_path) as again:
        assert (again.engine.runner.rounds.loaded, again.engine.runner.rounds.compiled) == (CLASSES, 0)
        assert again._precompiler is None  # nothing to compile: no child
        assert tokens(again) == want
        request = again._precompile_request(again.engine)

    # The real background compiler, for the same engine: it builds it, finds every class on disk,
    # compiles nothing and exits 0 (the same fingerprint as its parent's).
    req_file = tmp_path / "request.json"
    req_file.write_text(__import__("json").dumps(__import__("dataclasses").asdict(request)))
    child = subprocess.run(
        [sys.executable, "-m", "dflash_trt.engine.precompile", str(req_file)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr
    assert f"0 compiled, {CLASSES} already there" in child.stdout + child.stderr

    # 3. A cold cache with background compiling (the default): ready at once, eager rounds, then each
    #    class is loaded as soon as the (stand-in) child puts it on disk, and the tokens never change.
    aside = tmp_path / "aside"
    aside.mkdir()
    for name in saved:
        shutil.move(directory / name, aside / name)
    children: list[FakeChild] = []

    def fake_spawn(request: precompile.PrecompileRequest, where: Path) -> FakeChild:
        assert request.engine["compile"] and request.spec is not None and where == directory
        children.append(FakeChild(aside, where))
        return children[-1]

    monkeypatch.setattr(precompile, "spawn", fake_spawn)
    monkeypatch.setattr(compile_mod, "REFRESH_S", 0.0)
    with small_llm(small_pair, tmp_path) as cold:
        rounds = cold.engine.runner.rounds
        assert len(children) == 1 and (rounds.loaded, rounds.compiled) == (0, 0)
        assert tokens(cold) == want  # eager meanwhile
        children[0].finish()
        assert tokens(cold) == want  # the rounds of these batches now run compiled
        greedy = [k for k in rounds._fns if dict(k[0])["flags"][0]]
        assert rounds.loaded == CLASSES and greedy, rounds._fns
        assert rounds.compiled == 0  # nothing was compiled in the serving process


@pytest.mark.slow
def test_a_compiled_round_made_for_another_engine_is_refused_by_its_guards(
    small_pair, tmp_path, monkeypatch
) -> None:
    """float32 rounds put where a bfloat16 engine looks for its own: their guards refuse every
    round, which then runs eagerly with the bf16 engine's own tokens instead of running wrong code.
    Batch 1 only: two classes to compile, not six."""
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, "0")
    with small_llm(small_pair, tmp_path, max_batch_size=1) as llm:
        source = llm.engine.runner.rounds.directory
        assert llm.engine.runner.rounds.compiled == BATCH_1_CLASSES
    with small_llm(small_pair, tmp_path, max_batch_size=1, compile=False, dtype="bfloat16") as bf16:
        want = tokens(bf16)
        runner = bf16.engine.runner
        runner.compile_dir = str(source.parent.parent)  # the same cache root, another fingerprint
        runner.enable_compile()
        target = runner.rounds.directory
        assert target != source
        shutil.copytree(source, target)
        runner.freeze_compiled()
        assert tokens(bf16) == want
        rounds = runner.rounds
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
    bad = subprocess.run(
        [sys.executable, "-m", "dflash_trt.engine.precompile"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.slow
def test_precompile_fills_the_cache_that_serve_reads(small_pair, tmp_path, monkeypatch) -> None:
    """`dflash-trt precompile` (a pre-warm Job) builds the engine as the bundle's Triton model does and
    compiles every warm-up class into <bundle>/compile-cache; a second run finds all of them there.
    A bundle for batch 1 (two classes to compile, not six)."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    monkeypatch.delenv(compile_mod.CACHE_ENV, raising=False)
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, "1")  # the command itself turns background compiling off
    tdir, ddir = small_pair
    bundle = tmp_path / "bundle"
    args = ["--target", str(tdir), "--drafter", str(ddir), "--max-batch-size", "1", "--output", str(bundle)]
    built = CliRunner().invoke(cli, ["build", *args])
    assert built.exit_code == 0, built.output

    def precompile_cmd(where: Path) -> subprocess.CompletedProcess[str]:
        exe = Path(sys.executable).with_name("dflash-trt")
        return subprocess.run([str(exe), "precompile", "--bundle", str(where)], capture_output=True, text=True,
                              timeout=900)  # fmt: skip

    cold = precompile_cmd(bundle)
    assert cold.returncode == 0, cold.stdout + cold.stderr
    assert f"{BATCH_1_CLASSES} compiled, 0 already cached" in cold.stdout
    saved = list((bundle / compile_mod.BUNDLE_CACHE_DIR).rglob(f"*{compile_mod.ARTIFACT_SUFFIX}"))
    assert len(saved) == BATCH_1_CLASSES, (saved, cold.stdout)
    warm = precompile_cmd(bundle)
    assert warm.returncode == 0 and f"0 compiled, {BATCH_1_CLASSES} already cached" in warm.stdout, (
        warm.stdout + warm.stderr
    )

    missing = precompile_cmd(tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith("error: --bundle="), missing.stderr

    monkeypatch.setattr(compile_mod, "saves_compiled_rounds", lambda: False)  # a torch without aot_compile
    old_torch = CliRunner().invoke(cli, ["precompile", "--bundle", str(bundle)])
    assert old_torch.exit_code == 1 and "cannot save compiled rounds" in old_torch.output, old_torch.output
