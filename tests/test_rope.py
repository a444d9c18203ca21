# SPDX-License-Identifier: Apache-2.0
"""Our rotary tables equal transformers' for every supported rope type."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_trt.layers.rope import RotaryEmbedding, compute_inv_freq
from dflash_trt.layers.rope_config import parse_rope

CASES = {
    "default": {"rope_theta": 1e6},
    "linear": {"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "yarn_gpt_oss": {
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
    },
    "yarn_truncated_mscale": {
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    },
    "yarn_attention_factor": {
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
            "attention_factor": 1.25,
        },
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("head_dim", [64, 12])
def test_inv_freq_matches_transformers(name, head_dim):
    raw = {"hidden_size": 8 * head_dim, "num_attention_heads": 8, "head_dim": head_dim,
           "max_position_embeddings": 131072, **CASES[name]}  # fmt: skip
    hf = Qwen3Config(**raw)
    rope_type = hf.rope_parameters["rope_type"]
    fn = ROPE_INIT_FUNCTIONS[rope_type] if rope_type != "default" else None
    if fn is None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        ref_inv, ref_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref_inv, ref_scale = fn(hf, "cpu")
    ours, scale = compute_inv_freq(parse_rope(raw), head_dim, max_position_embeddings=131072)
    torch.testing.assert_close(ours, ref_inv.float(), rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_cos_sin_match_transformers_rotary_module():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "max_position_embeddings": 131072,
           **CASES["yarn_gpt_oss"]}  # fmt: skip
    hf = Qwen3RotaryEmbedding(Qwen3Config(**raw))
    ours = RotaryEmbedding(parse_rope(raw), 64)
    pos = torch.tensor([[0, 1, 7, 1000, 70000]])
    cos_ref, sin_ref = hf(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = ours(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=1e-6, atol=1e-6)
