# SPDX-License-Identifier: Apache-2.0
"""GPU profiles: what each deployment target supports and the defaults TensorRT-LLM recipes use.

Numbers are public per-GPU specifications (HBM capacity as usable by a process is lower; the memory
check applies a utilisation fraction). Quantisation support follows TensorRT-LLM's feature
matrix: FP8 compute needs sm89+, NVFP4 W4A4 needs Blackwell (sm100/103/120), MXFP4 weights run as
W4A16 on Hopper (Triton MoE) and natively on Blackwell.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass

from dflash_trt.errors import UsageError


@dataclass(frozen=True)
class GpuProfile:
    name: str
    sm: int  # compute capability * 10
    memory_gb: float  # HBM per GPU
    bandwidth_tbs: float  # HBM bandwidth per GPU
    fp8: bool
    nvfp4: bool  # NVFP4 W4A4 (Blackwell)
    mxfp4: str  # how MXFP4 weights run: "native" | "w4a16" | "none"
    gpt_oss_moe_backend: str | None  # TensorRT-LLM MoE backend for gpt-oss
    kv_cache_dtype: str  # recommended KV-cache dtype
    per_node: int  # GPUs per node in the usual system (HGX/DGX 8, NVL72 trays 4)
    product_label: str | None  # nvidia.com/gpu.product label (GPU feature discovery)

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"

    @property
    def is_blackwell(self) -> bool:
        return self.sm >= 100

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("a100", 80, 80, 2.0, False, False, "none", None, "auto", 8, "NVIDIA-A100-SXM4-80GB"),
        GpuProfile("h100", 90, 80, 3.35, True, False, "w4a16", "TRITON", "auto", 8, "NVIDIA-H100-80GB-HBM3"),
        GpuProfile("h200", 90, 141, 4.8, True, False, "w4a16", "TRITON", "auto", 8, "NVIDIA-H200"),
        GpuProfile("b200", 100, 180, 8.0, True, True, "native", "TRTLLM", "fp8", 8, "NVIDIA-B200"),
        GpuProfile("b300", 103, 288, 8.0, True, True, "native", "TRTLLM", "fp8", 8, "NVIDIA-B300-SXM6-AC"),
        GpuProfile("gb200", 100, 186, 8.0, True, True, "native", "TRTLLM", "fp8", 4, "NVIDIA-GB200"),
        GpuProfile("gb300", 103, 288, 8.0, True, True, "native", "TRTLLM", "fp8", 4, "NVIDIA-GB300"),
        GpuProfile("cpu", 0, 0, 0.0, False, False, "none", None, "auto", 1, None),
    )
}

# nvidia-smi product name fragments -> profile (checked in order)
_DETECT = (("GB300", "gb300"), ("GB200", "gb200"), ("B300", "b300"), ("B200", "b200"), ("H200", "h200"),
           ("H100", "h100"), ("A100", "a100"))  # fmt: skip


def get_profile(name: str) -> GpuProfile:
    key = name.lower()
    if key not in PROFILES:
        raise UsageError(f"--gpu={name!r} is not a known profile", hint=f"use one of {', '.join(PROFILES)}")
    return PROFILES[key]


def detect_gpu() -> tuple[GpuProfile, int] | None:
    """(profile, GPU count) from nvidia-smi, or None when there is no NVIDIA GPU or it is unknown."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        return None
    for fragment, profile in _DETECT:
        if fragment in names[0].upper():
            return PROFILES[profile], len(names)
    return None
