# SPDX-License-Identifier: Apache-2.0
"""write_bundle: do the heavy work of a plan into a temporary directory, then rename it into place.

An interrupted or failed build leaves no partial bundle (and an existing bundle untouched); a
re-run with --force rebuilds the same content.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trt.builder.plan import BuildPlan, check_output
from dflash_trt.errors import DFlashTrtError
from dflash_trt.utils.interrupts import check_interrupted, noted_interrupts
from dflash_trt.utils.io import atomic_dir, dump_json, dump_yaml

log = logging.getLogger(__name__)

CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)


def link_or_copy_tree(src: Path, dest: Path) -> int:
    """Hard-link (same filesystem) or copy the checkpoint files of `src` into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for pattern in CHECKPOINT_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if not f.is_file():
                continue
            target = dest / f.name
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
            n += 1
    if n == 0:
        raise DFlashTrtError(f"{src} holds no checkpoint files", hint="check the model directory")
    return n


def materialise(ref: str, *, offline: bool, hub_down: str | None = None) -> Path:
    """A local directory for `ref`: itself, its Hugging Face cache snapshot, or a download (with progress).

    `offline` (--offline or HF_HUB_OFFLINE) never downloads; `hub_down` (the planner's network failure)
    fails at once with that cause instead of waiting for huggingface_hub's retries.
    """
    p = Path(ref)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    from dflash_trt.builder import hub

    patterns = list(CHECKPOINT_PATTERNS)
    no_network = "--offline" if offline else "HF_HUB_OFFLINE=1" if hub.env_offline() else None
    if no_network or hub_down:
        try:
            return Path(snapshot_download(ref, allow_patterns=patterns, local_files_only=True))
        except Exception:
            fix = (
                f"fill the Hugging Face cache on a connected machine (hf download {ref}), use a Hub mirror "
                "(HF_ENDPOINT), or pass a local checkpoint directory"
            )
            if no_network:
                raise DFlashTrtError(
                    f"the weights of {ref} are not in the Hugging Face cache and {no_network} forbids "
                    "downloading",
                    hint=fix,
                ) from None
            raise DFlashTrtError(f"cannot download the weights of {ref}: {hub_down}", hint=fix) from None
    _say(f"downloading {ref} (checkpoint files only)")
    try:
        return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as exc:
        raise DFlashTrtError(f"cannot fetch {ref}: {type(exc).__name__}: {str(exc)[:200]}",
                             hint="check the network and HF_TOKEN, or pass a local directory") from exc  # fmt: skip


def _hub_down(plan: BuildPlan) -> str | None:
    """The network failure the planner met (it then used shipped configs), if any."""
    for source in plan.config_sources.values():
        reason = str(source.get("reason") or "")
        if source.get("source") == "shipped" and reason.startswith("cannot reach"):
            return reason
    return None


def serve_script(plan: BuildPlan) -> str:
    gpu = plan.gpu
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            f"# Launch trtllm-serve for bundle {plan.name} (written by dflash-trt; needs TensorRT-LLM "
            f">= {plan.serving.get('trtllm_min_version')}).",
            "# OpenAI-compatible endpoints on $PORT; the Triton route is `dflash-trt serve --bundle` or the chart.",
            "set -euo pipefail",
            'cd "$(dirname "$0")/.."',
            'HOST="${HOST:-0.0.0.0}"',
            'PORT="${PORT:-8000}"',
            f"exec trtllm-serve {plan.llm_api['model']} --backend pytorch --tp_size {gpu['tp']} "
            f'--ep_size {gpu["ep"]} --config engine/llm_api.yaml --host "$HOST" --port "$PORT" "$@"',
            "",
        ]
    )


def bench_plan(plan: BuildPlan) -> dict[str, Any]:
    """A `dflash-trt bench sweep --spec` for this deployment: DFlash vs plain decoding."""
    tokenizer = plan.llm_api.get("tokenizer") or plan.llm_api["model"]
    gpus = max(1, plan.gpu.get("count") or 1)
    on_gpu = plan.backend == "trtllm" or plan.gpu.get("count")
    conc = [1, 2, 4, 8, 16, 32, 64] if on_gpu else [1, 2, 4, 8, 16]
    isl, osl = (1024, 1024) if on_gpu else (128, 64)
    return {
        "description": f"{plan.name}: DFlash vs plain decoding over Triton gRPC, ISL {isl} / OSL {osl}",
        "defaults": {
            "protocol": "triton-grpc",
            "model": plan.serving["model_name"],
            "tokenizer": tokenizer,
            "isl": isl,
            "osl": osl,
            "concurrency": conc,
            "num-requests": 10 * max(conc),
            "warmup": 2 * max(conc) if on_gpu else 4,
            "temperature": 0.0,
            "ignore-eos": True,
            "num-gpus": gpus,
            "meta": {
                "bundle": plan.name,
                "backend": plan.backend,
                "gpu": plan.gpu["profile"],
                "block_size": plan.speculative["block_size"],
            },
        },
        "runs": [
            {"label": "DFlash", "url": "127.0.0.1:8001", "out": f"bench/runs/{plan.name}/dflash"},
            {"label": "AR", "url": "127.0.0.1:8011", "out": f"bench/runs/{plan.name}/ar"},
        ],
    }


def bundle_readme(plan: BuildPlan) -> str:
    lines = [
        f"# dflash-trt bundle: {plan.name}",
        "",
        f"- backend: **{plan.backend}** ({plan.serving['engine']}); GPU profile {plan.gpu['profile']}, "
        f"{plan.gpu['count']} GPU(s), TP {plan.gpu['tp']}",
        f"- target: `{plan.target['ref']}` ({plan.target['architecture']}, {plan.quantization['target']['format']})",
        f"- drafter: `{plan.drafter['ref']}` (block {plan.speculative['block_size']}, "
        f"max_draft_len {plan.speculative['max_draft_len']})",
        "",
        "Serve it:",
        "",
        "    dflash-trt serve --bundle .            # Triton (HTTP 8000, gRPC 8001, metrics 8002)",
    ]
    if plan.backend == "trtllm":
        lines.append("    engine/serve-trtllm.sh                 # trtllm-serve, OpenAI-compatible")
    lines += [
        "    dflash-trt chart --bundle . --lint     # Helm values for helm/dflash-trt",
        "    dflash-trt bench sweep --spec bench-plan.yaml",
        "",
        "Notes:",
        "",
        *[f"- {n}" for n in plan.notes],
        "",
    ]
    return "\n".join(lines)


def write_bundle(
    plan: BuildPlan,
    output: Path,
    *,
    force: bool = False,
    progress: Callable[[str], None] = _say,
) -> dict[str, Any]:
    """Build the bundle in a temporary sibling of `output` and rename it into place. Ctrl-C at any
    point leaves no bundle: the step boundaries check for an interrupt that a library swallowed."""
    check_output(output, force)
    report: dict[str, Any] = {}
    with noted_interrupts(), atomic_dir(output, overwrite=force) as tmp:
        for rel, src in plan.copies.items():
            progress(f"linking {src} -> {rel}")
            link_or_copy_tree(
                materialise(src, offline=plan.request.offline, hub_down=_hub_down(plan)), tmp / rel
            )
            check_interrupted()
        target_report = _quantize_target(plan, tmp, progress)
        check_interrupted()
        if target_report is not None:
            report["target_quantization"] = target_report
        if plan.quantization["drafter"]["format"] == "fp8":
            report["drafter_quantization"] = _quantize_drafter(plan, tmp, progress)
            check_interrupted()
        manifest = _write_files(plan, tmp, report, progress)
        check_interrupted()  # the last chance before the rename commits the bundle
    progress(f"bundle written to {output}")
    return manifest


def _quantize_target(plan: BuildPlan, tmp: Path, progress: Callable[[str], None]) -> dict[str, Any] | None:
    """ModelOpt quantization of the target into the bundle, when the plan asks for it."""
    qt = plan.quantization["target"]
    if qt["source"] == "mxfp4-cast":
        raise DFlashTrtError(
            "the MXFP4 -> NVFP4 cast loads the whole target; run this build on a machine that holds it "
            "(ModelOpt hf_ptq.py --qformat nvfp4_mlp_only --cast_mxfp4_to_nvfp4), or keep native MXFP4",
            hint="use --dry-run here to get the plan, or drop --quant nvfp4",
        )
    if qt["source"] != "modelopt":
        return None
    from dflash_trt.builder.quant import load_calibration, quantize_checkpoint

    rel = plan.llm_api["model"]
    src = (plan.target["kind"] == "hf" and plan.target["hf_id"]) or plan.target["path"]
    src_dir = materialise(src, offline=plan.request.offline, hub_down=_hub_down(plan))
    texts = load_calibration(plan.request.calib_data, plan.request.calib_samples)
    progress(f"quantizing {src} to {qt['format'].upper()} with ModelOpt ({len(texts)} calibration samples)")
    bar = _progress_bar(len(texts), "calibration")

    def tick(done: int, total: int) -> None:
        if bar is not None:
            bar.n = done
            bar.refresh()

    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
    try:
        return quantize_checkpoint(
            src_dir, tmp / rel, fmt=qt["format"], kv_fp8=qt["kv_cache"] == "fp8", calib_texts=texts,
            device="cuda" if plan.gpu.get("count") and _cuda() else "cpu", progress=tick,
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()


def _quantize_drafter(plan: BuildPlan, tmp: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    from dflash_trt.builder.quant import quantize_drafter_fp8

    rel = plan.drafter["ref"]
    assert plan.drafter.get("path") or plan.drafter.get("hf_id")
    drafter_dir = materialise(
        plan.drafter.get("path") or plan.drafter["hf_id"],
        offline=plan.request.offline,
        hub_down=_hub_down(plan),
    )
    progress(f"quantizing the drafter to FP8 (weight-only) -> {rel}")
    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
    return quantize_drafter_fp8(drafter_dir, tmp / rel)


def _write_files(
    plan: BuildPlan, tmp: Path, report: dict[str, Any], progress: Callable[[str], None]
) -> dict[str, Any]:
    """The LLM arguments, the serve script (trtllm), the Triton repository, manifest.json (the seam),
    the Helm values, the bench plan and BUNDLE.md; returns the manifest."""
    from dflash_trt.deploy.chart import helm_values_from_manifest
    from dflash_trt.triton.repository import render_repository

    (tmp / "engine").mkdir(exist_ok=True)
    header = "# LLM-API arguments written by dflash-trt build; TensorRT-LLM field names.\n"
    (tmp / plan.files["llm_api"]).write_text(header + dump_yaml(plan.llm_api))
    if "serve_script" in plan.files:
        script = tmp / plan.files["serve_script"]
        script.write_text(serve_script(plan))
        script.chmod(0o755)
    progress("rendering the Triton model repository")
    render_repository(
        tmp / plan.files["model_repository"], llm_args=plan.llm_api, triton_config=plan.triton_config
    )
    manifest = plan.manifest()
    manifest["build_report"] = report
    (tmp / plan.files["manifest"]).write_text(dump_json(manifest))
    (tmp / plan.files["helm_values"]).write_text(
        f"# Helm values for bundle {plan.name} (dflash-trt build). helm install -f helm-values.yaml ...\n"
        + dump_yaml(helm_values_from_manifest(manifest))
    )
    (tmp / plan.files["bench_plan"]).write_text(
        "# dflash-trt bench sweep --spec bench-plan.yaml (start the servers first; see the URLs)\n"
        + dump_yaml(bench_plan(plan))
    )
    (tmp / plan.files["readme"]).write_text(bundle_readme(plan))
    return manifest


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False
