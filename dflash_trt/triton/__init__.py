# SPDX-License-Identifier: Apache-2.0
"""Triton Inference Server: the model repository renderer and the `tritonserver` launcher."""
