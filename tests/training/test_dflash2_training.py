# SPDX-License-Identifier: Apache-2.0
"""Training DFlash 2 drafters: the training forward (convs per block) equals the inference pass, the
selector's K-way objective (true predecessor, label injected when missing), a toy run where the selector
learns to overturn wrong argmax picks, and `train-drafter --dflash2` exporting the published format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.models.dflash2 import DFlash2Drafter
from dflash_trt.training.forward import (
    dflash_loss,
    make_block_batch,
    sample_anchors,
    selector_terms,
    training_forward,
)
from dflash_trt.training.trainer import target_features
from tests.conftest import make_drafter, make_target
from tests.training.test_train_drafter import base_args, toy  # noqa: F401  (the toy fixture)


@pytest.mark.parametrize("variant", ["plain", "swa"])
def test_training_forward_equals_inference_forward(variant):
    torch.manual_seed(0)
    target = make_target("qwen3")
    drafter = make_drafter(target, variant=variant, block_size=5, dflash2=True)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    s, b, page = 23, 5, 8
    ids = torch.randint(0, 60, (1, s))
    feats = target_features(target, ids, drafter.config.target_layer_ids)
    anchors, valid = torch.tensor([[0, 7, 15]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        hidden = training_forward(drafter, feats, ids, anchors, valid)  # [1, 3, B, D]
    for n in range(3):
        a = int(anchors[0, n])
        cache = drafter.make_cache(num_pages=5, page_size=page)
        table = torch.arange(1, 5)[None]
        pos = torch.arange(a)
        block = torch.full((1, b), drafter.mask_token_id)
        block[0, 0] = ids[0, a]
        with torch.no_grad():
            drafter.inject_context(cache, feats[0, :a], pos, slot_mapping(table, pos[None], page)[0])
            ref = drafter.forward_block(cache, drafter.embed_block(block), torch.arange(a, a + b)[None],
                                        context_index(table, page), torch.tensor([a]))[0]  # fmt: skip
        torch.testing.assert_close(hidden[0, n], ref, rtol=1e-4, atol=1e-5)


def test_selector_objective_injects_the_missing_label():
    drafter = make_drafter(make_target(), dflash2=True, std=0.3)
    assert isinstance(drafter, DFlash2Drafter)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0] + [-9.0] * 55] * 2)
    labels = torch.tensor([1, 9])  # row 0: a top-4 candidate; row 1: outside the top 4
    hidden, prev = torch.randn(2, 48), torch.tensor([3, 3])
    ce, hit, over = selector_terms(drafter, hidden, logits, labels, prev)
    assert ce.shape == (2,) and bool(torch.isfinite(ce).all())
    assert not bool(hit[1])  # an injected label never counts as a hit (inference cannot pick it)
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.zero_()  # no pair term: the unary decides
    ce, hit, over = selector_terms(drafter, hidden, logits, labels, prev)
    assert not bool(over.any()) and not bool(hit[0])  # picks the argmax (0), the label is 1
    # the injected label takes the weakest slot with its own logit: CE = logsumexp(top 3 + label) - label
    want = torch.logsumexp(torch.tensor([5.0, 4.0, 3.0, -9.0]), 0) - (-9.0)
    torch.testing.assert_close(ce[1], want)


def test_selector_learns_to_overturn_wrong_argmax_picks():
    """A toy sequence whose next token follows from the previous one, a frozen random drafter that does
    not know it, and a selector over every token (K = V, so the label is always a candidate): the
    selector alone trains, learns the successor rule from the true predecessor and overturns the
    drafter's (wrong) argmax picks."""
    torch.manual_seed(0)
    target = make_target("qwen3", vocab=61)
    drafter = make_drafter(
        target, layers=1, block_size=4, std=0.02, dflash2={"selector_rank": 16, "selector_top_k": 61}
    )
    drafter.reset_convs()
    drafter.bind_target(target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
    pattern = torch.tensor([5, 17, 42, 8, 33, 21, 9])
    ids = pattern.repeat(2, 6)[:, :40]
    ids[1] = ids[1].roll(3)
    mask, lengths = torch.ones_like(ids), torch.tensor([40, 40])
    feats = target_features(target, ids, drafter.config.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    anchors = [
        sample_anchors(mask[i], length=40, block_size=4, num_anchors=16, generator=gen) for i in range(2)
    ]
    batch = make_block_batch(ids, mask, lengths, anchors, block_size=4, gamma=4.0)
    opt = torch.optim.AdamW(drafter.candidate_selector.parameters(), lr=3e-2)  # the selector alone trains
    for _ in range(60):
        loss, stats = dflash_loss(
            drafter, training_forward(drafter, feats, ids, batch.anchors, batch.valid), batch
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert stats.selector_acc is not None and stats.overturn is not None
    assert min(stats.selector_acc) > 0.9 and max(stats.acc) < 0.5, (stats.selector_acc, stats.acc)
    assert stats.overturn > 0.3 and stats.tau > 3.0


@pytest.mark.slow
def test_cli_trains_a_dflash2_drafter_in_the_published_format(toy, tmp_path, cli):  # noqa: F811
    from dflash_trt.models.checkpoint import load_drafter

    tdir, data = toy
    out = tmp_path / "d2"
    args = [*base_args(tdir, data, out), "--steps", "3", "--dflash2", "--selector-top-k", "6", "--selector-rank", "8",
            "--json"]  # fmt: skip
    code, stdout, err = cli(args)
    assert code == 0, err
    assert json.loads(stdout)["steps"] == 3 and "overturn" in err
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["architectures"] == ["DFlash2DraftModel"]
        and cfg["auto_map"]["AutoModel"] == "dflash.DFlash2DraftModel"
    )
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                        "selector_rank": 8, "selector_top_k": 6}  # fmt: skip
    names = set(load_file(str(out / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names and "layers.0.mlp_conv.base_kernel" in names
    drafter = load_drafter(out)
    assert isinstance(drafter, DFlash2Drafter)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all("selector_loss" in e and len(e["selector_acc"]) == 3 for e in log)
    # the authors' loader reads it too (bare codebook names mapped on load)
    import dflash.model as dm

    ref = dm.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(ref.candidate_selector.successor_codebook.weight.float(),
                       drafter.candidate_selector.successor_codebook.float())  # fmt: skip


def test_dflash2_flags_need_dflash2(toy, tmp_path, cli):  # noqa: F811
    tdir, data = toy
    code, _, err = cli([*base_args(tdir, data, tmp_path / "x"), "--steps", "1", "--selector-top-k", "4"])
    assert code == 2 and "--selector-top-k applies to DFlash 2 drafters only" in err and "--dflash2" in err
