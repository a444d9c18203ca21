# SPDX-License-Identifier: Apache-2.0
"""LLM-API options are honoured or refused with a message naming them, never accepted and ignored."""

from __future__ import annotations

import pytest

from dflash_trt.api.params import CudaGraphConfig, SamplingParams
from dflash_trt.engine.request import DEFAULT_MAX_TOKENS, RequestParams
from dflash_trt.errors import ConfigError, RequestError


def test_cuda_graph_batch_sizes_follow_the_config() -> None:
    assert CudaGraphConfig().graph_batch_sizes(16) is None  # the engine's own ladder
    assert CudaGraphConfig(batch_sizes=[8, 1, 2, 2]).graph_batch_sizes(16) == (1, 2, 8)
    assert CudaGraphConfig(batch_sizes=[1, 4], max_batch_size=4).graph_batch_sizes(4) == (1, 4)
    # TensorRT-LLM's 0 means unset; at or above the LLM's max_batch_size nothing larger is captured
    assert CudaGraphConfig(max_batch_size=0).graph_batch_sizes(16) is None
    assert CudaGraphConfig(max_batch_size=32).graph_batch_sizes(16) is None


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (CudaGraphConfig(enable_padding=False), "cuda_graph_config.enable_padding"),
        (CudaGraphConfig(max_batch_size=4), "cuda_graph_config.max_batch_size"),  # below the LLM's 16
        (CudaGraphConfig(batch_sizes=[1, 8], max_batch_size=16), "cuda_graph_config.max_batch_size"),
        (CudaGraphConfig(batch_sizes=[0, 2]), "cuda_graph_config.batch_sizes"),
    ],
)
def test_cuda_graph_settings_it_cannot_honour_are_refused(config, field) -> None:
    with pytest.raises(ConfigError) as info:
        config.graph_batch_sizes(16)
    assert info.value.field == field and "fix:" in info.value.one_line()


def test_the_llm_refuses_them_when_it_is_built() -> None:
    from dflash_trt.api.llm import LLM

    with pytest.raises(ConfigError, match=r"cuda_graph_config\.enable_padding=False"):
        LLM("tiny", cuda_graph_config={"enable_padding": False}, device="cpu")


def test_pad_id_is_refused_naming_the_field() -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(pad_id=0).check_supported()
    assert (
        info.value.field == "pad_id"
        and "never pads" in str(info.value)
        and "fix: omit pad_id" in str(info.value)
    )
    SamplingParams().check_supported()


def test_one_default_max_tokens_for_the_llm_api_and_the_engine() -> None:
    assert SamplingParams().max_tokens == RequestParams().max_tokens == DEFAULT_MAX_TOKENS == 32
