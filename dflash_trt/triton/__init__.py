# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server: the model repository renderer, our Python-backend model (templates/model.py
and its parts, llmapi/) and the `tritonserver` launcher."""
