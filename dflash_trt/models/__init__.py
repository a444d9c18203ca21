# SPDX-License-Identifier: Apache-2.0
"""The models: the DFlash drafter and the native targets, their configs and their weights.

- `drafter.py`, `dflash_config.py`, `checkpoint.py`: the z-lab DFlash drafter, its config (one
  pure parsing function) and checkpoint I/O;
- `decoder.py`, `target_config.py`, `loader.py`: native Llama/Mistral/Qwen2/Qwen3/gpt-oss targets
  that run ragged batches on the paged KV cache of `dflash_trt.layers.kv_cache` and return the
  layer-output taps DFlash conditions on;
- `dequant.py` (FP8/NVFP4/MXFP4 weights), `features.py` (which layers feed the drafter),
  `sources.py` (names and directories to files, tokenizer, stop ids).
The reference loop uses transformers itself (`reference/hf_target.py`); tests pin the two together.
"""

from dflash_trt.models.target_config import SUPPORTED_MODEL_TYPES, TargetConfig, parse_target_config

__all__ = ["SUPPORTED_MODEL_TYPES", "TargetConfig", "parse_target_config"]
