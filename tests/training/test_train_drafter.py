# SPDX-License-Identifier: Apache-2.0
"""`train-drafter` end to end on toy data: the loss goes down, checkpoints are z-lab checkpoints
(ours and the reference package load them), --resume continues exactly, errors name the flag."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import make_drafter, make_target

TOY_CODE = (
    "def add(a, b):\n    return a + b\n\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "for i in range(10):\n    print(i, i * i)\n",
)


@pytest.fixture
def toy(tmp_path: Path, tmp_models):
    """A random byte-vocabulary target with the byte tokenizer, and a directory of code files."""
    tdir, _ = tmp_models("qwen3", tokenizer=True, vocab=264)
    data = tmp_path / "corpus"
    data.mkdir()
    for i, snippet in enumerate(TOY_CODE):
        (data / f"f{i}.py").write_text(snippet * 12)
    (data / ".hidden").write_text("ignored")
    (data / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 10)  # not UTF-8: skipped
    return tdir, data


def base_args(tdir: Path, data: Path, out: Path) -> list[str]:
    return [
        "train-drafter", "--target", str(tdir), "--data", str(data), "--out", str(out),
        "--num-layers", "1", "--block-size", "4", "--seq-len", "64", "--num-anchors", "8",
        "--batch-size", "2", "--lr", "3e-3", "--eval-prompts", "1", "--eval-max-new-tokens", "12",
        "--log-every", "1",
    ]  # fmt: skip


def test_loss_decreases_on_a_toy_set():
    from dflash_trt.training.forward import dflash_loss, make_block_batch, sample_anchors, training_forward
    from dflash_trt.training.trainer import target_features

    torch.manual_seed(0)
    target = make_target("qwen3", vocab=61)
    drafter = make_drafter(target, layers=1, block_size=4, std=0.02)
    drafter.bind_target(target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
    pattern = torch.tensor([5, 17, 42, 8, 33, 21, 9])
    ids = pattern.repeat(2, 6)[:, :40]  # [2, 40]: periodic, so every label is predictable
    ids[1] = ids[1].roll(3)
    mask = torch.ones_like(ids)
    lengths = torch.tensor([40, 40])
    feats = target_features(target, ids, drafter.config.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    anchors = [
        sample_anchors(mask[i], length=40, block_size=4, num_anchors=16, generator=g) for i in range(2)
    ]
    batch = make_block_batch(ids, mask, lengths, anchors, block_size=4, gamma=4.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss, _ = dflash_loss(
            drafter, training_forward(drafter, feats, ids, batch.anchors, batch.valid), batch
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses[::8]


@pytest.mark.slow
def test_cli_trains_exports_and_resumes_exactly(toy, tmp_path, cli):
    from safetensors.torch import load_file

    from dflash_trt.models.checkpoint import load_drafter

    tdir, data = toy
    straight, half = tmp_path / "straight", tmp_path / "half"
    code, out, err = cli([*base_args(tdir, data, straight), "--steps", "6", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 6 and summary["eval_prompts"] == 1 and summary["tau"] >= 1.0
    assert re.search(r"step 6/6 loss \d", err)  # not a TTY: one line per --log-every steps
    for name in ("config.json", "model.safetensors", "train_state.pt", "train_args.json", "eval.json"):
        assert (straight / name).is_file(), name
    cfg = json.loads((straight / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["mask_token_id"] == 259  # the tokenizer's <|MASK|>
    assert len(cfg["dflash_config"]["target_layer_ids"]) == 1  # default for L=1: the middle layer
    assert load_drafter(straight).config.block_size == 4
    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5, 6]

    # An interruption (Ctrl-C) after step 3 saves the state; --resume then finishes the same run.
    from dflash_trt.training.trainer import TrainConfig, train_drafter

    def interrupt(entry: dict) -> None:
        if entry["step"] == 3:
            raise KeyboardInterrupt

    cfg = TrainConfig(
        target=str(tdir), data=str(data), out=str(half), num_layers=1, block_size=4, seq_len=64,
        num_anchors=8, batch_size=2, lr=3e-3, eval_prompts=1, eval_max_new_tokens=12, log_every=1, steps=6,
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        train_drafter(cfg, progress=False, report=interrupt)
    assert torch.load(half / "train_state.pt", weights_only=True)["step"] == 3
    code, _, err = cli([*base_args(tdir, data, half), "--steps", "6", "--resume"])
    assert code == 0, err
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(half / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert torch.load(half / "train_state.pt", weights_only=True)["step"] == 6

    # refusals: each names the flag, the value and the fix
    code, _, err = cli([*base_args(tdir, data, straight), "--steps", "6"])
    assert code == 2 and "already holds a training run" in err and "--resume" in err
    code, _, err = cli([*base_args(tdir, data, tmp_path / "none"), "--steps", "6", "--resume"])
    assert code == 2 and "train_state.pt does not exist" in err
    args = base_args(tdir, data, straight)
    args[args.index("--lr") + 1] = "1e-3"
    code, _, err = cli([*args, "--steps", "8", "--resume"])
    assert code == 2 and "--lr=0.001 differs from the saved run's 0.003" in err


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--steps", "2", "--epochs", "1"], r"--steps and --epochs are mutually exclusive"),
        (["--target-layer-ids", "1,x"], r"--target-layer-ids='1,x' is not a comma-separated list"),
        (["--target-layer-ids", "9"], r"target_layer_ids.*9"),
        (["--mask-token-id", "999"], r"--mask-token-id=999 is not a row of the target embedding"),
        (["--regen-prompt-len", "9:3"], r"--regen-prompt-len=9:3 needs 1 <= MIN <= MAX"),
        (["--seq-len", "4"], r"--seq-len=4 leaves no room for a block of 4"),
    ],
)
def test_usage_errors_name_the_flag(toy, tmp_path, cli, extra, pattern):
    tdir, data = toy
    code, out, err = cli([*base_args(tdir, data, tmp_path / "x"), *extra])
    assert code == 2, err
    assert re.search(pattern, err), err
    assert "Traceback" not in err and out == ""


def test_bad_data_is_refused(toy, tmp_path, cli):
    tdir, _ = toy
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": "no"}\n')
    code, _, err = cli([*base_args(tdir, bad, tmp_path / "x"), "--steps", "1"])
    assert code == 2 and "line 2 has neither 'messages'" in err
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, _, err = cli([*base_args(tdir, chat, tmp_path / "y"), "--steps", "1"])
    assert code == 2 and "chat template" in err
    code, _, err = cli([*base_args(tdir, tmp_path / "missing", tmp_path / "z"), "--steps", "1"])
    assert code == 2 and "does not exist" in err


def test_chat_loss_mask_covers_assistant_turns_only():
    from dflash_trt.tiny import build_byte_tokenizer
    from dflash_trt.training.data import Record, tokenize_chat

    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    )
    s = tokenize_chat(tok, Record(messages=msgs, source="t"), seq_len=512)
    assert s is not None
    text = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
    assert text == "hello<|im_end|>\nciao<|im_end|>\n"
    assert tok.decode(s.input_ids).startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.oracle
def test_trained_checkpoint_loads_in_the_reference_package(toy, tmp_path, monkeypatch):
    """z-lab round trip: the exported checkpoint loads strictly into dflash 0.1.0's
    DFlashDraftModel and generates exactly what our loop generates with it."""
    import dflash.model as dflash_model

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.training.trainer import TrainConfig, train_drafter

    tdir, data = toy
    out = tmp_path / "drafter"
    cfg = TrainConfig(
        target=str(tdir), data=str(data), out=str(out), num_layers=2, block_size=4, seq_len=64,
        num_anchors=8, batch_size=2, lr=3e-3, steps=4, eval_prompts=0, save_dtype="bfloat16",
    )  # fmt: skip
    train_drafter(cfg, progress=False)
    ours = load_drafter(out, dtype=torch.float32)
    ref = dflash_model.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    saved = load_file(str(out / "model.safetensors"))
    assert set(ref.state_dict()) == set(saved)
    result = ref.load_state_dict({k: v.float() for k, v in saved.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert ref.block_size == 4 and list(ref.target_layer_ids) == list(ours.config.target_layer_ids)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    prompt = [100, 101, 32, 97, 100, 100, 40]
    got = spec_generate(HFTarget(target), ours, prompt, max_new_tokens=24)
    want = dflash_model.dflash_generate(ref, target, torch.tensor([prompt]), 24, None, return_stats=True)
    assert got.output_ids == want.output_ids[0, len(prompt) :].tolist()
    assert got.acceptance_lengths == want.acceptance_lengths


def test_regeneration_is_the_targets_own_greedy_answer_and_is_cached(toy, tmp_path, monkeypatch):
    from dflash_trt.models.sources import default_stop_token_ids
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.training import regenerate as rg
    from dflash_trt.training.data import Sample

    tdir, _ = toy
    windows = [Sample(input_ids=list(range(40 + i, 80 + i)), loss_mask=[1] * 40) for i in range(3)]
    jobs = rg.text_jobs(windows, prompt_len=(4, 9), seq_len=40, min_new_tokens=5, seed=1)
    assert len(jobs) == 3 and all(4 <= len(j.prompt_ids) <= 9 for j in jobs)
    assert all(list(j.prompt_ids) == w.input_ids[: len(j.prompt_ids)] for j, w in zip(jobs, windows))
    kw = dict(target_dir=tdir, cache_dir=tmp_path / "cache", temperature=0.0, top_p=1.0, seed=0,
              device="cpu", dtype="float32", batch_size=2)  # fmt: skip
    samples = rg.regenerate(jobs, **kw)
    target = HFTarget.from_pretrained(tdir, device=torch.device("cpu"), dtype=torch.float32)
    stops = default_stop_token_ids(tdir, None)
    for job, s in zip(jobs, samples):
        n = len(job.prompt_ids)
        assert s.input_ids[:n] == list(job.prompt_ids) and s.loss_mask == [0] * n + [1] * (
            len(s.input_ids) - n
        )
        assert len(s.input_ids) <= 40
        ref = spec_generate(
            target, None, list(job.prompt_ids), max_new_tokens=job.max_new_tokens, stop_token_ids=stops
        )
        assert s.input_ids[n:] == ref.output_ids
    # the second call reads the cache and never starts an engine
    monkeypatch.setattr(rg, "_engine_generator", lambda *a, **k: pytest.fail("regenerated twice"))
    assert [s.input_ids for s in rg.regenerate(jobs, **kw)] == [s.input_ids for s in samples]


def test_text_job_prompts_never_end_in_end_of_text():
    from dflash_trt.training import regenerate as rg
    from dflash_trt.training.data import Sample

    eos = 7
    short = Sample(input_ids=[11, 12, 13, 14, eos], loss_mask=[1] * 5)  # a whole short document
    long = Sample(input_ids=list(range(20, 60)), loss_mask=[1] * 40)
    jobs = rg.text_jobs([short, long], prompt_len=(30, 30), seq_len=64, min_new_tokens=4, seed=0, eos_id=eos)
    assert [list(j.prompt_ids) for j in jobs] == [[11, 12, 13, 14], list(range(20, 50))]
    assert [j.max_new_tokens for j in jobs] == [60, 34]
    # without an eos id the window is taken as it is
    (first, _) = rg.text_jobs([short, long], prompt_len=(30, 30), seq_len=64, min_new_tokens=4, seed=0)
    assert list(first.prompt_ids) == short.input_ids


class _Planted:
    """What a planted state file could hold: an object whose unpickling runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("kind", ["planted", "not_a_state", "damaged"])
def test_resume_never_unpickles_arbitrary_objects(tmp_path, kind):
    from dflash_trt.errors import UsageError
    from dflash_trt.training.trainer import STATE_FILE, TrainConfig, _saved_state

    out, marker = tmp_path / "run", tmp_path / "code-ran"
    out.mkdir()
    state = out / STATE_FILE
    if kind == "planted":
        torch.save({"step": 1, "drafter": {}, "optimizer": {}, "config": {}, "samples_digest": "",
                    "payload": _Planted(marker)}, state)  # fmt: skip
    elif kind == "not_a_state":
        torch.save({"weights": torch.zeros(2)}, state)
    else:
        state.write_bytes(b"PK\x03\x04 not really a zip")
    cfg = TrainConfig(target="tiny", data=str(tmp_path / "d.jsonl"), out=str(out), resume=True)
    with pytest.raises(
        UsageError, match=r"--resume: .*train_state.pt is not a (training|train-drafter) state"
    ):
        _saved_state(cfg, out)
    assert not marker.exists()


def test_feature_cache_trains_the_same_drafter_without_the_target(toy, tmp_path, cli, monkeypatch):
    """--feature-cache: the first run stores each sample's features; a second run (another drafter on
    the same target and data) trains from them alone, to the weights the target's features give."""
    from safetensors.torch import load_file

    from dflash_trt.training import trainer

    tdir, data = toy
    cache = tmp_path / "features"
    args = lambda out: [*base_args(tdir, data, out), "--steps", "4", "--eval-prompts", "0"]  # noqa: E731
    code, _, err = cli([*args(tmp_path / "plain")])
    assert code == 0, err
    code, _, err = cli([*args(tmp_path / "first"), "--feature-cache", str(cache)])
    assert code == 0, err
    entries = sorted(cache.glob("*.pt"))
    assert entries and not list(cache.glob(".entry.*")), "whole entries only"

    def no_target(*a, **k):
        raise AssertionError("the target ran although every sample's features were cached")

    monkeypatch.setattr(trainer, "target_features", no_target)
    code, _, err = cli([*args(tmp_path / "second"), "--feature-cache", str(cache)])
    assert code == 0, err
    assert sorted(cache.glob("*.pt")) == entries
    ref = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for run in ("first", "second"):
        got = load_file(str(tmp_path / run / "model.safetensors"))
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)
