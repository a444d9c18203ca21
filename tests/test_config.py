# SPDX-License-Identifier: Apache-2.0
"""Drafter config parsing: every variant of dflash-algorithm.md §2.1, and field-named errors."""

from __future__ import annotations

import re

import pytest

from dflash_trt.errors import ConfigError, IncompatiblePairError
from dflash_trt.models.dflash_config import TargetInfo, parse_dflash_config, validate_pair
from dflash_trt.models.features import build_target_layer_ids

BASE = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}


def cfg(**changes):
    out = {**BASE, "dflash_config": dict(BASE["dflash_config"])}
    for k, v in changes.items():
        if k.startswith("dc_"):
            if v is None:
                out["dflash_config"].pop(k[3:], None)
            else:
                out["dflash_config"][k[3:]] = v
        elif v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(
    ("t", "n", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 5, [1, 8, 15, 22, 29]),
        (48, 5, [1, 12, 23, 34, 45]),
        (64, 5, [1, 16, 31, 46, 61]),
        (30, 5, [1, 8, 14, 20, 27]),  # 7.5 -> 8 and 20.5 -> 20: round half to even
        (36, 1, [18]),
    ],
)
def test_default_layer_ids(t, n, expected):
    assert build_target_layer_ids(t, n) == expected


def test_plain_v1_config():
    c = parse_dflash_config(hf_config=BASE)
    assert c.block_size == 16 and c.max_draft_len == 15
    assert c.mask_token_id == 151669
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    assert c.layer_types == ("full_attention",) * 5
    assert c.sliding_window is None and not c.attention_bias
    assert c.rope.rope_type == "default" and c.rope.theta == 10000.0
    assert all(not c.layer_is_causal(i) for i in range(5))
    assert c.to_log_dict()["max_draft_len"] == 15


def test_block_size_nested_and_top_level():
    assert parse_dflash_config(hf_config=cfg(block_size=None, dc_block_size=8)).block_size == 8
    assert parse_dflash_config(hf_config=cfg(block_size=10, dc_block_size=10)).block_size == 10
    with pytest.raises(ConfigError, match=r"block_size=.*different values"):
        parse_dflash_config(hf_config=cfg(block_size=16, dc_block_size=8))


@pytest.mark.parametrize("bad", [1, 0, -3, "16", 2.5])
def test_block_size_below_two_or_not_int(bad):
    with pytest.raises(ConfigError, match=r"block_size=.*must be an integer >= 2"):
        parse_dflash_config(hf_config=cfg(block_size=bad))


def test_layer_ids_derived_from_num_target_layers():
    c = parse_dflash_config(hf_config=cfg(dc_target_layer_ids=None, num_target_layers=30))
    assert c.target_layer_ids == (1, 8, 14, 20, 27)
    with pytest.raises(ConfigError, match=r"target_layer_ids=None: missing"):
        parse_dflash_config(hf_config=cfg(dc_target_layer_ids=None, num_target_layers=None))


def test_layer_ids_top_level_and_k_neq_l():
    c = parse_dflash_config(
        hf_config=cfg(
            dc_target_layer_ids=None, target_layer_ids=[1, 5, 9, 13, 17, 21, 25, 29], num_target_layers=32
        )
    )
    assert c.num_target_features == 8 and c.num_hidden_layers == 5


def test_layer_id_beyond_num_target_layers():
    with pytest.raises(ConfigError, match=re.escape("dflash_config.target_layer_ids[4]=36: out of range")):
        parse_dflash_config(hf_config=cfg(dc_target_layer_ids=[1, 9, 17, 25, 36]))


def test_mask_token_missing_and_override():
    with pytest.raises(ConfigError, match=r"mask_token_id=None: missing.*fix: pass the id"):
        parse_dflash_config(hf_config=cfg(dc_mask_token_id=None))
    assert parse_dflash_config(hf_config=cfg(dc_mask_token_id=None), mask_token_id=7).mask_token_id == 7
    assert parse_dflash_config(hf_config=cfg(dc_mask_token_id=None, mask_token_id=9)).mask_token_id == 9


def test_sliding_window_layers():
    c = parse_dflash_config(
        hf_config=cfg(
            layer_types=["sliding_attention"] * 4 + ["full_attention"],
            sliding_window=2048,
            use_sliding_window=True,
        )
    )
    assert c.layer_window(0) == 2048 and c.layer_window(4) is None
    assert c.layer_is_causal(0) and not c.layer_is_causal(4)
    c2 = parse_dflash_config(
        hf_config=cfg(
            layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=64, is_causal=False
        )
    )
    assert not c2.layer_is_causal(0) and c2.layer_window(0) == 64
    with pytest.raises(ConfigError, match=r"sliding_window=None: must be a positive integer"):
        parse_dflash_config(hf_config=cfg(layer_types=["sliding_attention"] * 5))
    with pytest.raises(ConfigError, match=r"layer_types=.*need 5 entries"):
        parse_dflash_config(hf_config=cfg(layer_types=["full_attention"] * 4))


def test_gpt_oss_style_bias_yarn_head_dim():
    c = parse_dflash_config(
        hf_config=cfg(
            hidden_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            attention_bias=True,
            rope_theta=150000,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            block_size=10,
            dc_mask_token_id=200000,
        )
    )
    assert c.attention_bias and c.head_dim == 64 and c.hidden_size == 2880
    assert c.rope.rope_type == "yarn" and c.rope.factor == 32.0 and c.rope.truncate is False
    assert c.rope.original_max_position_embeddings == 4096 and c.rope.theta == 150000.0


def test_transformers5_rope_parameters_and_llama3():
    c = parse_dflash_config(
        hf_config=cfg(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert c.rope.rope_type == "llama3" and c.rope.theta == 500000.0
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type='dynamic': unsupported"):
        parse_dflash_config(hf_config=cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_optional_scales_nested_then_top_level():
    c = parse_dflash_config(
        hf_config=cfg(
            dc_input_embedding_scale=2.0,
            output_multiplier=0.5,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-5,
        )
    )
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert c.rms_norm_eps == 1e-5
    c2 = parse_dflash_config(hf_config=cfg(dc_output_multiplier=0.25, output_multiplier=4.0))
    assert c2.output_multiplier == 0.25


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"architectures": ["EagleDraftModel"]}, r"architectures=.*not a z-lab DFlash drafter"),
        ({"speculators_model_type": "dflash"}, r"speculators checkpoint"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3: must divide num_attention_heads=4"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"hidden_size": None}, r"hidden_size=None: missing"),
        ({"dc_mask_token_id": -1}, r"mask_token_id=-1"),
        ({"rms_norm_eps": "x"}, r"rms_norm_eps='x': must be a finite number"),
    ],
)
def test_config_errors_name_field_and_value(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_dflash_config(hf_config=cfg(**changes))


def test_round_trip_to_hf_config():
    c = parse_dflash_config(
        hf_config=cfg(
            attention_bias=True,
            layer_types=["sliding_attention"] * 4 + ["full_attention"],
            sliding_window=32,
            use_sliding_window=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
            dc_output_multiplier=0.5,
        )
    )
    again = parse_dflash_config(hf_config=c.to_hf_config())
    assert again == c


TARGET = TargetInfo(hidden_size=64, num_hidden_layers=36, vocab_size=151936, architecture="Qwen3ForCausalLM")


@pytest.mark.parametrize(
    ("target", "pattern"),
    [
        (TargetInfo(96, 36, 151936), r"drafter.hidden_size=64: does not match the target's hidden_size=96"),
        (TargetInfo(64, 36, 151000), r"mask_token_id=151669: is not a row of the target's embedding"),
        (
            TargetInfo(64, 30, 151936),
            r"target_layer_ids\[4\]=33: out of range for the target's num_hidden_layers=30",
        ),
    ],
)
def test_incompatible_pairs(target, pattern):
    with pytest.raises(IncompatiblePairError, match=pattern):
        validate_pair(parse_dflash_config(hf_config=BASE), target)


def test_runtime_block_size_bounds():
    c = parse_dflash_config(hf_config=BASE)
    validate_pair(c, TARGET, block_size=8)
    validate_pair(c, TARGET, block_size=1)
    with pytest.raises(ConfigError, match=r"block_size=17: exceeds the drafter's trained block_size=16"):
        validate_pair(c, TARGET, block_size=17)
    with pytest.raises(ConfigError, match=r"block_size=0"):
        validate_pair(c, TARGET, block_size=0)
