# SPDX-License-Identifier: Apache-2.0
"""Building blocks with no model knowledge: RMSNorm, the gated MLP, rotary embeddings, the
attention visibility rule and the paged KV cache. Imports nothing else from dflash_trt but errors."""
