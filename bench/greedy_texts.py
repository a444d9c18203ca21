# SPDX-License-Identifier: Apache-2.0
"""Whether two servers decode the same greedy tokens: the first N prompts of a dataset, rendered with the
pair's chat template as `bench sweep --protocol openai-completions` renders them, sent one at a time to an
OpenAI completions endpoint (temperature 0, `max_tokens` tokens, the end-of-turn token not ignored), and
the texts saved; then every saved run compared with the first (identical texts, and the mean length of the
common prefix in characters). bench/compare_llamacpp.sh runs `fetch` against every server it starts.

    .venv/bin/python bench/greedy_texts.py fetch --url http://127.0.0.1:18400 --model smollm2-135m \\
        --tokenizer smollm2-135m --dataset bench/datasets/smollm2-chat-heldout.jsonl --out OUT/texts/llama-ar.json
    .venv/bin/python bench/greedy_texts.py compare OUT/texts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path


def rendered_prompts(tokenizer_name: str, dataset: Path, count: int, max_tokens: int) -> list[str]:
    """The first `count` prompts of a JSONL dataset as `bench sweep --protocol openai-completions` sends
    them (its own `PromptSource`: chat records rendered with the tokenizer's template)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_trt.bench.workload import PromptSource, WorkloadSpec, load_tokenizer

    spec = WorkloadSpec(dataset=str(dataset), osl=max_tokens)
    source = PromptSource(spec, load_tokenizer(tokenizer_name), protocol="openai-completions")
    return [str(source.get(i).text) for i in range(count)]


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False}
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


def fetch(args: argparse.Namespace) -> None:
    prompts = rendered_prompts(args.tokenizer, args.dataset, args.count, args.max_tokens)
    texts = [complete(args.url, args.model, p, args.max_tokens) for p in prompts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".part")
    tmp.write_text(json.dumps({"url": args.url, "max_tokens": args.max_tokens, "texts": texts}, indent=1))
    os.replace(tmp, args.out)


def compare(args: argparse.Namespace) -> None:
    runs = {p.stem: json.loads(p.read_text())["texts"] for p in sorted(args.dir.glob("*.json"))}
    if len(runs) < 2:
        sys.exit(f"error: {args.dir} holds {len(runs)} saved run(s); fix: fetch from two servers or more")
    names = sorted(runs, key=lambda n: (not n.startswith(args.reference), n))
    ref = names[0]
    print(f"greedy texts against {ref} ({len(runs[ref])} prompts)")
    for name in names[1:]:
        pairs = list(zip(runs[ref], runs[name]))
        same = sum(a == b for a, b in pairs)
        # character by character is what is wanted here (texts, not paths)
        common = [len(os.path.commonprefix([a, b])) / max(1, len(a)) for a, b in pairs]  # noqa: RUF071
        prefix = sum(common) / max(1, len(pairs))
        print(f"  {name:32s} identical {same}/{len(pairs)}, common prefix {prefix:.0%} of {ref}'s characters")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--url", required=True)
    f.add_argument("--model", required=True)
    f.add_argument("--tokenizer", required=True)
    f.add_argument("--dataset", type=Path, required=True)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--count", type=int, default=8)
    f.add_argument("--max-tokens", type=int, default=64)
    c = sub.add_parser("compare")
    c.add_argument("dir", type=Path)
    c.add_argument("--reference", default="ours-", help="the run the others are compared with (name prefix)")
    args = ap.parse_args()
    fetch(args) if args.cmd == "fetch" else compare(args)


if __name__ == "__main__":
    main()
