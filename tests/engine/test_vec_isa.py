# SPDX-License-Identifier: Apache-2.0
"""Inductor's ISA probe trusted once it has passed on this machine (engine/vec_isa.py). The compiled
rounds' own test (test_compiled_rounds.py) checks it end to end: a real background compiler trusts the
record its parent wrote and loads every class."""

from __future__ import annotations

import json
import platform
import sys

import pytest
import torch._inductor.config as inductor_config
from torch._inductor import cpu_vec_isa

from dflash_trt.engine import vec_isa

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="inductor probes other ISAs elsewhere"
)


@pytest.fixture(autouse=True)
def _untrusted(untrusted_isa: None) -> None:
    """Each test starts with the probe untrusted and nothing recorded (conftest.py)."""


def test_a_recorded_pass_is_trusted_and_picks_the_same_isa(tmp_path) -> None:
    probed = str(cpu_vec_isa.pick_vec_isa())
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None  # nothing recorded yet
    vec_isa.record(tmp_path)
    assert json.loads((tmp_path / vec_isa.RECORD_NAME).read_text()) == {"passed": vec_isa.candidates()}
    assert vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is True
    assert str(cpu_vec_isa.pick_vec_isa()) == probed


def test_a_failed_candidate_is_never_recorded(tmp_path, monkeypatch) -> None:
    wanted = vec_isa.candidates()
    assert wanted, "an x86-64 CPU names at least one vector ISA"
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: [])  # every probe failed
    vec_isa.record(tmp_path)
    assert not (tmp_path / vec_isa.RECORD_NAME).exists()
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None


@pytest.mark.parametrize("text", ['{"passed": ["avx2", "something else"]}', "{not json", '["avx2"]', ""])
def test_a_record_of_other_candidates_or_a_damaged_one_is_not_trusted(tmp_path, text) -> None:
    (tmp_path / vec_isa.RECORD_NAME).write_text(text)
    assert not vec_isa.trust(tmp_path) and inductor_config.cpp.vec_isa_ok is None
    vec_isa.record(tmp_path)  # the probe passes here: the record is mended
    assert vec_isa.trust(tmp_path)


def test_the_users_setting_wins(tmp_path) -> None:
    (tmp_path / vec_isa.RECORD_NAME).write_text(json.dumps({"passed": vec_isa.candidates()}))
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
