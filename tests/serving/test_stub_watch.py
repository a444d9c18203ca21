# SPDX-License-Identifier: Apache-2.0
"""How serve finds the Python-backend stubs it watches, on real processes: a child named as the stub
is found alive with its model.py, and once killed (unreaped, as Triton leaves it) as dead, also when
it died before anyone took the list of live stubs (the race a fast client can win after ready)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest

from dflash_trt.triton.server import STUB_PROGRAM, TritonServer, scan_stubs
from tests.serving.conftest import eventually


@pytest.fixture
def fake_stub(tmp_path):
    """Start `sleep` under the stub's program name, as a child of this process; kill it at the end."""
    prog = tmp_path / STUB_PROGRAM
    prog.symlink_to(shutil.which("sleep"))
    procs = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen([str(prog), "600"]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0] == b"Z"


def test_scan_finds_a_live_stub_then_its_zombie(fake_stub):
    stub = fake_stub()
    other = subprocess.Popen(["sleep", "600"])  # a child that is not a stub
    try:
        eventually(lambda: stub.pid in scan_stubs(os.getpid())[0], "the stub exec'd")
        alive, zombies = scan_stubs(os.getpid())
        assert alive == {stub.pid: "600"} and not zombies  # pid -> its first argument (model.py for Triton)
        os.kill(stub.pid, signal.SIGKILL)
        os.kill(other.pid, signal.SIGKILL)
        eventually(lambda: _zombie(stub.pid) and _zombie(other.pid), "both are zombies")
        assert scan_stubs(os.getpid()) == ({}, {stub.pid})  # the other zombie is not a stub
    finally:
        other.kill()
        other.wait()


def test_dead_stubs_with_and_without_a_look_before_the_death(tmp_path, fake_stub):
    server = TritonServer(tmp_path, proc=SimpleNamespace(pid=os.getpid()))  # type: ignore[arg-type]
    seen, unseen = fake_stub(), fake_stub()
    eventually(lambda: {seen.pid, unseen.pid} <= set(scan_stubs(os.getpid())[0]), "both stubs exec'd")
    server.stub_pids = {seen.pid: "model.py"}  # as if watch_stubs() ran before `unseen` started
    assert server.dead_stubs() == {}
    os.kill(seen.pid, signal.SIGKILL)
    os.kill(unseen.pid, signal.SIGKILL)
    eventually(lambda: _zombie(seen.pid) and _zombie(unseen.pid), "both are zombies")
    assert server.dead_stubs() == {seen.pid: "model.py", unseen.pid: "model.py unknown"}
    seen.wait()  # reaped: no zombie left, but it was remembered, so still dead
    assert server.dead_stubs() == {seen.pid: "model.py", unseen.pid: "model.py unknown"}
