# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM-compatible LLM API (`LLM`, `SamplingParams`) over the embedded engine."""
