# SPDX-License-Identifier: Apache-2.0
"""Target adapters: what the DFlash loop needs from the target model.

`HFTarget` wraps a Hugging Face transformers causal LM (Qwen3, Llama, gpt-oss, ...) for the
batch-1 reference loop: prefill and verify on a croppable `DynamicCache`, with the layer-output
taps at `target_layer_ids` (layer l's output is `hidden_states[l + 1]`). Sliding-window layers
(gpt-oss) can be cropped because past recording keeps the evicted states until `crop`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_trt.errors import CheckpointError
from dflash_trt.models.checkpoint import read_json
from dflash_trt.models.dflash_config import TargetInfo, target_info_from_config
from dflash_trt.models.features import extract_context_feature

log = logging.getLogger(__name__)


class TargetAdapter(Protocol):
    """Batch-1 target interface used by `spec_generate`."""

    info: TargetInfo
    device: torch.device

    def embed_weight(self) -> torch.Tensor: ...  # [V, D]

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # weight [V, D], bias [V] | None

    def reset(self) -> None: ...

    def extend(
        self, token_ids: torch.Tensor, start: int, *, layer_ids: Sequence[int] | None, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [1, T] at positions start.. on top of the cache (which must hold exactly `start`
        tokens). Returns logits [T, V] (or [1, V] with last_only) and features [T, K * D] when
        layer_ids is given."""
        ...

    def crop(self, length: int) -> None: ...

    @property
    def cache_length(self) -> int: ...


class HFTarget:
    """A transformers causal LM as a DFlash target (batch 1)."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        cfg = model.config.to_dict()
        self.info = target_info_from_config(cfg)
        self.info = TargetInfo(
            hidden_size=self.info.hidden_size,
            num_hidden_layers=self.info.num_hidden_layers,
            vocab_size=int(model.get_input_embeddings().weight.shape[0]),
            architecture=self.info.architecture,
        )
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._cache: Any = None
        self.reset()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: torch.device, dtype: torch.dtype) -> HFTarget:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        directory = Path(path)
        read_json(directory / "config.json", what="target config")
        model: Any
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(
                f"cannot load target from {directory}: {str(exc).splitlines()[0]}",
                hint="pass a directory written by transformers save_pretrained",
            ) from exc
        return cls(model.to(device))

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = getattr(self.model, "lm_head", None) or self.model.get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

    def reset(self) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        self._cache.activate_past_recording()

    @property
    def cache_length(self) -> int:
        return int(self._cache.get_seq_length())

    @torch.inference_mode()
    def extend(
        self, token_ids: torch.Tensor, start: int, *, layer_ids: Sequence[int] | None, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cache_length != start:
            raise RuntimeError(f"target cache holds {self.cache_length} tokens, expected {start}")
        t = token_ids.shape[1]
        positions = torch.arange(start, start + t, device=self.device)[None]
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
            output_hidden_states=layer_ids is not None,
            logits_to_keep=1 if last_only else 0,
        )
        feats = None
        if layer_ids is not None:
            feats = extract_context_feature(out.hidden_states, layer_ids)[0]  # [T, K * D]
        return out.logits[0], feats

    def crop(self, length: int) -> None:
        remove = self.cache_length - length
        if remove < 0:
            raise RuntimeError(f"cannot crop a {self.cache_length}-token cache up to {length}")
        self._cache.crop(-remove)
