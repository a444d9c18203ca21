# SPDX-License-Identifier: Apache-2.0
"""What a JSON-schema guide does to DFlash: tau, tokens per second and the round's cost, guided against
free text, for the same prompts, in one engine, interleaved (issue #45's goals: tau under a schema at least
0.9x free tau; a guided round at most 1.15x a free round at batch 1).

  engine   `LLM(TARGET, guided_decoding_backend="xgrammar")` with the pair's packaged v1 drafter, eager
           rounds (a guided round runs eagerly: its matchers run on the host between the drafter's and the
           target's passes; --compile shows free rounds compiled beside them)
  prompts  --prompts of the pair's held-out prompts (chat-rendered where the pair has a template), each
           asked to answer as JSON; the guided run adds one of SCHEMAS (in turn) as its guide
  batch    1 (one request at a time), greedy, max_tokens --max-tokens
  figures  tau (tokens per round, bonus included) and output tok/s of each kind; ms per round of each
           kind; the guides' host work (matchers and masks, timed where they run) per guided round; the
           share of guided answers that parse and validate against their schema (those that ended at the
           guide's end; cut at max_tokens they cannot).

    .venv/bin/python bench/guided_decoding.py --target smollm2-135m --prompts 12
    .venv/bin/python bench/guided_decoding.py --target tiny --prompts 12
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"title": {"type": "string"}, "rating": {"type": "integer", "minimum": 1,
     "maximum": 5}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
     "required": ["title", "rating", "tags"]},
    {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
     "sources": {"type": "array", "items": {"type": "string"}}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "steps": {"type": "array", "items": {
     "type": "object", "properties": {"step": {"type": "integer"}, "action": {"type": "string"}},
     "required": ["step", "action"]}, "maxItems": 5}}, "required": ["name", "steps"]},
    {"type": "object", "properties": {"summary": {"type": "string"}, "sentiment": {"enum": ["positive",
     "negative", "neutral"]}, "language": {"type": "string"}}, "required": ["summary", "sentiment"]},
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="compiled free rounds (guided rounds stay eager)")
    p.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def prompts_for(llm: Any, target: str, n: int) -> list[str]:
    """Held-out prompts asking for a JSON answer, through the pair's chat template where it has one."""
    if target == "tiny":
        from dflash_trt.tiny import heldout_prompts
    else:
        from dflash_trt.smollm2 import heldout_prompts
    asks = [f"{p[:400]}\n\nAnswer as a JSON object." for p in heldout_prompts()[:n]]
    tok = llm.tokenizer
    if not getattr(tok, "chat_template", None):
        return asks
    return [tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
            for a in asks]  # fmt: skip


class HostTimer:
    """Seconds spent in the guides' host work (engine/grammar.py's GuidedRound and mask_logits)."""

    def __init__(self) -> None:
        from dflash_trt.engine import grammar
        from dflash_trt.engine import round as round_mod

        self.seconds = 0.0
        for owner, name in ((grammar.GuidedRound, "chain"), (grammar.GuidedRound, "along"),
                            (grammar.GuidedRound, "tree"), (round_mod, "mask_logits")):  # fmt: skip
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapper


def one(llm: Any, prompt: str, sp: Any) -> dict[str, Any]:
    times = llm.engine.runner.times
    r0, s0, t0 = times.rounds, times.round_s, time.perf_counter()
    out = llm.generate(prompt, sp).outputs[0]
    return {"tokens": len(out.token_ids), "rounds": times.rounds - r0, "round_s": times.round_s - s0,
            "wall_s": time.perf_counter() - t0, "text": out.text, "finish": out.finish_reason}  # fmt: skip


def valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def measure(llm: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from dflash_trt import GuidedDecodingParams, SamplingParams

    timer = HostTimer()
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "json_schema": []}
    checks = []
    for i, prompt in enumerate(prompts):  # interleaved: the machine's drift hits both kinds alike
        schema = SCHEMAS[i % len(SCHEMAS)]
        runs["free"].append(one(llm, prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)))
        before = timer.seconds
        guided = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                guided_decoding=GuidedDecodingParams(json=schema))  # fmt: skip
        runs["json_schema"].append({**one(llm, prompt, guided), "host_s": timer.seconds - before})
        run = runs["json_schema"][-1]
        checks.append((run["finish"], valid(run["text"], schema)))
    return {kind: summary(rs) for kind, rs in runs.items()} | {
        "ended_by_guide": sum(f == "stop" for f, _ in checks),
        "valid_of_ended": sum(ok for f, ok in checks if f == "stop"),
        "answers": len(checks),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens, rounds = sum(r["tokens"] for r in runs), sum(r["rounds"] for r in runs)
    out = {"tau": tokens / max(1, rounds), "tok_per_s": tokens / sum(r["wall_s"] for r in runs),
           "ms_per_round": 1e3 * sum(r["round_s"] for r in runs) / max(1, rounds), "tokens": tokens}  # fmt: skip
    if "host_s" in runs[0]:
        out["host_ms_per_round"] = 1e3 * sum(r["host_s"] for r in runs) / max(1, rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_trt import LLM, pairs

    pair = pairs.packaged_pair(args.target)
    drafter = pairs.default_drafter(pair) or pairs.packaged_drafter(f"{args.target}-dflash")
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    spec = {"decoding_type": "DFlash", "max_draft_len": block - 1, "speculative_model": str(drafter)}
    llm = LLM(args.target, speculative_config=spec, compile=args.compile, guided_decoding_backend="xgrammar")
    try:
        prompts = prompts_for(llm, args.target, args.prompts)
        llm.generate(prompts[0], None)  # warm-up: allocations, the first schema's compile
        result = measure(llm, prompts, args)
    finally:
        llm.shutdown()
    report(args, result)
    return 0


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    from importlib.metadata import version

    from dflash_trt.utils.figures import machine_record

    config = {"date": datetime.date.today().isoformat(), "machine": machine_record(),
              "xgrammar": version("xgrammar"), "target": args.target, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "rounds": "compiled (free) / eager (guided)" if args.compile else "eager", "batch": 1}  # fmt: skip
    print(json.dumps(config))
    free, guided = r["free"], r["json_schema"]
    for kind, s in (("free", free), ("json_schema", guided)):
        print(
            f"{kind:12s} tau {s['tau']:.2f}  {s['tok_per_s']:.1f} tok/s  {s['ms_per_round']:.2f} ms/round"
            + (
                f"  (guides' host work {s['host_ms_per_round']:.2f} ms/round)"
                if "host_ms_per_round" in s
                else ""
            )
        )
    print(f"tau ratio (json_schema / free): {guided['tau'] / free['tau']:.3f}   (goal >= 0.9)")
    print(f"round cost ratio (json_schema / free, ms per round): {guided['ms_per_round'] / free['ms_per_round']:.3f}"
          f"   guides' own work: {(free['ms_per_round'] + guided['host_ms_per_round']) / free['ms_per_round']:.3f}"
          "   (goal <= 1.15)")  # fmt: skip
    print(
        f"valid answers: {r['valid_of_ended']}/{r['ended_by_guide']} that ended at the guide's end "
        f"({r['answers']} answers; the others hit max_tokens)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, **r}, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
