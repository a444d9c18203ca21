# SPDX-License-Identifier: Apache-2.0
"""Named model shapes with random weights, for benchmarks beyond the packaged `tiny` pair.

A shape is a Qwen3 target config plus a DFlash drafter config of the same hidden size, both in
the transformers / z-lab layout, so that the engine, transformers and the authors' `dflash`
package load them through their ordinary checkpoint code. Nothing is downloaded.

`write_pair(shape, out)` writes the two directories (config.json, a byte-level tokenizer, and
either random safetensors weights or, with weights="on-load", only a marker). Inside
`random_weights_on_load()`, the checkpoint readers return fresh random tensors for directories
that carry the marker, created directly on the marker's device: a Qwen3-8B shape then costs no
16 GB write and read.

Random weights: every matrix ~ N(0, std^2), RMSNorm weights 1, biases 0; seeded per tensor name,
so a pair is the same on every run and machine (for a given device type).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MARKER = "random_weights.json"
BYTE_VOCAB_MIN = 260  # the byte tokenizer's 256 bytes + 4 special tokens


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    draft_layers: int
    block_size: int = 16
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    target_layer_ids: tuple[int, ...] = field(default=())

    def target_config(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "eos_token_id": 256,  # the byte tokenizer's <|endoftext|>
            "pad_token_id": None,
            "bos_token_id": None,
        }

    def layer_ids(self) -> list[int]:
        """The target layers the drafter reads: given, or spread evenly as the authors' recipe does."""
        if self.target_layer_ids:
            return list(self.target_layer_ids)
        n = self.draft_layers
        if n == 1:
            return [self.layers // 2]
        start, end = 1, self.layers - 3
        return [round(start + i * (end - start) / (n - 1)) for i in range(n)]

    def drafter_config(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.vocab - 1, "target_layer_ids": self.layer_ids()},
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.draft_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "layer_types": ["full_attention"] * self.draft_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "num_target_layers": self.layers,
            "tie_word_embeddings": False,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab,
        }


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            name="qwen3-0.3b",
            description="~0.34 B Qwen3 (Qwen3-0.6B widths, 12 layers, tied embeddings) + 1-layer drafter",
            vocab=151936,
            hidden=1024,
            intermediate=3072,
            layers=12,
            heads=16,
            kv_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            draft_layers=1,
            target_layer_ids=(1, 4, 7, 10),
        ),
        Shape(
            name="qwen3-8b",
            description="Qwen3-8B (36 layers, hidden 4096, untied) + 5-layer drafter as z-lab's Qwen3-8B-DFlash",
            vocab=151936,
            hidden=4096,
            intermediate=12288,
            layers=36,
            heads=32,
            kv_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            draft_layers=5,
            target_layer_ids=(1, 9, 17, 25, 33),
        ),
        Shape(
            name="toy",
            description="a few-MB random Qwen3 for tests of the benchmark scripts themselves",
            vocab=300,
            hidden=64,
            intermediate=96,
            layers=4,
            heads=4,
            kv_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            draft_layers=1,
            block_size=8,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            target_layer_ids=(1, 2),
        ),
    )
}


def get_shape(name: str) -> Shape:
    from dflash_trt.errors import ConfigError

    if name not in SHAPES:
        raise ConfigError("shape", name, f"is not a known shape (known: {', '.join(SHAPES)})")
    return SHAPES[name]


def parameter_count(shape: Shape) -> dict[str, int]:
    """Parameters of the target (tied embeddings counted once) and of the drafter."""
    state = _meta_states(shape)
    return {part: sum(t.numel() for t in s.values()) for part, s in state.items()}


def _meta_states(shape: Shape) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter names and shapes of the pair, from the engine's own modules on the meta device."""
    import torch

    from dflash_trt.models.decoder import NativeTarget
    from dflash_trt.models.dflash_config import parse_dflash_config
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target_config import parse_target_config

    tcfg = parse_target_config(shape.target_config())
    with torch.device("meta"):
        target = NativeTarget(tcfg).state_dict()
        drafter = DFlashDrafter(parse_dflash_config(hf_config=shape.drafter_config())).state_dict()
    if tcfg.tie_word_embeddings:
        target.pop("lm_head.weight", None)
    target = {k: v for k, v in target.items() if not k.endswith("rotary_emb.inv_freq")}
    return {"target": target, "drafter": drafter}


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


def random_state(
    meta: dict[str, torch.Tensor], *, device: str, dtype: torch.dtype, seed: int, std: float
) -> dict[str, torch.Tensor]:
    """Random tensors for every name in `meta`, made on `device` (see the module docstring)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in meta.items():
        leaf = name.rsplit(".", 2)
        if "norm" in leaf[-2] and leaf[-1] == "weight":
            out[name] = torch.ones(t.shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(t.shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
            x = torch.randn(t.shape, generator=gen, dtype=torch.float32, device=device)
            out[name] = x.mul_(std).to(dtype)
    return out


def write_pair(
    shape: Shape,
    out: str | Path,
    *,
    weights: str = "files",
    dtype: str = "bfloat16",
    seed: int = 0,
    std: float = 0.02,
    device: str = "cpu",
) -> tuple[Path, Path]:
    """Write `out/target` and `out/drafter`; return their paths.

    weights="files": random model.safetensors in `dtype` (made on the CPU), loadable by anything.
    weights="on-load": only the configs and a marker; the weights are made on `device` when the
    engine loads the directory inside `random_weights_on_load()` (the engine alone can load them).
    """
    import torch

    from dflash_trt.tiny import build_byte_tokenizer

    if weights not in ("files", "on-load"):
        raise ValueError(f"weights={weights!r}: use 'files' or 'on-load'")
    if shape.vocab < BYTE_VOCAB_MIN:
        raise ValueError(f"shape {shape.name}: vocab {shape.vocab} < {BYTE_VOCAB_MIN} (byte tokenizer)")
    root = Path(out)
    tdir, ddir = root / "target", root / "drafter"
    metas = _meta_states(shape)
    torch_dtype = getattr(torch, dtype)
    for part, directory, cfg in (
        ("target", tdir, shape.target_config()),
        ("drafter", ddir, shape.drafter_config()),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        cfg = {**cfg, "dtype": dtype}
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        part_seed = seed + (0 if part == "target" else 1)
        spec: dict[str, Any] = {"part": part, "seed": part_seed, "std": std, "dtype": dtype}
        if weights == "files":
            from safetensors.torch import save_file

            state = random_state(metas[part], device="cpu", dtype=torch_dtype, seed=part_seed, std=std)
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            (directory / MARKER).write_text(
                json.dumps({**spec, "device": device, "shape": shape.name}) + "\n"
            )
    (tdir / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}) + "\n")
    build_byte_tokenizer().save_pretrained(tdir)
    return tdir, ddir


@contextlib.contextmanager
def random_weights_on_load() -> Iterator[None]:
    """While active, a checkpoint directory holding the marker reads as fresh random weights made on
    the marker's device (in the marker's dtype); other directories load from their files."""
    import torch

    from dflash_trt.models import checkpoint, loader

    real = checkpoint.read_safetensors

    def read(directory: Path, *, what: str) -> dict[str, torch.Tensor]:
        marker = Path(directory) / MARKER
        if not marker.is_file():
            return real(directory, what=what)
        spec = json.loads(marker.read_text())
        metas = _meta_states(SHAPES[spec["shape"]])
        return random_state(
            metas[spec["part"]],
            device=spec["device"],
            dtype=getattr(torch, spec["dtype"]),
            seed=int(spec["seed"]),
            std=float(spec["std"]),
        )

    saved = (checkpoint.read_safetensors, loader.read_safetensors)
    checkpoint.read_safetensors = read
    loader.read_safetensors = read
    try:
        yield
    finally:
        checkpoint.read_safetensors, loader.read_safetensors = saved
