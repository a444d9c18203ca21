# SPDX-License-Identifier: Apache-2.0
"""How long a cold compile cache takes to fill: every warm-up class of an `LLM`, compiled in the
foreground into a fresh cache, each class timed, then torch's own split of the time (dynamo tracing,
AOT autograd, inductor's lowering, code generation and C++ compiles).

    python bench/cold_compile.py                          # tiny with its drafter
    python bench/cold_compile.py --no-draft               # tiny alone
    python bench/cold_compile.py --cache-dir DIR --keep   # keep the artifacts (a warm start follows)
    python bench/cold_compile.py --workers 1              # one process (default: side by side)
    DFLASH_TRT_KERNEL_UNITS=0 python bench/cold_compile.py  # a g++ run per kernel (engine/kernel_units.py)

With helper processes (engine/precompile.py) the classes they compiled are listed from their log.

It prints its configuration (CPU model and the vector extensions that matter, torch) beside the figures.
The cache is a temporary directory unless --cache-dir names one; inductor's caches go there too, so
nothing compiled earlier in another cache is reused. (Inductor's precompiled headers live in the
system temp directory and are reused: they are built once per machine.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path


class _ClassTimes(logging.Handler):
    """Collects the engine's "compiled round <name> in <s> s" records."""

    PATTERN = re.compile(r"compiled round (\S+) in ([0-9.]+) s")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self.PATTERN.search(record.getMessage())
        if m:
            self.times.append((m.group(1), float(m.group(2))))
            print(f"  {m.group(1):<40} {float(m.group(2)):7.1f} s", flush=True)


def _cpu() -> dict[str, object]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    flags = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), []))  # fmt: skip
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--no-draft", action="store_true", help="the target alone (plain decoding's classes)")
    ap.add_argument("--drafter", help="drafter name or directory (default: the target's name, which names "
                    "tiny's v1 drafter; smollm2-135m's is smollm2-135m-dflash)")  # fmt: skip
    ap.add_argument("--max-batch-size", type=int, default=None, help="the engine's (default: LLM's)")
    ap.add_argument("--cache-dir", help="compile cache root (default: a fresh temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary cache")
    ap.add_argument("--workers", type=int, help="processes that compile side by side (default: the engine's "
                    "choice, one per core that memory allows; engine/precompile.py)")  # fmt: skip
    args = ap.parse_args()

    root = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="dflash-cold-"))
    if args.cache_dir and root.exists() and any(root.iterdir()):
        raise SystemExit(f"--cache-dir {root}: not empty; a cold compile needs an empty directory")
    os.environ["DFLASH_TRT_COMPILE_CACHE"] = str(root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["DFLASH_TRT_COMPILE_BACKGROUND"] = "0"  # compile before ready, from this process
    from dflash_trt.utils.child import limit_openmp_spin

    limit_openmp_spin()  # as `dflash-trt precompile` runs (before torch loads libgomp)
    if args.workers is not None:
        os.environ["DFLASH_TRT_COMPILE_WORKERS"] = str(args.workers)

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    from dflash_trt.api.llm import LLM

    handler = _ClassTimes()
    logging.getLogger("dflash_trt.engine.compile").addHandler(handler)
    logging.getLogger("dflash_trt.engine.compile").setLevel(logging.INFO)
    drafter = None if args.no_draft else (args.drafter or args.target)
    spec = (
        None
        if drafter is None
        else {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": drafter}
    )
    config = {"target": args.target, "drafter": drafter, "max_batch_size": args.max_batch_size,
              "workers": os.environ.get("DFLASH_TRT_COMPILE_WORKERS", "auto"),
              "kernel_units": os.environ.get("DFLASH_TRT_KERNEL_UNITS", "1") != "0",
              "torch": torch.__version__, "python": platform.python_version(),
              **_cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    print("# cold compile:", json.dumps(config), flush=True)
    extra = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    t0 = time.perf_counter()
    llm = LLM(args.target, speculative_config=spec, **extra)
    ready = time.perf_counter() - t0
    llm.shutdown()
    for log_path in sorted(root.rglob("precompile.log")):  # the helpers' classes
        for name, seconds in _ClassTimes.PATTERN.findall(log_path.read_text()):
            print(f"  {name:<40} {float(seconds):7.1f} s  (helper)")
    total = sum(s for _, s in handler.times)
    print(
        f"classes compiled in this process: {len(handler.times)}, {total:.1f} s; LLM ready after {ready:.1f} s"
    )
    keep = ("bytecode_tracing", "aot_collect_metadata", "GraphLowering.run", "Scheduler.__init__",
            "Scheduler.codegen", "compile_file", "async_compile.wait", "PyCodeCache.load_by_key_path")  # fmt: skip
    phases = {k: sum(compilation_time_metrics[k]) for k in keep if k in compilation_time_metrics}
    print("torch's split (s, this process's classes; nested phases overlap):",
          ", ".join(f"{k} {s:.1f}" for k, s in phases.items()))  # fmt: skip
    if not args.cache_dir and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"cache kept: {root}")


if __name__ == "__main__":
    main()
