# SPDX-License-Identifier: Apache-2.0
"""Stand-in for tensorrt_llm.llmapi (contract tests only)."""

from tensorrt_llm import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]
