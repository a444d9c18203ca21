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

    def extend_tree(
        self,
        token_ids: torch.Tensor,
        start: int,
        depths: torch.Tensor,
        visibility: torch.Tensor,
        *,
        layer_ids: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DDTree verification: run tree nodes [1, T] at positions start + depths [T] on top of the
        cache (which must hold exactly `start` tokens), node i seeing every cached token and the
        nodes j with visibility[i, j] (its ancestors and itself). Returns logits [T, V] and
        features [T, K * D] (when layer_ids is given). Commit with `keep_nodes`."""
        ...

    def keep_nodes(self, start: int, nodes: Sequence[int]) -> None:
        """After `extend_tree`: keep the listed nodes' K/V (in order, root first) at positions
        start.. and drop the other nodes: the cache then holds start + len(nodes) tokens."""
        ...

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
        self._tree_len = 0  # nodes of the last extend_tree, until keep_nodes commits them
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

    @torch.inference_mode()
    def extend_tree(
        self,
        token_ids: torch.Tensor,
        start: int,
        depths: torch.Tensor,
        visibility: torch.Tensor,
        *,
        layer_ids: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cache_length != start:
            raise RuntimeError(f"target cache holds {self.cache_length} tokens, expected {start}")
        self._check_tree_layers()
        positions = (start + depths.to(self.device))[None]  # [1, T]
        masks = {kind: self._tree_mask(kind, start, positions[0], visibility) for kind in self._layer_kinds()}
        mask: Any = masks if len(masks) > 1 else next(iter(masks.values()))
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions,
            attention_mask=mask,
            past_key_values=self._cache,
            use_cache=True,
            output_hidden_states=layer_ids is not None,
        )
        self._tree_len = int(token_ids.shape[1])
        feats = None
        if layer_ids is not None:
            feats = extract_context_feature(out.hidden_states, layer_ids)[0]  # [T, K * D]
        return out.logits[0], feats

    def keep_nodes(self, start: int, nodes: Sequence[int]) -> None:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        t, self._tree_len = self._tree_len, 0
        if t == 0:
            raise RuntimeError("keep_nodes() must follow extend_tree()")
        picked = torch.tensor(list(nodes), dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            # cached entries before the tree (a window's tail for sliding layers), then the kept nodes
            past = layer.keys.shape[-2] - t
            index = torch.cat([torch.arange(past, device=self.device), past + picked])
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = start + len(nodes)
                layer.crop(0)  # back to the window's last sliding_window - 1 entries
        if self.cache_length != start + len(nodes):
            raise RuntimeError(f"target cache holds {self.cache_length} tokens after a tree commit")

    def _layer_kinds(self) -> list[str]:
        kinds = getattr(self.model.config, "layer_types", None) or ["full_attention"]
        return list(dict.fromkeys(kinds))

    def _check_tree_layers(self) -> None:
        from transformers.cache_utils import DynamicLayer

        for layer in self._cache.layers:
            if not isinstance(layer, DynamicLayer):
                raise RuntimeError(
                    f"DDTree verification supports full and sliding-window attention caches, "
                    f"not {type(layer).__name__}"
                )

    def _tree_mask(
        self, kind: str, start: int, q_pos: torch.Tensor, visibility: torch.Tensor
    ) -> torch.Tensor:
        """Additive float mask [1, 1, T, past + T] for one layer type: cached tokens visible as
        under causal attention (and its window), tree nodes by `visibility` [T, T]."""
        kinds = getattr(self.model.config, "layer_types", None) or ["full_attention"]
        layer = self._cache.layers[kinds.index(kind)]
        past = layer.keys.shape[-2] if layer.is_initialized else 0
        window = getattr(self.model.config, "sliding_window", None) if kind == "sliding_attention" else None
        k_pos = torch.cat([torch.arange(start - past, start, device=self.device), q_pos])  # [past + T]
        seen = torch.cat(
            [torch.ones(len(q_pos), past, dtype=torch.bool, device=self.device), visibility.to(self.device)],
            dim=1,
        )  # [T, past + T]
        if window is not None:
            seen = seen & (q_pos[:, None] - k_pos[None, :] < window)
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill(~seen, torch.finfo(self.dtype).min)[None, None]

    def crop(self, length: int) -> None:
        remove = self.cache_length - length
        if remove < 0:
            raise RuntimeError(f"cannot crop a {self.cache_length}-token cache up to {length}")
        self._cache.crop(-remove)
