# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds (engine/compile.py, engine/precompile.py): equal to eager rounds, saved per shape
class and loaded by the next start, compiled in a background process while a cold engine serves
eagerly and picked up as each class lands. Guards, the compile lock and `dflash-trt precompile` are in
test_precompile.py (a file of their own, so that the two test workers share the compilation time)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine import compile as compile_mod
from dflash_trt.engine import precompile, vec_isa
from tests.engine.conftest import PROMPTS, SP, small_llm, tokens

CLASSES = 10  # the warm-up's shape classes of the small pair (conftest.py), the two prefill classes included


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
    small_pair, tmp_path, monkeypatch, untrusted_isa
) -> None:
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    with small_llm(small_pair, tmp_path, compile=False) as eager:
        want = tokens(eager)

    # 1. A cold cache, background compiling off: every warm-up class compiled here, then saved.
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, "0")
    with small_llm(small_pair, tmp_path) as llm:
        rounds = llm.engine.executor.rounds
        assert (rounds.loaded, rounds.compiled) == (0, CLASSES) == (0, len(llm.engine.warm_up_classes()))
        assert llm.drain_round_times() == []  # warm-up rounds are not reported as traffic
        cold_rounds = llm._rounds_seen[0]
        assert tokens(llm) == want
        alone = llm.generate(PROMPTS[1], SP).outputs[0].token_ids
        # prompts of other lengths than the warm-up's, alone and batched: no compiled prefill refused them
        assert not rounds._refused and {k[0] for k in rounds._fns} == {compile_mod.ROUND, compile_mod.PREFILL}
        # a class the warm-up did not compile (top-k filtering) runs eagerly: serving never stalls
        filtered = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=1))
        assert all(len(o.outputs[0].token_ids) == 20 for o in filtered)
        assert rounds.compiled == CLASSES
        directory = rounds.directory
    assert alone == want[1]
    saved = sorted(p.name for p in directory.glob(f"*{compile_mod.ARTIFACT_SUFFIX}"))
    assert len(saved) == CLASSES, saved
    isa_record = directory.parents[1] / vec_isa.RECORD_NAME  # the machine's directory
    assert (
        vec_isa.candidates() is None or json.loads(isa_record.read_text())["passed"] == vec_isa.candidates()
    )

    # 2. The next start loads them (seconds, no tracing), runs one round per warm-up batch, and gives
    #    the same tokens.
    monkeypatch.delenv(compile_mod.BACKGROUND_ENV)
    with small_llm(small_pair, tmp_path) as again:
        assert (again.engine.executor.rounds.loaded, again.engine.executor.rounds.compiled) == (CLASSES, 0)
        # every class was saved: each warm-up batch stopped after its first round
        assert again._rounds_seen[0] == again.engine.warm_up_size() < cold_rounds
        assert again._precompiler is None  # nothing to compile: no child
        assert tokens(again) == want
        request = again._precompile_request(again.engine)

    # The real background compiler, for the same engine: it builds it, finds every class on disk,
    # compiles nothing and exits 0 (the same fingerprint as its parent's).
    req_file = tmp_path / "request.json"
    req_file.write_text(json.dumps(dataclasses.asdict(request)))
    child = subprocess.run(
        [sys.executable, "-m", "dflash_trt.engine.precompile", str(req_file)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr
    assert f"0 compiled, {CLASSES} already there" in child.stdout + child.stderr
    # ... without inductor's ISA probe: its parent's record says it passed on this machine
    assert vec_isa.candidates() is None or "ISA probe skipped" in child.stdout + child.stderr

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
        rounds = cold.engine.executor.rounds
        assert len(children) == 1 and (rounds.loaded, rounds.compiled) == (0, 0)
        assert tokens(cold) == want  # eager meanwhile
        children[0].finish()
        assert tokens(cold) == want  # the rounds of these batches now run compiled
        greedy = [k for k in rounds._fns if k[0] == compile_mod.ROUND and dict(k[1])["flags"][0]]
        assert rounds.loaded == CLASSES and greedy, rounds._fns
        assert rounds.compiled == 0  # nothing was compiled in the serving process


@pytest.mark.slow
def test_a_bfloat16_compiled_prefill_serves_prompts_of_every_length(
    small_pair, tmp_path, monkeypatch
) -> None:
    """The prefill is compiled at warm-up on a 2-token prompt. In bfloat16 on CPU the attention of a
    few query rows takes another path than a long chunk's: were that choice made on the chunk's length
    inside the prefill, the graph would refuse every prompt of more than 32 tokens and serve eagerly from
    then on (and drop its saved artifact)."""
    monkeypatch.setenv(compile_mod.COMPILE_ENV, "1")
    monkeypatch.setenv(compile_mod.BACKGROUND_ENV, "0")
    tdir, _ = small_pair
    prompts = [[(7 * i + n) % 30 + 3 for i in range(n)] for n in (1, 40, 100, 5)]
    with LLM(str(tdir), compile_cache=str(tmp_path), max_batch_size=1, dtype="bfloat16") as llm:
        rounds = llm.engine.executor.rounds
        outs = [llm.generate(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts]
        assert [len(o.outputs[0].token_ids) for o in outs] == [3] * len(prompts)
        assert not rounds._refused
        assert sum(k[0] == compile_mod.PREFILL for k in rounds._fns) == 1, rounds._fns
