# SPDX-License-Identifier: Apache-2.0
"""The training objective's pieces against their definitions (dflash-algorithm.md §7):
anchors, the block mask, labels and weights, and the training forward against the inference pass."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.training.forward import (
    block_mask,
    dflash_loss,
    eligible_anchor_positions,
    make_block_batch,
    sample_anchors,
    training_forward,
)
from tests.conftest import make_drafter, make_target


def mask_by_definition(anchors: list[list[int]], n: int, s: int, b: int) -> torch.Tensor:
    """Element by element: query (blk, j) sees context t < a_blk and every slot of its own block."""
    out = torch.zeros(len(anchors), n * b, s + n * b, dtype=torch.bool)
    for i, seq in enumerate(anchors):
        for blk, a in enumerate(seq):
            for j in range(b):
                for t in range(s):
                    out[i, blk * b + j, t] = t < a
                for i2 in range(b):
                    out[i, blk * b + j, s + blk * b + i2] = True
    return out


@pytest.mark.parametrize(("s", "b"), [(7, 2), (12, 4), (9, 3)])
def test_block_mask_matches_definition(s, b):
    anchors = [[0, 3, s - b], [2, s - b], []]  # first anchor, last legal anchor, padding blocks
    n = 3
    a = torch.zeros(3, n, dtype=torch.long)
    valid = torch.zeros(3, n, dtype=torch.bool)
    for i, seq in enumerate(anchors):
        a[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        valid[i, : len(seq)] = True
    got = block_mask(a, valid, seq_len=s, block_size=b)
    assert got.shape == (3, n * b, s + n * b)
    assert torch.equal(got, mask_by_definition(anchors, n, s, b))
    # padded blocks see nothing; no block sees another block or its own anchor's feature
    assert not got[1, 2 * b :].any() and not got[2].any()
    assert not got[0, b : 2 * b, 3].any()


def test_anchor_eligibility_and_sampling():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    assert eligible_anchor_positions(mask, 10, 4).tolist() == [1, 2, 3, 5, 6]  # p <= 10 - 4
    assert eligible_anchor_positions(mask, 8, 4).tolist() == [1, 2, 3]  # shorter real length
    assert eligible_anchor_positions(mask, 3, 4).tolist() == []
    g = torch.Generator().manual_seed(0)
    picks = sample_anchors(mask, length=10, block_size=4, num_anchors=3, generator=g)
    assert picks.tolist() == sorted(picks.tolist()) and len(set(picks.tolist())) == 3
    assert set(picks.tolist()) <= {1, 2, 3, 5, 6}
    seen = set()
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        seen |= set(sample_anchors(mask, length=10, block_size=4, num_anchors=2, generator=g).tolist())
    assert seen == {1, 2, 3, 5, 6}  # every eligible position is reachable


def test_labels_and_weights():
    ids = torch.arange(10, 20)[None]  # x_p = 10 + p
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    lengths = torch.tensor([9])  # the last position is padding
    batch = make_block_batch(
        ids, loss_mask, lengths, [torch.tensor([1, 5])], block_size=4, gamma=2.0, num_blocks=3
    )
    assert batch.labels[0, 0].tolist() == [11, 12, 13, 14]
    assert batch.labels[0, 1].tolist() == [15, 16, 17, 18]
    w = batch.weights[0]
    e = [math.exp(-(j - 1) / 2.0) for j in range(4)]
    assert w[0].tolist() == pytest.approx([0.0, e[1], e[2], e[3]])
    assert w[1].tolist() == pytest.approx([0.0, e[1], e[2], e[3]])
    batch = make_block_batch(ids, loss_mask, lengths, [torch.tensor([2, 6])], block_size=4, gamma=2.0)
    assert batch.weights[0, 0].tolist() == pytest.approx([0.0, e[1], e[2], 0.0])  # x_5 not in the loss
    assert batch.weights[0, 1].tolist() == pytest.approx([0.0, e[1], e[2], 0.0])  # x_9 is past the end
    assert batch.valid.tolist() == [[True, True]]
    padded = make_block_batch(
        ids, loss_mask, lengths, [torch.tensor([1])], block_size=4, gamma=7, num_blocks=2
    )
    assert padded.valid.tolist() == [[True, False]] and not padded.weights[0, 1].any()


def _features(target, ids, layer_ids):
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)  # [bs, S, K * D]


@pytest.mark.parametrize("variant", ["plain", "swa", "gpt_oss"])
def test_training_forward_equals_inference_forward(variant):
    from dflash_trt.layers.kv_cache import context_index, slot_mapping

    torch.manual_seed(0)
    target = make_target("qwen3")
    drafter = make_drafter(target, variant=variant, block_size=5)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    s, b = 23, 5
    ids = torch.randint(0, 60, (2, s))
    feats = _features(target, ids, drafter.config.target_layer_ids)
    anchors = torch.tensor([[0, 4, 11, 18], [3, 9, 17, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    with torch.no_grad():
        hidden = training_forward(drafter, feats, ids, anchors, valid)  # [2, 4, B, D]
    page = 8
    for i in range(2):
        for n in range(4):
            if not valid[i, n]:
                continue
            a = int(anchors[i, n])
            cache = drafter.make_cache(num_pages=5, page_size=page)
            table = torch.arange(1, 5)[None]  # page 0 unused, as in the engine
            pos = torch.arange(a)
            with torch.no_grad():
                drafter.inject_context(cache, feats[i, :a], pos, slot_mapping(table, pos[None], page)[0])
                block = torch.full((1, b), drafter.mask_token_id)
                block[0, 0] = ids[i, a]
                ref = drafter.forward_block(
                    cache,
                    drafter.embed_block(block),
                    torch.arange(a, a + b)[None],
                    context_index(table, page),
                    torch.tensor([a]),
                )[0]
            torch.testing.assert_close(hidden[i, n], ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(
                drafter.compute_logits(hidden[i, n, 1:]),
                drafter.compute_logits(ref[1:]),
                rtol=1e-4,
                atol=1e-4,
            )


def test_sparse_attention_equals_dense_mask():
    """The block-sparse softmax equals plain attention under the dense `block_mask`."""
    from torch.nn import functional as F

    from dflash_trt.layers.rope import apply_rope

    torch.manual_seed(1)
    target = make_target("qwen3")
    drafter = make_drafter(target, layers=1, block_size=4)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    s, b = 17, 4
    ids = torch.randint(0, 60, (2, s))
    feats = _features(target, ids, drafter.config.target_layer_ids)
    anchors = torch.tensor([[2, 7, 13], [0, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        got = training_forward(drafter, feats, ids, anchors, valid)
        # dense reference: every block flattened into one query sequence, keys [context ; blocks]
        layer = drafter.layers[0]
        attn = layer.self_attn
        n = anchors.shape[1]
        c = drafter.fuse_context(feats)
        block = torch.full((2, n, b), drafter.mask_token_id)
        block[:, :, 0] = torch.gather(ids, 1, anchors)
        x = drafter.embed_block(block.view(2, n * b))
        qpos = (anchors[:, :, None] + torch.arange(b)).view(2, n * b)
        cos, sin = drafter.rotary(qpos, x.dtype)
        ccos, csin = drafter.rotary(torch.arange(s), x.dtype)
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).unflatten(-1, (attn.num_heads, attn.head_dim))), cos, sin)
        kb, vb = attn.project_kv(h, cos, sin)
        kc, vc = attn.project_kv(c, ccos, csin)
        k = torch.cat([kc, kb], 1).transpose(1, 2)
        v = torch.cat([vc, vb], 1).transpose(1, 2)
        mask = block_mask(anchors, valid, seq_len=s, block_size=b)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=attn.head_dim**-0.5, enable_gqa=True
        ).transpose(1, 2)
        x = x + attn.o_proj(out.flatten(-2))
        x = drafter.norm(x + layer.mlp(layer.post_attention_layernorm(x))).view(2, n, b, -1)
    torch.testing.assert_close(got[valid], x[valid], rtol=1e-4, atol=1e-5)


def test_loss_is_weighted_mean_of_cross_entropy():
    torch.manual_seed(2)
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    s = 16
    ids = torch.randint(0, 60, (1, s))
    feats = _features(target, ids, drafter.config.target_layer_ids)
    batch = make_block_batch(
        ids, torch.ones(1, s), torch.tensor([s]), [torch.tensor([0, 6, 12])], block_size=4, gamma=7
    )
    hidden = training_forward(drafter, feats, ids, batch.anchors, batch.valid)
    loss, stats = dflash_loss(drafter, hidden, batch)
    logits = drafter.compute_logits(hidden).float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), batch.labels.flatten(), reduction="none")
    w = batch.weights.flatten()
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum())
    assert stats.weight == pytest.approx(float(w.sum())) and len(stats.acc) == 3
    loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
