# SPDX-License-Identifier: Apache-2.0
"""vLLM's offline `LLM` on token-id prompts: greedy, ignore_eos, a warm-up batch, then timed batches.

Run by bench/engine_floor.py with the python of vLLM's own venv (it imports nothing from this project,
only the standard library and vllm). Reads one job object from stdin and writes one result object
to job["out"] (atomically); vLLM's own logs go to stdout/stderr.

  job      {"model": DIR, "dtype": "bfloat16", "max_model_len": 2048, "prompts": [[ids], ...],
            "batch_sizes": [1, 8], "max_tokens": 128, "warmup_tokens": 16, "repeats": 2, "out": PATH}
  result   {"versions": {...}, "env": {VLLM_* and OMP_* as set}, "startup_s": s,
            "batches": [{"batch": B, "tokens": [per repeat], "seconds": [per repeat],
                         "first_ids": [ids of prompt 0, last repeat]}]}

Each batch size runs its own warm-up call (same prompts, warmup_tokens) before its timed calls.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def main() -> int:
    job = json.load(sys.stdin)
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0)
    startup = time.perf_counter() - t0
    batches = []
    for batch in job["batch_sizes"]:
        prompts = job["prompts"][:batch]
        _run(llm, prompts, job["warmup_tokens"])
        tokens, seconds, first = [], [], []
        for _ in range(job["repeats"]):
            ids, secs = _run(llm, prompts, job["max_tokens"])
            tokens.append(sum(len(x) for x in ids))
            seconds.append(secs)
            first = ids[0]
        batches.append({"batch": batch, "tokens": tokens, "seconds": seconds, "first_ids": first})
        print(f"vllm_offline: batch {batch}: {tokens[-1]} tokens in {seconds[-1]:.2f} s", flush=True)
    result = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))},
        "startup_s": startup,
        "batches": batches,
    }
    out = Path(job["out"])
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(out)
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:  # end the engine-core and worker processes before this one exits
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
