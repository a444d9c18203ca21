# SPDX-License-Identifier: Apache-2.0
"""Reproduce bench/results/tiny-cpu/: the sweep spec bench/sweeps/tiny-dflash-vs-ar.yaml against
two real Triton servers of the `tiny` bundle on this CPU, one at a time (DFlash, then the same
bundle with `serve --no-draft`), then the Pareto chart and the comparison.

    .venv/bin/python bench/tiny_cpu_sweep.py [--out bench/results/tiny-cpu] [--threads 1]

Each server runs alone on the machine while it is measured. `--threads` sets OMP_NUM_THREADS
for the server (the engine runs in Triton's Python-backend process): on a model this small
torch's intra-op threads cost more than they save.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "bench" / "sweeps" / "tiny-dflash-vs-ar.yaml"
RUNS = (("DFlash", "dflash", ()), ("AR", "ar", ("--no-draft",)))


def cli(*args: str, env: dict[str, str] | None = None, capture: bool = False) -> str:
    cmd = [sys.executable, "-m", "dflash_trt", *args]
    print("$ dflash-trt " + " ".join(args), flush=True)
    out = subprocess.run(cmd, check=True, cwd=REPO, env=env, text=True, capture_output=capture)
    return out.stdout if capture else ""


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} was not ready after {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tiny-cpu")
    ap.add_argument("--threads", default="1", help="OMP_NUM_THREADS for the server [default: 1]")
    ap.add_argument("--port-base", type=int, default=18100)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": args.threads}
    http, grpc, metrics = args.port_base, args.port_base + 1, args.port_base + 2
    with tempfile.TemporaryDirectory(prefix="dflash-tiny-sweep-") as tmp:
        bundle = Path(tmp) / "tiny"
        cli("build", "--target", "tiny", "--output", str(bundle))
        for label, sub, extra in RUNS:
            serve = [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--quiet",
                     "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), *extra]  # fmt: skip
            print("$ " + " ".join(serve[2:]), flush=True)
            proc = subprocess.Popen(serve, cwd=REPO, env=env)
            try:
                # 1800 s: with DFLASH_TRT_COMPILE_BACKGROUND=0 (bench/readme_figures.py) a cold cache compiles
                # every class before ready, minutes on 2 cores
                waited = wait_ready(f"http://127.0.0.1:{http}", proc, 1800)
                print(f"{label} server ready in {waited:.1f} s", flush=True)
                # --overwrite: the server's weights are not part of the run's fingerprint, so a
                # previous run in the same directory would otherwise be resumed, not remeasured.
                cli("bench", "sweep", "--spec", str(SPEC), "--only", label, "--url", f"127.0.0.1:{grpc}",
                    "--out", str(args.out / sub), "--overwrite")  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(60)
    d, a = str(args.out / "dflash"), str(args.out / "ar")
    for ext in ("png", "html"):
        cli("bench", "plot", d, a, "--out", str(args.out / f"pareto.{ext}"))
    text = cli("bench", "compare", d, a, capture=True)
    (args.out / "compare.txt").write_text(text)
    print(text)
    data = json.loads(cli("bench", "compare", d, a, "--json", capture=True))
    (args.out / "compare.json").write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
