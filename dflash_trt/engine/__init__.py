# SPDX-License-Identifier: Apache-2.0
"""The embedded pure-PyTorch DFlash engine: drafter, target adapters, verification, loops."""
