# SPDX-License-Identifier: Apache-2.0
"""Local ports and process CPU time for the benchmark scripts in this folder that start servers (they
import it by name: a script's own folder is first on its path)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS had free a moment ago (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
