# SPDX-License-Identifier: Apache-2.0
"""Native target models equal transformers' logits and layer taps, over the paged cache."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.models.loader import dequantize_mxfp4, load_native_target
from tests.conftest import make_target


def _extra_models():
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=61, hidden_size=48, intermediate_size=37, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    q2 = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    q2.config.architectures = ["Qwen2ForCausalLM"]
    mi = MistralForCausalLM(MistralConfig(**common, head_dim=12, sliding_window=5)).eval()
    mi.config.architectures = ["MistralForCausalLM"]
    return {"qwen2": q2, "mistral": mi}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt_oss", "qwen2", "mistral", "qwen3_tied"])
def test_native_matches_transformers_in_chunks(tmp_path, arch):
    if arch in ("qwen2", "mistral"):
        model = _extra_models()[arch]
    elif arch == "qwen3_tied":
        model = make_target("qwen3", seed=4, tie_word_embeddings=True)
    else:
        model = make_target(arch, seed=4)
    model.save_pretrained(tmp_path)
    native = load_native_target(tmp_path, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[3, 5, 7, 9, 11, 2, 4, 6, 8, 10, 12, 14, 1, 0, 13, 17, 19]])
    n = ids.shape[1]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    taps_wanted = [2, 0, model.config.num_hidden_layers - 1]  # out of order on purpose
    cache = native.make_cache(num_pages=8, page_size=4)
    table = torch.tensor([[3, 1, 5, 2, 7]])  # pages need not be contiguous or ordered
    logits, taps = [], []
    pos = torch.arange(n)[None]
    for lo, hi in ((0, 7), (7, 8), (8, 17)):  # prefill chunk, one decode step, a verify block
        with torch.no_grad():
            lg, tp = native(ids[:, lo:hi], pos[:, lo:hi], torch.tensor([hi]), cache,
                            slot_mapping(table, pos[:, lo:hi], 4), context_index(table, 4), tap_layers=taps_wanted)  # fmt: skip
        logits.append(lg)
        taps.append(tp)
    want_taps = torch.cat([ref.hidden_states[i + 1] for i in taps_wanted], dim=-1)
    torch.testing.assert_close(torch.cat(logits, 1), ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(taps, 1), want_taps, rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_single_sequences(tmp_path):
    model = make_target("gpt_oss", seed=2)
    model.save_pretrained(tmp_path)
    native = load_native_target(tmp_path, device="cpu", dtype=torch.float32)
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [4, 4, 4, 4, 4]]
    cache = native.make_cache(num_pages=12, page_size=4)
    tables = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    t = max(map(len, seqs))
    ids = torch.zeros(3, t, dtype=torch.long)
    pos = torch.zeros(3, t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        pos[i] = torch.arange(t)
    valid = pos < torch.tensor([len(s) for s in seqs])[:, None]
    slots = torch.where(valid, slot_mapping(tables, pos.clamp(max=11), 4), 0)
    with torch.no_grad():
        lg, _ = native(ids, pos, torch.tensor([len(s) for s in seqs]), cache, slots, context_index(tables, 4))
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s])).logits[0]
            torch.testing.assert_close(lg[i, : len(s)], ref, rtol=1e-5, atol=1e-5)


def test_mxfp4_dequantisation_layout():
    # one expert, 2 output rows, 32 inputs: low nibble first, scale 2^(s-127)
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.randint(0, 16, (1, 2, 1, 32), generator=torch.Generator().manual_seed(0))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [1, 2, 1, 16]
    scales = torch.tensor([[[128], [125]]], dtype=torch.uint8)  # x2 and x0.25
    out = dequantize_mxfp4(blocks, scales, torch.float32)  # [1, 32, 2]
    want = torch.tensor([[lut[c] for c in row] for row in codes[0, :, 0].tolist()]) * torch.tensor(
        [[2.0], [0.25]]
    )
    torch.testing.assert_close(out[0], want.T)


def test_unsupported_and_broken_targets(tmp_path):
    import json

    model = make_target("qwen3")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"target.model_type='mamba': not supported by the embedded engine"):
        load_native_target(tmp_path, device="cpu", dtype=torch.float32)
    cfg["model_type"] = "qwen3"
    cfg["num_hidden_layers"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"do not match a qwen3 model: missing \['model.layers.6"):
        load_native_target(tmp_path, device="cpu", dtype=torch.float32)


def test_a_compiled_forward_traces_one_decoder_layer_and_reuses_it_for_every_layer(tmp_path):
    """layers/regions.py: the target's layers become calls of one compiled subgraph (the cold compile
    traces and generates code for one layer, not for each), with each layer's own weights and cache,
    and the compiled forward equals the eager one."""
    model = make_target("qwen3", seed=3, layers=4)
    model.save_pretrained(tmp_path)
    native = load_native_target(tmp_path, device="cpu", dtype=torch.float32)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs):  # dynamo's graph, run as traced
        graphs.append(gm)
        return gm.forward

    tables = torch.tensor([[1, 2]])
    ids, pos = torch.tensor([[5, 9, 2]]), torch.arange(3)[None]
    slots = slot_mapping(tables, pos, 4)

    def run(fn):
        cache = native.make_cache(num_pages=4, page_size=4)
        with torch.no_grad():
            return fn(ids, pos, torch.tensor([3]), cache, slots, context_index(tables, 4))[0]

    want = run(native)
    got = run(torch.compile(native, backend=capture, fullgraph=True))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(calls) == 4  # one call per layer ...
    assert len({n.args[0].target for n in calls}) == 1  # ... of a single traced subgraph
