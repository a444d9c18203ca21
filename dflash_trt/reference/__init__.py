# SPDX-License-Identifier: Apache-2.0
"""The batch-1 reference DFlash loop on a transformers target: the oracle the engine is tested against."""
