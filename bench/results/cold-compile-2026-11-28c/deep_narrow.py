# SPDX-License-Identifier: Apache-2.0
"""The cold compile of a deep, narrow pair: a random Qwen3 target of 36 layers and a DFlash drafter of 5
(hidden 128, float32, the layer counts of Qwen3-8B and its drafter), batch 1 only (3 classes), in one
process, into a fresh cache. Prints the seconds until `LLM` is ready. Run from the tree under test:
    PYTHONPATH=. python bench/results/cold-compile-2026-11-28c/deep_narrow.py
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

PAIR = Path("/tmp/dflash-deep-narrow-pair")


def main() -> None:
    root = tempfile.mkdtemp(prefix="deep-cold-")
    os.environ.update({"DFLASH_TRT_COMPILE_CACHE": root, "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
                       "DFLASH_TRT_COMPILE_BACKGROUND": "0", "DFLASH_TRT_COMPILE_WORKERS": "1"})  # fmt: skip
    from dflash_trt.api.llm import LLM
    from dflash_trt.bench.shapes import Shape, write_pair

    shape = Shape(name="deep-narrow", description="36 + 5 layers of width 128", vocab=512, hidden=128,
                  intermediate=384, layers=36, heads=4, kv_heads=2, head_dim=32, tie_word_embeddings=True,
                  draft_layers=5)  # fmt: skip
    if not (PAIR / "target" / "config.json").exists():
        write_pair(shape, PAIR, dtype="float32")
    log = logging.getLogger("dflash_trt.engine.compile")
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stdout))
    t0 = time.perf_counter()
    spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": str(PAIR / "drafter")}
    llm = LLM(str(PAIR / "target"), speculative_config=spec, max_batch_size=1)
    print(json.dumps({"ready_s": round(time.perf_counter() - t0, 1), "cwd": os.getcwd()}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
