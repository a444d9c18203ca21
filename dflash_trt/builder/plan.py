# SPDX-License-Identifier: Apache-2.0
"""Build plans: everything `dflash-trt build` will do, decided and validated before any heavy work.

`make_plan(request)` resolves the models, checks the pair, picks the GPU profile, quantization and
limits, and composes the LLM-API config and Triton settings. It reads configs only (no weights),
so `--dry-run` is cheap. `dflash_trt.builder.writer.write_bundle(plan)` then does the heavy work.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt import __version__
from dflash_trt.bundle import SCHEMA_VERSION
from dflash_trt.errors import UsageError

MODEL_NAME = "tensorrt_llm"
CHECKPOINTS = "engine/checkpoints"
GUIDED_DECODING_BACKEND = "xgrammar"  # the LLM-API's guided_decoding_backend (TensorRT-LLM's and ours)


def guided_decoding_args(req: BuildRequest) -> dict[str, str]:
    """The LLM-API arguments that let the model serve structured outputs (none with --no-guided-decoding)."""
    return {"guided_decoding_backend": GUIDED_DECODING_BACKEND} if req.guided_decoding else {}


def bundle_files(*, serve_script: bool) -> dict[str, str]:
    """What a bundle holds, by role: the relative path of each file (the serve script only for
    TensorRT-LLM bundles)."""
    files = {"manifest": "manifest.json", "llm_api": "engine/llm_api.yaml"}
    if serve_script:
        files["serve_script"] = "engine/serve-trtllm.sh"
    files.update(
        model_repository="model_repository",
        helm_values="helm-values.yaml",
        bench_plan="bench-plan.yaml",
        readme="BUNDLE.md",
    )
    return files


@dataclass
class BuildRequest:
    """The user's inputs (CLI flags), recorded verbatim in the manifest."""

    target: str
    drafter: str | None = None
    gpu: str | None = None  # profile name; None = auto-detect (nvidia-smi) or cpu
    tp: int = 1
    ep: int = 1
    quant: str = "auto"  # auto | none | fp8 | nvfp4
    kv_cache_dtype: str = "auto"  # auto | fp8
    block_size: int | None = None
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    backend: str | None = None  # trtllm | torch; None = trtllm on GPUs, torch on cpu
    quantize_drafter: bool = False
    calib_data: str | None = None
    calib_samples: int = 64
    offline: bool = False
    device: str | None = None  # torch backend: where the embedded engine runs (auto/cpu/cuda)
    no_remote_code: bool = False  # refuse a plan that needs trust_remote_code (builder/remote_code.py)
    tree_budget: int | str | None = None  # torch backend: DDTree nodes per round (0 = linear), or "auto"
    prefix_caching: bool = True  # kv_cache_config.enable_block_reuse
    guided_decoding: bool = True  # guided_decoding_backend: xgrammar (structured outputs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["tree_budget"] is None:  # an extension recorded only when asked for (older manifests lack it)
            del out["tree_budget"]
        # recorded only when turned off (older manifests lack them)
        for key in ("prefix_caching", "guided_decoding"):
            if out[key]:
                del out[key]
        return out


@dataclass
class BuildPlan:
    request: BuildRequest
    name: str
    backend: str
    target: dict[str, Any]
    drafter: dict[str, Any]
    speculative: dict[str, Any]
    gpu: dict[str, Any]
    quantization: dict[str, Any]
    limits: dict[str, Any]
    llm_api: dict[str, Any]
    triton_config: dict[str, Any]
    serving: dict[str, Any]
    validation: dict[str, Any]
    files: dict[str, str]
    copies: dict[str, str] = field(default_factory=dict)  # bundle-relative dest -> source dir
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # which copy of each config.json the plan read (shipped, Hub, cache, ...): provenance, not plan
    config_sources: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)  # provenance warnings, printed, not part of the plan

    def manifest(self) -> dict[str, Any]:
        """manifest.json content (schema_version 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "backend": self.backend,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "inputs": self.request.to_dict(),
            "target": self.target,
            "drafter": self.drafter,
            "speculative": self.speculative,
            "gpu": self.gpu,
            "quantization": self.quantization,
            "limits": self.limits,
            "serving": self.serving,
            "validation": self.validation,
            "files": self.files,
            "versions": versions(),
            "config_sources": self.config_sources,
            "notes": self.notes,
            "warnings": self.warnings,
        }

    def to_json(self) -> dict[str, Any]:
        """The `--dry-run --json` plan: the manifest plus the LLM-API config and the file list."""
        out = self.manifest()
        out.pop("created_utc")
        out["llm_api"] = self.llm_api
        out["triton_config"] = self.triton_config
        produced = {
            ref
            for ref in (self.target.get("ref"), self.drafter.get("ref"))
            if str(ref).startswith(CHECKPOINTS)
        }
        out["will_write"] = sorted(set(self.files.values()) | set(self.copies) | produced)
        return out


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"dflash_trt": __version__}
    for dist in ("torch", "transformers", "nvidia-modelopt", "tensorrt_llm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def bundle_name(target: str) -> str:
    name = Path(target).name if Path(target).exists() else target.split("/")[-1]
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or "bundle"


def check_output(output: Path | None, force: bool) -> None:
    if output is None:
        raise UsageError("--output is required to write a bundle", hint="pass --output DIR (or --dry-run)")
    if output.exists() and not force:
        if (output / "manifest.json").is_file():
            raise UsageError(
                f"--output={str(output)!r} already holds a bundle", hint="pass --force to replace it"
            )
        if any(output.iterdir()):
            raise UsageError(
                f"--output={str(output)!r} exists and is not empty",
                hint="choose a new directory or pass --force",
            )
