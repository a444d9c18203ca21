# SPDX-License-Identifier: Apache-2.0
"""Recipe: the trained `tiny` pair, from nothing, in one command (CPU, no network).

    .venv/bin/python build/recipes/tiny_pair.py            # all stages, then install the assets
    make tiny-pair                                          # the same

Stages (each writes under --out, default build/out/tiny-pair; --stages picks a subset):
  target   a byte-level Qwen3 LM trained on the Python standard library's source (train split)
  data     code prompts cut from the train split (code_prompts.jsonl) and held-out code prompts
           (from files neither model trains on; their exact strings are kept out of the former)
  drafter  `dflash-trt train-drafter` on code_prompts.jsonl with --regenerate (each prompt
           continued by the target's own greedy decoding), block 16, ending with tau on the
           held-out prompts
  drafter2 the DFlash 2 drafter: the same data (the drafter stage's regeneration), budget and flags,
           plus --dflash2 (convs and a top-8 selector)
  measure  tau on the held-out prompts, the embedded-engine benchmark (batch 1 and 8) and the
           `generate --json` speedup, into results.json
  compare2 tau of v1 and DFlash 2 side by side on the held-out prompts (results2.json)
  install  copy both checkpoints (bf16) and the held-out prompts into dflash_trt/assets/tiny/, and the
           DFlash 2 drafter into assets/tiny/drafter-dflash2 when compare2 measured it ahead of v1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Threads that wait passively: on a shared 2-core machine spinning OpenMP workers slow every
# process down by orders of magnitude.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(REPO))

STAGES = ("target", "data", "drafter", "drafter2", "measure", "compare2", "install")

# The target: deep and narrow, so one target step costs many draft layers (CPU time per layer is
# mostly per-op overhead at this width), with a byte vocabulary (the LM head is cheap).
TARGET = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
TARGET_TRAIN = {"steps": 1200, "batch_size": 8, "seq_len": 512, "lr": 2e-3, "warmup_steps": 100, "seed": 0}

DRAFTER_ARGS = [
    "--num-layers", "1",
    "--target-layer-ids", "1,4,7,10",
    "--block-size", "16",
    "--gamma", "7",
    "--seq-len", "384",
    "--num-anchors", "64",
    "--batch-size", "8",
    "--lr", "3e-3",
    "--epochs", "4",
    "--max-samples", "2500",
    "--regenerate",
    "--regen-prompt-len", "160:160",  # the whole prompt (at most 160 bytes)
    "--regen-batch-size", "64",
    "--eval-prompts", "32",
    "--seed", "0",
]  # fmt: skip

# The DFlash 2 drafter: v1's data, budget and flags, plus the convs (the published kernel 2, group 16)
# and a selector over the top 8 (llama.cpp's DFlash 2 needs hidden >= top_k * (top_k + 1): <= 10 at 128).
DRAFTER2_ARGS = [
    *DRAFTER_ARGS,
    "--dflash2", "--conv-kernel-size", "2", "--conv-group-size", "16", "--selector-rank", "64",
    "--selector-top-k", "8",
]  # fmt: skip

ASSETS = REPO / "dflash_trt" / "assets" / "tiny"
NUM_HELDOUT_PROMPTS = 32
NUM_TRAIN_PROMPTS = 2500
MAX_NEW_TOKENS = 128
DEMO_PROMPT = "def fibonacci(n):\n"
CLI_PROMPTS = 4  # held-out prompts also timed through `generate --json`
ENGINE_PROMPTS = 8  # held-out prompts for the embedded-engine benchmark

log = logging.getLogger("tiny_pair")


def stage_target(out: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_trt.tiny import CHAT_TEMPLATE, build_byte_tokenizer
    from dflash_trt.training.corpus import read_text, split_stdlib
    from dflash_trt.training.target_lm import LMTrainConfig, save_target, token_stream, train_causal_lm

    torch.manual_seed(0)
    tok = build_byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # saved as chat_template.jinja next to the tokenizer
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    split = split_stdlib()
    train_texts = [t for t in map(read_text, split.train) if t]
    heldout_texts = [t for t in map(read_text, split.heldout) if t]
    train = token_stream(train_texts, tok, eos_id=eos)
    heldout = token_stream(heldout_texts, tok, eos_id=eos)
    log.info("stdlib %s: %d train files (%d tokens), %d held out (%d tokens)", split.root,
             len(split.train), train.numel(), len(split.heldout), heldout.numel())  # fmt: skip
    cfg = Qwen3Config(vocab_size=264, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=None, **TARGET)
    cfg.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(cfg)
    tcfg = LMTrainConfig(**TARGET_TRAIN)  # type: ignore[arg-type]
    t0 = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step % 50 == 0 or step == tcfg.steps:
            log.info("target step %d/%d loss %.3f (%.0f s)", step, tcfg.steps, loss, time.perf_counter() - t0)

    result = train_causal_lm(model, train, heldout, tcfg, progress=progress)
    log.info("target: train loss %.3f, held-out loss %.3f nats/byte, %.0f s",
             result["train_loss"], result["eval_loss"], result["seconds"])  # fmt: skip
    info = {
        "recipe": "build/recipes/tiny_pair.py",
        "corpus": f"python {sys.version.split()[0]} stdlib, {len(split.train)} files, {train.numel()} tokens",
        "train": TARGET_TRAIN,
        **result,
    }
    save_target(model, tok, out / "target", eos_id=eos, dtype=torch.bfloat16, info=info)


def stage_data(out: Path) -> None:
    from dflash_trt.training.corpus import code_prompts, split_stdlib

    split = split_stdlib()
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    prompts = code_prompts(split.heldout, count=NUM_HELDOUT_PROMPTS, seed=0)
    with (data / "heldout_prompts.jsonl").open("w") as f:
        for p in prompts:
            f.write(json.dumps({"text": p}) + "\n")
    # Training prompts: the same shape, from the train split; a string that also opens a held-out
    # prompt (e.g. `def __init__(self):`) is left out.
    held = set(prompts)
    train = [p for p in code_prompts(split.train, count=NUM_TRAIN_PROMPTS + 100, seed=1) if p not in held]
    with (data / "code_prompts.jsonl").open("w") as f:
        for p in train[:NUM_TRAIN_PROMPTS]:
            f.write(json.dumps({"text": p}) + "\n")
    heldout = [str(p.relative_to(split.root)) for p in split.heldout]
    meta = {"source": "held-out stdlib files (never trained on)", "files": heldout, "prompts": prompts}
    (data / "heldout_prompts.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info("data: %d training prompts from %d train files, %d held-out prompts from %d held-out files",
             min(len(train), NUM_TRAIN_PROMPTS), len(split.train), len(prompts), len(heldout))  # fmt: skip


def stage_drafter(out: Path) -> None:
    _train(out, out / "drafter", DRAFTER_ARGS)


def stage_drafter2(out: Path) -> None:
    """The DFlash 2 drafter, on the regeneration the v1 stage made (the same training data)."""
    _train(out, out / "drafter2", [*DRAFTER2_ARGS, "--regen-cache", str(out / "drafter" / "regenerated")])


def _train(out: Path, drafter: Path, args: list[str]) -> None:
    cmd = [
        sys.executable, "-m", "dflash_trt", "train-drafter",
        "--target", str(out / "target"),
        "--data", str(out / "data" / "code_prompts.jsonl"),
        "--eval-data", str(out / "data" / "heldout_prompts.jsonl"),
        "--out", str(drafter),
        "--save-dtype", "bfloat16",
        *args,
    ]  # fmt: skip
    if (drafter / "train_state.pt").is_file():
        cmd.append("--resume")
    log.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO)


def _generate_json(target: Path, drafter: Path, prompt: str, *extra: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "dflash_trt", "generate", "--target", str(target), "--drafter", str(drafter),
           "--prompt", prompt, "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", *extra]  # fmt: skip
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout)


def stage_measure(out: Path) -> None:
    import platform

    import torch

    from dflash_trt.bench.engine_bench import format_table, run_engine_benchmark
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.sources import default_stop_token_ids, load_tokenizer
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.spec.sampling import SamplingConfig
    from dflash_trt.training.trainer import measure_tau

    target_dir, drafter_dir = out / "target", out / "drafter"
    prompts = json.loads((out / "data" / "heldout_prompts.json").read_text())["prompts"]
    tok = load_tokenizer(target_dir)
    target = HFTarget.from_pretrained(target_dir, device=torch.device("cpu"), dtype=torch.float32)
    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    tau = measure_tau(target, drafter, ids, max_new_tokens=MAX_NEW_TOKENS,
                      stop_token_ids=default_stop_token_ids(target_dir, tok))  # fmt: skip
    log.info(
        "tau on %d held-out prompts: %.2f (pooled %.2f)", tau["num_prompts"], tau["tau"], tau["tau_pooled"]
    )
    # Sampled decoding (lossless rejection sampling) for contrast: the drafter learnt greedy answers.
    tau_sampled = measure_tau(target, drafter, ids, max_new_tokens=MAX_NEW_TOKENS,
                              stop_token_ids=default_stop_token_ids(target_dir, tok),
                              sampling=SamplingConfig(temperature=0.7, seed=0))  # fmt: skip
    log.info("tau at T=0.7: %.2f", tau_sampled["tau"])

    # `generate --json` (the reference loop, or whatever the CLI runs today), spec vs --no-draft.
    cli = []
    for prompt in (DEMO_PROMPT, *prompts[:CLI_PROMPTS]):
        spec = _generate_json(target_dir, drafter_dir, prompt)
        plain = _generate_json(target_dir, drafter_dir, prompt, "--no-draft")
        cli.append({
            "prompt": prompt, "identical": spec["output_ids"] == plain["output_ids"],
            "tau": spec["mean_acceptance_length"], "tokens": len(spec["output_ids"]),
            "decode_s": spec["decode_s"], "decode_s_no_draft": plain["decode_s"],
            "speedup": plain["decode_s"] / spec["decode_s"],
        })  # fmt: skip
        log.info("generate %r: tau %.2f, speedup %.2fx, identical %s", prompt[:30], cli[-1]["tau"],
                 cli[-1]["speedup"], cli[-1]["identical"])  # fmt: skip

    # Embedded engine. run_engine_benchmark's batch b sends prompts[:b]; batch 1 is therefore run
    # once per prompt (else one prompt's luck decides it) and pooled: tokens / wall, rounds.
    engine_b1 = []
    for prompt in prompts[:ENGINE_PROMPTS]:
        r = run_engine_benchmark(
            target=str(target_dir), drafter=str(drafter_dir), block_size=None, batch_sizes=[1],
            max_tokens=MAX_NEW_TOKENS, prompts=(prompt,),
        )  # fmt: skip
        engine_b1.append(r)
    engine_b8 = run_engine_benchmark(
        target=str(target_dir), drafter=str(drafter_dir), block_size=None, batch_sizes=[8],
        max_tokens=MAX_NEW_TOKENS, prompts=tuple(prompts[:ENGINE_PROMPTS]),
    )  # fmt: skip
    engine = {"batch_1": _pool_batch1(engine_b1), "batch_8": _summary(engine_b8["points"])}
    table = format_table(engine_b8)
    log.info("engine, batch 1 over %d prompts: %s", len(engine_b1), json.dumps(engine["batch_1"]))
    log.info("engine, batch 8:\n%s", table)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tau_heldout": tau,
        "tau_heldout_t07": tau_sampled,
        "generate_cli": cli,
        "generate_cli_mean_speedup": sum(c["speedup"] for c in cli) / len(cli),
        "engine": engine,
        "engine_batch8_table": table,
        "engine_batch1_runs": engine_b1,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def stage_compare2(out: Path) -> None:
    """tau of the v1 and DFlash 2 drafters on the held-out prompts in the reference loop, side by side in
    one run (greedy and T = 0.7): DFlash 2 as published, and with its selector off (the argmax of its
    drafter, convs kept) to separate the two modules' shares. Writes results2.json."""
    import copy

    import torch

    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.sources import default_stop_token_ids, load_tokenizer
    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.spec.sampling import SamplingConfig

    target_dir = out / "target"
    prompts = json.loads((out / "data" / "heldout_prompts.json").read_text())["prompts"]
    tok = load_tokenizer(target_dir)
    target = HFTarget.from_pretrained(target_dir, device=torch.device("cpu"), dtype=torch.float32)
    stops = default_stop_token_ids(target_dir, tok)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    v1 = load_drafter(out / "drafter" if (out / "drafter" / "config.json").is_file() else ASSETS / "drafter",
                      dtype=torch.float32)  # fmt: skip
    d2 = load_drafter(out / "drafter2", dtype=torch.float32)
    argmax = copy.deepcopy(d2)
    with torch.no_grad():
        argmax.candidate_selector.hidden_projection.weight.zero_()  # pair term 0: the pick is the argmax
    drafters = {"v1": v1, "dflash2": d2, "dflash2_argmax": argmax}
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(ids),
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    for mode, sampling in (("greedy", None), ("t0.7", SamplingConfig(temperature=0.7, seed=0))):
        for name, drafter in drafters.items():
            taus, rounds, drafted, overturned, outputs = [], [], 0, 0, []
            for prompt in ids:
                r = spec_generate(target, drafter, prompt, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stops,
                                  sampling=sampling)  # fmt: skip
                taus.append(r.mean_acceptance_length)
                rounds += r.acceptance_lengths
                drafted, overturned = drafted + r.num_draft_tokens, overturned + r.num_overturned
                outputs.append(r.output_ids)
            entry = {"tau": sum(taus) / len(taus), "tau_pooled": sum(rounds) / len(rounds),
                     "overturn_share": overturned / max(1, drafted), "per_prompt_tau": [round(t, 2) for t in taus]}  # fmt: skip
            if mode == "greedy":
                entry["identical_to_v1"] = name == "v1" or outputs == results["greedy"]["v1"]["outputs"]
                entry["outputs"] = outputs
            results.setdefault(mode, {})[name] = entry
            log.info("%s %s: tau %.2f (pooled %.2f), overturned %.1f%% of drafts", mode, name, entry["tau"],
                     entry["tau_pooled"], 100 * entry["overturn_share"])  # fmt: skip
    for mode in ("greedy", "t0.7"):
        results[mode]["ratio_dflash2_over_v1"] = results[mode]["dflash2"]["tau"] / results[mode]["v1"]["tau"]
    for entry in results["greedy"].values():
        if isinstance(entry, dict):
            entry.pop("outputs", None)
    (out / "results2.json").write_text(json.dumps(results, indent=2) + "\n")


def _summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    by = {p["mode"]: p for p in points}
    ar, df = by["ar"], by["dflash"]
    return {
        "ar_tok_s": ar["output_tokens_per_s"],
        "dflash_tok_s": df["output_tokens_per_s"],
        "speedup": df["output_tokens_per_s"] / ar["output_tokens_per_s"],
        "tau": df["tau"],
        "ar_ms_per_step": 1e3 * ar["wall_s"] / max(1, ar["rounds"]),
        "dflash_ms_per_round": {
            k: df[f"{k}_ms_per_round"] for k in ("draft", "verify", "accept", "overhead")
        },
    }


def _pool_batch1(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool per-prompt batch-1 runs: total tokens / total wall per mode; tau over all rounds."""
    tot: dict[str, list[float]] = {"ar": [0.0, 0.0], "dflash": [0.0, 0.0]}
    rounds = 0
    for r in runs:
        for p in r["points"]:
            tot[p["mode"]][0] += p["output_tokens"]
            tot[p["mode"]][1] += p["wall_s"]
            if p["mode"] == "dflash":
                rounds += p["rounds"]
    ar = tot["ar"][0] / tot["ar"][1]
    df = tot["dflash"][0] / tot["dflash"][1]
    per_prompt = [_summary(r["points"]) for r in runs]
    return {
        "prompts": len(runs),
        "ar_tok_s": ar,
        "dflash_tok_s": df,
        "speedup": df / ar,
        "tau_pooled": (tot["dflash"][0] - len(runs)) / max(1, rounds),
        "per_prompt_speedup": [round(p["speedup"], 2) for p in per_prompt],
        "per_prompt_tau": [round(p["tau"], 2) for p in per_prompt],
    }


def stage_install(out: Path) -> None:
    """Copy what the earlier stages made into the package (a part that was not built is left as it is).
    The DFlash 2 drafter goes in beside v1 only when compare2 measured it ahead of v1 (results2.json)."""
    assets = REPO / "dflash_trt" / "assets" / "tiny"
    drafter_files = ("config.json", "model.safetensors", "train_args.json", "eval.json")
    keep = {
        "target": ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "training.json"),
        "drafter": drafter_files,
    }  # fmt: skip
    compare = out / "results2.json"
    if compare.is_file() and json.loads(compare.read_text())["greedy"]["ratio_dflash2_over_v1"] > 1.0:
        keep["drafter2"] = (*drafter_files, "results2.json")
        shutil.copyfile(compare, out / "drafter2" / "results2.json")
    elif (out / "drafter2").is_dir():
        log.info("the DFlash 2 drafter is not installed: compare2 did not measure it ahead of v1")
    for part, names in keep.items():
        if not (out / part / "config.json").is_file():
            log.info("%s was not built under %s; the installed copy stays", part, out)
            continue
        dst = assets / ("drafter-dflash2" if part == "drafter2" else part)
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for name in names:
            if (out / part / name).is_file():
                shutil.copyfile(out / part / name, dst / name)
        # The drafter's recorded arguments name this machine's paths; keep them relative to the repo.
        args_file = dst / "train_args.json"
        if args_file.is_file():
            train_args = json.loads(args_file.read_text())
            for key, value in train_args.items():
                if isinstance(value, str) and os.path.isabs(value) and "build/out/" in value:
                    train_args[key] = value[value.index("build/out/") :]
            args_file.write_text(json.dumps(train_args, indent=2) + "\n")
    shutil.copyfile(out / "data" / "heldout_prompts.json", assets / "heldout_prompts.json")
    size = sum(p.stat().st_size for p in assets.rglob("*") if p.is_file())
    log.info("installed the tiny pair into %s (%.2f MB)", assets, size / 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "build/out/tiny-pair")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    import torch

    torch.set_num_threads(args.threads)
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from {STAGES}")
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:
        if stage in stages:
            t0 = time.perf_counter()
            log.info("== stage %s", stage)
            globals()[f"stage_{stage}"](args.out)
            log.info("== stage %s done in %.0f s", stage, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
