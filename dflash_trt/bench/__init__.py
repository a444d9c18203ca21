# SPDX-License-Identifier: Apache-2.0
"""`dflash_trt.bench`: the throughput-vs-interactivity sweep harness.

Modules (import the one you need; nothing heavy is imported here):

- `workload`: prompts with exact input token counts (synthetic, JSONL, chat-templated).
- `clients`: one asyncio client per protocol (Triton HTTP/gRPC, OpenAI completions/chat).
- `metrics`: per-request records and per-point statistics, with the formula of every metric.
- `sweep`: closed-loop concurrency and open-loop Poisson sweeps, resumable point by point.
- `pareto`, `compare`, `plot`: frontiers, A/B comparison at matched interactivity, charts.
- `scripted_server`: a protocol peer with an exact, known schedule (tests, client overhead).
"""

from __future__ import annotations
