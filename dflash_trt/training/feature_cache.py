# SPDX-License-Identifier: Apache-2.0
"""`--feature-cache DIR`: the frozen target's features of each training sample, computed once.

The target is frozen, so the features it gives a sample are the same in every epoch and in every run
on the same target and tapped layers: a DFlash 2 drafter trained after a v1 drafter on the same data
reads what the v1 run wrote. On a CPU the target's forward pass is most of a step (SmolLM2-135M, 8 x 384
tokens: ~6 s of ~9), so a second epoch or a second drafter costs a fraction of the first.

One file per sample, named by a hash of the target's identity (its config and weight files' sizes and
modification times, the tapped layers, the dtype) and of the sample's token ids; written to a
temporary name and renamed, so a crash never leaves a truncated entry. Each entry holds the sample's
features at its own length ([S_i, K * D]) in the target's dtype; a batch pads them with zeros, which no
block reads (context attention stops at a block's anchor, inside the sample).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def target_key(target_dir: Path, layer_ids: Sequence[int], dtype: torch.dtype) -> str:
    """What decides the features, apart from the tokens."""
    files = sorted(p for p in target_dir.iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.dumps({"files": stamp, "layers": list(layer_ids), "dtype": str(dtype)})


class FeatureCache:
    """Per-sample target features on disk (see the module docstring)."""

    def __init__(self, root: Path, key: str) -> None:
        self.root = root
        self.key = key
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def _path(self, ids: Sequence[int]) -> Path:
        h = hashlib.sha256(self.key.encode())
        h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
        return self.root / f"{h.hexdigest()[:32]}.pt"

    def load(self, ids: Sequence[int]) -> torch.Tensor | None:
        path = self._path(ids)
        if not path.is_file():
            return None
        return torch.load(path, weights_only=True)

    def store(self, ids: Sequence[int], feats: torch.Tensor) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".entry.", dir=self.root)
        os.close(fd)
        try:
            torch.save(feats.detach().cpu().clone(), tmp)
            os.replace(tmp, self._path(ids))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def batch(
        self,
        samples: Sequence[Sequence[int]],
        ids: torch.Tensor,  # [bs, S]: the samples padded
        compute: Callable[[torch.Tensor], torch.Tensor],  # [bs, S] -> [bs, S, K * D]
    ) -> torch.Tensor:
        """The batch's features [bs, S, K * D]: from the cache, or computed for the whole batch (and
        stored for its missing samples) when any sample is missing."""
        cached = [self.load(s) for s in samples]
        if any(c is None for c in cached):
            self.misses += sum(c is None for c in cached)
            feats = compute(ids)
            for k, (s, c) in enumerate(zip(samples, cached)):
                if c is None:
                    self.store(s, feats[k, : len(s)])
            return feats
        self.hits += len(samples)
        out = ids.new_zeros((*ids.shape, cached[0].shape[-1]), dtype=cached[0].dtype)  # type: ignore[union-attr]
        for k, c in enumerate(cached):
            assert c is not None
            out[k, : c.shape[0]] = c
        return out.to(ids.device)
