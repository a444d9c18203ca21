# SPDX-License-Identifier: Apache-2.0
"""Inductor's ISA probe trusted once it has passed on this machine (engine/vec_isa.py). The compiled
rounds' own test (test_compiled_rounds.py) checks it end to end: a real background compiler trusts the
record its parent wrote and loads every class."""

from __future__ import annotations

import json

import pytest
import torch._inductor.config as inductor_config
from torch._inductor import cpu_vec_isa

from dflash_trt.engine import vec_isa


class FakeIsa:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


@pytest.fixture(autouse=True)
def _untrusted(untrusted_isa: None) -> None:
    """Each test starts with the probe untrusted and nothing recorded (conftest.py)."""


@pytest.fixture
def two_isas(monkeypatch) -> list[str]:
    """A CPU whose candidates are two ISAs that both pass the probe (any host platform)."""
    names = ["avx512", "avx2"]
    monkeypatch.setattr(vec_isa, "candidates", lambda: list(names))
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: [FakeIsa(n) for n in names])
    return names


def test_a_recorded_pass_is_trusted_and_picks_the_same_isa(tmp_path) -> None:
    """The real probe of this machine."""
    probed = str(cpu_vec_isa.pick_vec_isa())
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None  # nothing recorded yet
    vec_isa.record(tmp_path)
    if vec_isa.candidates() is None:  # not x86-64 Linux: such machines always probe, nothing is recorded
        assert not (tmp_path / vec_isa.RECORD_NAME).exists() and not vec_isa.trust(tmp_path)
        return
    assert json.loads((tmp_path / vec_isa.RECORD_NAME).read_text()) == {"passed": vec_isa.candidates()}
    assert vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is True
    assert str(cpu_vec_isa.pick_vec_isa()) == probed


def test_a_failed_candidate_is_never_recorded(tmp_path, two_isas, monkeypatch) -> None:
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: [FakeIsa(two_isas[1])])  # the first failed
    vec_isa.record(tmp_path)
    assert not (tmp_path / vec_isa.RECORD_NAME).exists()
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None


@pytest.mark.parametrize("text", ['{"passed": ["avx2", "something else"]}', "{not json", '["avx2"]', ""])
def test_a_record_of_other_candidates_or_a_damaged_one_is_not_trusted(tmp_path, two_isas, text) -> None:
    (tmp_path / vec_isa.RECORD_NAME).write_text(text)
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None
    vec_isa.record(tmp_path)  # the probe passes here: the record is mended
    assert vec_isa.trust(tmp_path)


def test_the_users_setting_wins(tmp_path, two_isas) -> None:
    (tmp_path / vec_isa.RECORD_NAME).write_text(json.dumps({"passed": two_isas}))
    inductor_config.cpp.vec_isa_ok = False  # TORCHINDUCTOR_VEC_ISA_OK=0
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is False
    other = tmp_path / "other"
    other.mkdir()
    vec_isa.record(other)
    assert not (other / vec_isa.RECORD_NAME).exists()


def test_a_torch_without_inductors_isa_names_keeps_probing(tmp_path, monkeypatch) -> None:
    monkeypatch.delattr(cpu_vec_isa, "x86_isa_checker")
    assert vec_isa.candidates() is None
    (tmp_path / vec_isa.RECORD_NAME).write_text(json.dumps({"passed": ["avx2"]}))
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None
