# SPDX-License-Identifier: Apache-2.0
"""`dflash_trt.bench`: the throughput-vs-interactivity sweep harness.

Modules (import the one you need; nothing heavy is imported here):

- `workload`: prompts with exact input token counts (synthetic, JSONL, chat-templated).
- `clients`: one asyncio client per protocol (Triton HTTP/gRPC, OpenAI completions/chat).
- `metrics`: per-request records and per-point statistics, with the formula of every metric.
- `sweep`: closed-loop concurrency and open-loop Poisson sweeps, resumable point by point.
- `pareto`, `compare`, `plot`: frontiers, A/B comparison at matched interactivity, charts.
- `engine_bench`: the offline embedded-engine benchmark (plain decoding vs DFlash across batch sizes).
(The scripted protocol peer used by tests and `bench/client_overhead.py` is a test double: `tests/bench/scripted_server.py`.)
"""

from __future__ import annotations
