# SPDX-License-Identifier: Apache-2.0
"""Experiment harness (2026-12-07, not a maintained benchmark): a saved compiled round's call timed in three parts
(binding the arguments for the guards, the guard manager's check, the compiled code), medians per round over one
128-token greedy generate at batch 1 after a warm-up generate. Wraps torch's private AOTCompiledFunction.__call__.

    GOMP_SPINCOUNT=1000 .venv/bin/python time_guards.py smollm2-135m
    DFLASH_TRT_COMPILE_BACKGROUND=0 GOMP_SPINCOUNT=1000 .venv/bin/python time_guards.py tiny
"""

import statistics
import sys
import time
from typing import Any

import torch._dynamo.aot_compile as aot

from dflash_trt import LLM
from dflash_trt.api.llm import SamplingParams

PROMPTS = {"tiny": "def fibonacci(n):"}
NS: dict[str, list[int]] = {"bind": [], "guard": [], "call": []}


def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter_ns()
    f_locals = self.prepare_f_locals(*args, **kwargs)
    t1 = time.perf_counter_ns()
    ok = self._artifacts.guard_manager.check(f_locals)
    t2 = time.perf_counter_ns()
    if not ok:
        raise RuntimeError("GuardManager check failed")
    out = self.fn(*args, **kwargs)
    NS["bind"].append(t1 - t0)
    NS["guard"].append(t2 - t1)
    NS["call"].append(time.perf_counter_ns() - t2)
    return out


def main() -> None:
    target = sys.argv[1]
    aot.AOTCompiledFunction.__call__ = timed_call  # type: ignore[method-assign]
    llm = LLM(target)
    prompt = PROMPTS.get(target, "Write a short story about a robot who learns to paint.")
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate([prompt], params)
    for values in NS.values():
        values.clear()
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    print(f"{target}: {128 / (time.perf_counter() - t0):.1f} tok/s, {len(NS['call'])} compiled rounds")
    for part, values in NS.items():
        print(f"  {part}: median {statistics.median(values) / 1e3:.1f} us")
    llm.shutdown()


if __name__ == "__main__":
    main()
