# SPDX-License-Identifier: Apache-2.0
"""An OpenAI-compatible HTTP front (`/v1/models`, `/v1/completions`, `/v1/chat/completions`)
that forwards every request to the Triton model over gRPC streaming.

Layering: above `dflash_trt.triton` (it talks to a running tritonserver as any client would) and
beside `bench`/`deploy`; it never imports the engine, the models or the LLM API. Modules:

- `protocol`: OpenAI request bodies -> one `Generation` (validated; errors name the field);
  response and chunk bodies; the error JSON shape;
- `chat`: the bundle tokenizer's chat template (and the prompt length it gives);
- `tool_prompt`: tools for templates without a tool convention (the system message, Hermes blocks);
- `parsers`: model text -> content, reasoning_content and tool_calls (whole and streamed), and the
  guides that force a tool call;
- `upstream`: the Triton side (tritonclient's aio gRPC client, one stream per request);
- `app`: the aiohttp application, SSE, disconnects; `FrontConfig` and `run_front` for the CLI.
"""
