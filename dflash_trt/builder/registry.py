# SPDX-License-Identifier: Apache-2.0
"""Published z-lab DFlash drafters (v1 and DFlash 2) and their targets.

Shapes and layer ids come from the drafters' config.json as read by third parties (see
docs in the repository's shared notes); `build` reads config.json (see builder/configs.py), so a
stale row here can only mislead `dflash-trt models`, never a build. Target ids for the newest families
(Qwen3.5/3.6, Gemma-4, Kimi-K2.5) are marked unverified.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    name: str  # short lowercase name accepted by --target
    target_id: str
    drafter_id: str
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    draft_layers: int
    hidden_size: int
    attention: str  # full | "k SWA(w) + m full"
    drafter_gib: float
    family: str
    notes: str = ""
    verified_ids: bool = True
    architecture: str = "DFlashDraftModel"  # or DFlash2DraftModel (convs + candidate selector)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out


def _e(
    name, target, drafter, b, ids, t, n, d, att, gib, family, notes="", verified=True, arch="DFlashDraftModel"
) -> Entry:
    return Entry(name, target, drafter, b, tuple(ids), t, n, d, att, gib, family, notes, verified, arch)


ENTRIES: tuple[Entry, ...] = (
    _e("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", 10, [1, 9, 17, 25, 33], 36, 8, 2880,
       "full", 1.46, "gpt_oss", "MXFP4 target (~65 GB); q/k/v/o biases and yarn in the drafter; mask id 200000"),
    _e("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", 8, [1, 6, 11, 16, 21], 24, 8, 2880,
       "full", 1.46, "gpt_oss", "MXFP4 target; TensorRT-LLM's DFlash PR tested this pair"),
    _e("qwen3-4b", "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", 16, [1, 9, 17, 25, 33], 36, 5, 2560, "full",
       1.00, "qwen3", "trained without thinking: use enable_thinking=False (tau falls to 2-3 with thinking)"),
    _e("qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", 16, [1, 9, 17, 25, 33], 36, 5, 4096, "full",
       1.95, "qwen3", "trained without thinking: use enable_thinking=False (tau falls to 2-3 with thinking)"),
    _e("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", 10,
       [1, 8, 15, 22, 29], 32, 5, 4096, "full", 1.95, "llama", "gated target on Hugging Face (needs a token)"),
    _e("qwen3-coder-30b-a3b", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", 16,
       [1, 12, 23, 34, 45], 48, 8, 2048, "full", 0.88, "qwen3_moe", "MoE target"),
    _e("qwen3-coder-next", "Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", 16, [3, 11, 23, 35, 43],
       48, 8, 2048, "full", 0.88, "qwen3_next", "hybrid target", verified=False),
    _e("qwen3.5-4b", "Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", 16, [], 32, 6, 2560, "5 SWA(4096) + 1 full",
       1.18, "qwen3_5", "needs thinking mode (collapses without); 8 tapped layers", verified=False),
    _e("qwen3.5-9b", "Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", 16, [], 32, 6, 4096, "5 SWA + 1 full", 2.41,
       "qwen3_5", "needs thinking mode; 8 tapped layers", verified=False),
    _e("qwen3.5-27b", "Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", 16, [], 64, 6, 5120, "5 SWA + 1 full",
       3.96, "qwen3_5", "needs thinking mode; degrades past ~4K context", verified=False),
    _e("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", 16, [], 40, 6, 2048,
       "5 SWA + 1 full", 0.72, "qwen3_5", "needs thinking mode; MoE target", verified=False),
    _e("qwen3.5-122b-a10b", "Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", 16, [], 48, 6, 3072,
       "5 SWA + 1 full", 1.44, "qwen3_5", "needs thinking mode; MoE target", verified=False),
    _e("qwen3.6-27b", "Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", 16, [1, 16, 31, 46, 61], 64, 5, 5120,
       "4 SWA(2048) + 1 full", 3.22, "qwen3_6", "SWA drafter layers trained with windowed context",
       verified=False),
    _e("qwen3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", 16, [], 40, 6, 2048,
       "5 SWA(4096) + 1 full", 0.72, "qwen3_6", "MoE target", verified=False),
    _e("gemma-4-31b-it", "google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", 16, [1, 12, 23, 35, 46, 57], 60,
       5, 5376, "4 SWA(2048) + 1 full", 2.86, "gemma4", "embedding scale: read input_embedding_scale",
       verified=False),
    _e("gemma-4-26b-a4b-it", "google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", 16, [], 30, 5, 2816,
       "4 SWA(2048) + 1 full", 0.80, "gemma4", "MoE target; 6 tapped layers", verified=False),
    _e("kimi-k2.5", "moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", 8, [], 61, 6, 7168, "full", 6.48, "kimi",
       "1T-parameter MoE target (multi-node); 6 tapped layers", verified=False),
    # DFlash 2 (DFlash2DraftModel). Their targets are hybrid or MoE architectures the embedded engine has no
    # native model for, and TensorRT-LLM has only an RFC for DFlash 2: `build` refuses them by name.
    _e("qwen3.8-27b", "Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", 8, [1, 16, 31, 46, 61], 64, 5, 5120,
       "5 SWA(2048)", 3.58, "qwen3_5", "DFlash 2 (R 256, top-16); hybrid Gated-DeltaNet VL target (qwen3_5); "
       "incoai/Qwen3.8-27B-DFlash2 is the same drafter; vocab 248320", verified=False, arch="DFlash2DraftModel"),
    _e("glm-5.3-flash", "zai-org/GLM-5.3-Flash", "incoai/GLM-5.3-Flash-DFlash2", 8, [], 0, 8, 4096, "full", 0.0,
       "glm", "DFlash 2 with 9 taps; MoE target; third-party retrains exist", verified=False,
       arch="DFlash2DraftModel"),
    _e("beam-1.0", "reflection/Beam-1.0-501B-A23B", "reflection/Beam-1.0-501B-A23B-DFlash2", 8, [], 0, 5, 5120,
       "5 SWA(4096)", 0.0, "beam", "DFlash 2 trained at block 16, served at 8; MoE target (bf16, FP8, NVFP4)",
       verified=False, arch="DFlash2DraftModel"),
)  # fmt: skip

_BY_NAME = {e.name: e for e in ENTRIES}
_BY_ID = {e.target_id.lower(): e for e in ENTRIES}


def lookup(name: str) -> Entry | None:
    """Short name (case-insensitive) or target HF id. An unknown `org/name` id is accepted as a
    target without a registered drafter."""
    key = name.lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    if key in _BY_ID:
        return _BY_ID[key]
    if "/" in name and len(name.split("/")) == 2 and all(name.split("/")):
        return Entry(
            name.split("/")[1].lower(), name, "", 0, (), 0, 0, 0, "?", 0.0, "?", "unregistered target"
        )
    return None
