# SPDX-License-Identifier: Apache-2.0
"""--feature-scaling: the scale's statistic, the fold into fc on export, and resuming runs saved before it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_drafter, make_target


def test_scales_are_channel_rms_without_the_first_token_or_padding():
    from dflash_trt.training.feature_scale import RELATIVE_FLOOR, channel_scales

    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 6, 8, generator=g) * torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 100])
    feats[:, 0, 3] = 25_000.0  # a massive activation on the first token
    feats[1, 4:] = 1e6  # padding past the second sequence's length
    feats[:, :, 5] = 0.0  # a dead channel
    lengths = torch.tensor([6, 4])
    real = torch.cat([feats[0, 1:6], feats[1, 1:4]])
    want = real.pow(2).mean(0).sqrt()
    got = channel_scales(feats, lengths)
    torch.testing.assert_close(got[[0, 1, 2, 3, 4, 6, 7]], want[[0, 1, 2, 3, 4, 6, 7]])
    assert float(got[5]) == pytest.approx(float(want.median()) * RELATIVE_FLOOR)
    assert float(got[3]) < 10.0, "the first token's massive activation must not set its channel's scale"
    with pytest.raises(ValueError, match="at least two tokens"):
        channel_scales(feats, torch.tensor([1, 1]))


def test_the_exported_drafter_computes_what_training_computed(tmp_path):
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.training.feature_scale import folded, scale_features
    from dflash_trt.training.forward import training_forward
    from dflash_trt.training.trainer import export_drafter

    torch.manual_seed(0)
    target = make_target("qwen3", vocab=61)
    drafter = make_drafter(target, layers=1, block_size=4, std=0.02)
    embed, head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    drafter.bind_target(embed, head)
    width = drafter.fc.weight.shape[1]
    scale = torch.logspace(-1, 3, width)[torch.randperm(width)]
    feats = torch.randn(2, 12, width) * scale
    ids = torch.randint(0, 61, (2, 12))
    anchors, valid = torch.tensor([[2, 6], [3, 7]]), torch.ones(2, 2, dtype=torch.bool)
    trained = training_forward(drafter, scale_features(feats, scale), ids, anchors, valid)
    before = drafter.fc.weight.detach().clone()
    with folded(drafter, scale):
        export_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    assert torch.equal(drafter.fc.weight, before), "W' is put back after the export"
    loaded = load_drafter(tmp_path / "d")
    loaded.bind_target(embed, head)
    served = training_forward(loaded, feats, ids, anchors, valid)
    torch.testing.assert_close(served, trained, rtol=1e-4, atol=1e-4)
    without = training_forward(loaded, scale_features(feats, scale), ids, anchors, valid)
    assert not torch.allclose(without, trained, rtol=1e-2, atol=1e-2), "the fold is not a no-op"


def test_a_run_saved_before_feature_scaling_resumes_as_it_was_trained(tmp_path):
    from dflash_trt.errors import UsageError
    from dflash_trt.training.trainer import TrainConfig, _check_resume

    old = TrainConfig(target="tiny", data="d.jsonl", out=str(tmp_path)).to_json()
    del old["feature_scaling"]  # what runs before the flag saved
    _check_resume(
        old, TrainConfig(target="tiny", data="d.jsonl", out=str(tmp_path), feature_scaling=False).to_json()
    )
    with pytest.raises(UsageError, match=r"--feature-scaling=True differs from the saved run's False"):
        _check_resume(old, TrainConfig(target="tiny", data="d.jsonl", out=str(tmp_path)).to_json())


def test_the_loss_over_the_data_vocabulary_is_the_full_loss_restricted_to_it():
    """--loss-vocab data: the same cross entropy as the whole head's when the other tokens' logits are
    removed, the accuracies counted in token ids, and a label outside the vocabulary refused."""
    from dflash_trt.training.forward import LossVocab, dflash_loss, make_block_batch

    torch.manual_seed(0)
    target = make_target("qwen3", vocab=61)
    drafter = make_drafter(target, layers=1, block_size=4, std=0.02)
    head = target.lm_head.weight.detach()
    drafter.bind_target(target.get_input_embeddings().weight.detach(), head)
    ids = torch.tensor([[3, 9, 3, 12, 9, 40, 3, 12, 9, 40, 12, 3]])
    batch = make_block_batch(
        ids, torch.ones_like(ids), torch.tensor([12]), [torch.tensor([1, 5])], block_size=4, gamma=4.0
    )
    hidden = torch.randn(1, 2, 4, drafter.config.hidden_size)
    vocab = LossVocab.of(ids, 61)
    assert vocab.ids.tolist() == [3, 9, 12, 40]
    loss, stats = dflash_loss(drafter, hidden, batch, vocab=vocab)
    sel = batch.weights > 0
    logits = (hidden[sel] @ head[vocab.ids].T).float()
    want = torch.nn.functional.cross_entropy(logits, vocab.index(batch.labels[sel]), reduction="none")
    w = batch.weights[sel]
    torch.testing.assert_close(loss, (want * w).sum() / w.sum())
    full, _ = dflash_loss(drafter, hidden, batch)
    assert float(full) > float(loss), "the whole head's softmax spreads mass over more tokens"
    hits = torch.zeros(sel.shape)
    hits[sel] = (vocab.ids[logits.argmax(-1)] == batch.labels[sel]).float()
    want_acc = (hits[..., 1:].sum(dim=(0, 1)) / sel[..., 1:].sum(dim=(0, 1))).tolist()
    assert stats.acc == pytest.approx(want_acc)
    with pytest.raises(ValueError, match="outside the loss vocabulary"):
        dflash_loss(drafter, hidden, batch, vocab=LossVocab.of(torch.tensor([3, 9]), 61))
