# SPDX-License-Identifier: Apache-2.0
"""Quantization with NVIDIA ModelOpt (0.47): FP8 / NVFP4 PTQ of the target and export as a unified
Hugging Face checkpoint (`hf_quant_config.json`), which TensorRT-LLM's PyTorch backend loads and
the embedded engine loads too (it dequantizes weights on load; it does not emulate activation or
KV-cache quantization).

ModelOpt 0.47 config format: `cfg["quant_cfg"]` is an ordered list of
{"quantizer_name": wildcard, "cfg": {...}, "enable": bool} entries; the KV-cache entries of
FP8_KV_CFG are appended to the weight/activation recipe.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError, EnvironmentMissing, UsageError

log = logging.getLogger(__name__)

RECIPE_NAMES = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")  # fmt: skip

# A small built-in calibration set: prose, dialogue and code, so activations see typical ranges.
BUILTIN_CALIBRATION = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the windowsill.",
    "In 1905 Einstein published four papers that changed physics: on the photoelectric effect, Brownian "
    "motion, special relativity and the equivalence of mass and energy.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "User: How do I reverse a list in Python?\nAssistant: Use slicing, items[::-1], or items.reverse() "
    "to reverse it in place.",
    "Speculative decoding drafts several tokens cheaply and lets the large model verify them in one pass.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen.",
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }",
    "The committee will meet on Tuesday to review the budget, the hiring plan and the product roadmap.",
    "Water boils at 100 degrees Celsius at sea level; at higher altitudes the boiling point is lower.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(y.mean())\n",
    "Once upon a time, in a village by the sea, there lived an old fisherman and his granddaughter.",
)


def load_calibration(path: str | None, samples: int) -> list[str]:
    """Texts from a JSONL file ({"text": ...} or {"messages": [...]}) or the built-in set."""
    if path is None:
        texts = list(BUILTIN_CALIBRATION)
    else:
        p = Path(path)
        if not p.is_file():
            raise UsageError(
                f"--calib-data={path!r} is not a file", hint="pass a JSONL file with a 'text' field"
            )
        texts = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(
                    f"--calib-data {path}:{i} is not JSON ({exc.msg})", hint="one object per line"
                ) from exc
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                texts.append(row["text"])
            elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                texts.append(
                    "\n".join(str(m.get("content", "")) for m in row["messages"] if isinstance(m, dict))
                )
            else:
                raise UsageError(f"--calib-data {path}:{i} has neither 'text' nor 'messages'")
        if not texts:
            raise UsageError(f"--calib-data={path!r} holds no texts")
    return texts[:samples]


def build_recipe(fmt: str, *, kv_fp8: bool) -> dict[str, Any]:
    """The ModelOpt config for `fmt` (a deep copy of its preset), with FP8 KV-cache entries appended."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    if fmt not in RECIPE_NAMES:
        raise UsageError(f"quantization format {fmt!r} has no ModelOpt recipe", hint="use fp8 or nvfp4")
    cfg = copy.deepcopy(getattr(mtq, RECIPE_NAMES[fmt]))
    if kv_fp8:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


def quantize_checkpoint(
    src: Path,
    out: Path,
    *,
    fmt: str,
    kv_fp8: bool,
    calib_texts: list[str],
    max_len: int = 256,
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """PTQ of a transformers checkpoint directory into `out` (unified HF export). Returns a report."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as exc:
        raise EnvironmentMissing(
            f"quantization needs nvidia-modelopt and transformers ({exc})",
            hint="pip install 'dflash-trt[modelopt]'",
        ) from exc
    recipe = build_recipe(fmt, kv_fp8=kv_fp8)
    model: Any = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = model.to(device).eval()
    if not getattr(model.config, "architectures", None):  # ModelOpt's export needs it
        model.config.architectures = [type(model).__name__]
    forward_loop = _calibration_loop(
        model, src, calib_texts, max_len=max_len, device=device, progress=progress
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mtq.quantize(model, recipe, forward_loop)
        except RuntimeError as exc:
            if "cuda" in str(exc).lower():
                raise EnvironmentMissing(
                    f"{fmt.upper()} calibration needs CUDA in this ModelOpt version ({str(exc)[:120]})",
                    hint="build on a GPU machine, or use --quant fp8",
                ) from exc
            raise
        tmp_out = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp_out, ignore_errors=True)
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=tmp_out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (tmp_out / name).exists():
            shutil.copy2(src / name, tmp_out / name)
    tmp_out.rename(out)
    hq = json.loads((out / "hf_quant_config.json").read_text())
    if hq.get("quantization", {}).get("quant_algo") is None:
        raise DFlashTrtError(
            f"ModelOpt export in {out} carries no quant_algo", hint="report this with the logs"
        )
    return {"hf_quant_config": hq, "calibration_samples": len(calib_texts), "recipe": RECIPE_NAMES[fmt]}


def _calibration_loop(
    model: Any, src: Path, texts: list[str], *, max_len: int, device: str,
    progress: Callable[[int, int], None] | None,
) -> Callable[[Any], None]:  # fmt: skip
    """ModelOpt's forward_loop: every calibration text (the checkpoint's tokenizer, else bytes
    modulo the vocabulary), at most max_len tokens each, through the model being calibrated."""
    import torch
    from transformers import AutoTokenizer

    has_tokenizer = (src / "tokenizer_config.json").is_file() or (src / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(src) if has_tokenizer else None
    vocab = model.get_input_embeddings().weight.shape[0]

    def batches():
        for text in texts:
            if tokenizer is not None:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_len]
            else:
                ids = [b % vocab for b in text.encode()][:max_len]
            if ids:
                yield torch.tensor([ids], device=device)

    def forward_loop(m: Any) -> None:
        items = list(batches())
        for i, ids in enumerate(items):
            with torch.no_grad():
                m(ids)
            if progress is not None:
                progress(i + 1, len(items))

    return forward_loop


def quantize_drafter_fp8(src: Path, out: Path) -> dict[str, Any]:
    """Calibration-free FP8 (E4M3, per-tensor) weight quantization of a DFlash drafter, written in the
    z-lab layout plus `weight_scale` tensors and an hf_quant_config.json (FP8 weights, no activation
    scales). The embedded engine dequantizes on load."""
    import torch
    from safetensors.torch import save_file

    from dflash_trt.models.checkpoint import read_safetensors

    state = read_safetensors(src, what="drafter weights")
    out_tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(out_tmp, ignore_errors=True)
    out_tmp.mkdir(parents=True)
    quantized: dict[str, torch.Tensor] = {}
    count = 0
    fp8_max = float(torch.finfo(torch.float8_e4m3fn).max)
    for name, tensor in state.items():
        if name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name:
            w = tensor.float()
            scale = (w.abs().max() / fp8_max).clamp(min=1e-12)
            quantized[name] = (w / scale).to(torch.float8_e4m3fn)
            quantized[name[: -len("weight")] + "weight_scale"] = scale.reshape(())
            count += 1
        else:
            quantized[name] = tensor
    save_file(quantized, str(out_tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "ignore": ["norm", "hidden_norm"],
    }
    (out_tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    hq = {"producer": {"name": "dflash-trt", "version": "weight-only"},
          "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["*norm*"]}}  # fmt: skip
    (out_tmp / "hf_quant_config.json").write_text(json.dumps(hq, indent=2) + "\n")
    out_tmp.rename(out)
    return {"quantized_tensors": count, "format": "fp8 weight-only"}
