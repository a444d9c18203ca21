# SPDX-License-Identifier: Apache-2.0
"""Native target models for the embedded engine: Llama, Mistral, Qwen2, Qwen3 and gpt-oss.

They read Hugging Face checkpoints directly, run ragged batches on the paged KV cache of
`dflash_trt.layers.kv_cache`, and return the layer-output taps DFlash conditions on. The
reference loop uses transformers itself (`engine/target.py`); tests pin the two together.
"""

from dflash_trt.models.target_config import SUPPORTED_MODEL_TYPES, TargetConfig, parse_target_config

__all__ = ["SUPPORTED_MODEL_TYPES", "TargetConfig", "parse_target_config"]
