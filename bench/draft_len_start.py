# SPDX-License-Identifier: Apache-2.0
"""What the automatic draft length costs at start-up: compiled rounds of `tiny` with the block pinned
(4 shape classes) and with the draft length chosen by load (16 classes since batch 1 chooses too; 10
before 2026-12-06), cold then warm.

Each engine is built with compile=True and the compilation in the foreground, in this order: pinned,
automatic, pinned, automatic, all on one compile cache (--cache-dir; default: a new temporary one, so
the first two are cold). The automatic engine shares the pinned one's full-block classes, so its
cold figure is the extra classes only. Prints the configuration, then one line per engine:
seconds until LLM() returned, classes loaded from the cache, classes compiled.

    python bench/draft_len_start.py
    python bench/draft_len_start.py --cache-dir /path/to/cache   # warm from a previous run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache-dir", default=None, help="compile cache root (default: a new temporary directory)"
    )
    p.add_argument("--max-batch-size", type=int, default=16)
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="dflash-draft-len-start-")
    os.environ["DFLASH_TRT_COMPILE_CACHE"] = cache
    os.environ["DFLASH_TRT_COMPILE_BACKGROUND"] = "0"  # compile before LLM() returns: what is timed
    import torch

    from dflash_trt import LLM
    from dflash_trt.tiny import ensure_tiny

    pair = ensure_tiny()
    print("# config: " + json.dumps({"target": "tiny", "max_batch_size": args.max_batch_size, "cache": cache,
                                     "torch": torch.__version__, "python": platform.python_version(),
                                     "cpu": platform.processor() or platform.machine()}), flush=True)  # fmt: skip
    for name, extra in (("pinned", True), ("auto", False), ("pinned", True), ("auto", False)):
        spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": str(pair.drafter)}
        if extra:
            spec["max_concurrency"] = args.max_batch_size  # the full block at every batch size
        t0 = time.perf_counter()
        llm = LLM(str(pair.target), speculative_config=spec, max_batch_size=args.max_batch_size,
                  max_num_tokens=2048, max_seq_len=384, compile=True)  # fmt: skip
        ready = time.perf_counter() - t0
        rounds = llm.engine.executor.rounds
        loaded, compiled = (rounds.loaded, rounds.compiled) if rounds is not None else (0, 0)
        print(f"{name:7s} ready {ready:7.1f} s  loaded {loaded:2d}  compiled {compiled:2d}", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
