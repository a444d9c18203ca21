# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding rules: sampling with keyed randomness, greedy and rejection acceptance,
and the LLM-API `DFlashDecodingConfig` (draft length schedule)."""
