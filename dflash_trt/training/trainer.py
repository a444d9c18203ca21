# SPDX-License-Identifier: Apache-2.0
"""`train-drafter`: train a DFlash drafter for a frozen target (dflash-algorithm.md §7).

The target is frozen and shares its embedding and LM head (also frozen) with the drafter; only
`fc`, `hidden_norm`, the draft layers and `norm` train. Each step: the target runs once over the
batch (no grad) to give the features at `target_layer_ids` (or they come from --feature-cache, computed
once per sample); fresh anchors per sample and epoch;
one training forward over all blocks (training.forward); the decayed cross entropy; AdamW with
linear warm-up and cosine decay, gradient clip 1.0. In a bf16 run the drafter's math runs under autocast
(fp32 master weights) on every device; `fc` trains on per-channel scaled features, folded back on export
(--feature-scaling, training/feature_scale.py); the softmax runs over the tokens the samples hold
(--loss-vocab data, training.forward.LossVocab), drafting always over the whole head.

Output directory (`--out`):
  config.json, model.safetensors   the drafter in the z-lab layout, rewritten at every checkpoint
  train_state.pt                   drafter + optimizer + step, for --resume
  train_args.json                  the resolved configuration of the run
  train_log.jsonl                  one line per logged step (loss, tau estimate, lr, ...)
  eval.json                        tau on held-out prompts, measured at the end
  regenerated/                     the --regenerate cache
Every random choice (order, anchors) is a function of (seed, epoch, sample), so a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_trt.errors import UsageError
from dflash_trt.training.data import Record, Sample

if TYPE_CHECKING:
    from dflash_trt.models.dflash_config import DFlashConfig, TargetInfo
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.training.feature_cache import FeatureCache
    from dflash_trt.training.forward import LossVocab

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
ARGS_FILE = "train_args.json"
LOG_FILE = "train_log.jsonl"
EVAL_FILE = "eval.json"
# Fields that may differ when resuming (they do not change what has been trained so far).
RESUMABLE_CHANGES = frozenset(
    {"steps", "epochs", "out", "save_every", "log_every", "eval_prompts", "eval_data", "eval_max_new_tokens",
     "device", "regen_cache", "regen_batch_size", "feature_cache"}
)  # fmt: skip
# What a saved run that predates a field was trained with.
LEGACY_VALUES: Mapping[str, Any] = {"feature_scaling": False, "loss_vocab": "full"}
LOSS_VOCABS = ("data", "full")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything `train-drafter` is told. None means "derive it" (see `resolve`)."""

    target: str
    data: str
    out: str
    drafter_config: str | None = None  # a z-lab config.json (file or directory) to start from
    num_layers: int | None = None  # default 5 (the published drafters), at most T // 4, at least 1
    block_size: int | None = None  # default 16
    target_layer_ids: tuple[int, ...] | None = None  # default build_target_layer_ids(T, L)
    mask_token_id: int | None = None  # default <|MASK|>, else the first embedding row past the tokenizer
    dflash2: bool = False  # a DFlash2DraftModel (convs + selector); also implied by --drafter-config
    conv_kernel_size: int | None = None  # DFlash 2; default from --drafter-config, else the published 2
    conv_group_size: int | None = None  # DFlash 2; default 16
    selector_rank: int | None = None  # DFlash 2; default 256
    selector_top_k: int | None = None  # DFlash 2; default 16
    selector_loss_weight: float = 1.0  # DFlash 2: weight of the selector's K-way cross entropy
    feature_scaling: bool = True  # fc trains on per-channel scaled features (training/feature_scale.py)
    loss_vocab: str = "data"  # the softmax over the samples' tokens, or the whole head (LossVocab)
    num_anchors: int = 512
    gamma: float = 7.0
    seq_len: int = 2048
    batch_size: int = 8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    steps: int | None = None
    epochs: int | None = None  # default 6 when --steps is not given
    max_samples: int | None = None
    regenerate: bool = False
    regen_temperature: float = 0.0
    regen_top_p: float = 1.0
    regen_prompt_len: tuple[int, int] = (16, 256)
    regen_batch_size: int = 32
    regen_cache: str | None = None  # default: OUT/regenerated
    feature_cache: str | None = (
        None  # the target's features per sample, kept here (training/feature_cache.py)
    )
    eval_prompts: int = 16
    eval_data: str | None = None
    eval_max_new_tokens: int = 128
    save_every: int = 500
    log_every: int = 10
    save_dtype: str = "float32"
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    resume: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids else None
        d["regen_prompt_len"] = list(self.regen_prompt_len)
        return d


@dataclass
class TrainResult:
    out: Path
    steps: int
    final_loss: float
    eval: dict[str, Any] | None
    seconds: float
    log: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------
def resolve_mask_token_id(tokenizer: Any, vocab_rows: int, explicit: int | None) -> int:
    """--mask-token-id, else the tokenizer's <|MASK|>, else the first embedding row beyond the
    tokenizer (how the Qwen3 drafters got 151669): it must be a row of the target embedding."""
    if explicit is not None:
        mask = explicit
    else:
        mask = -1
        if tokenizer is not None:
            tid = tokenizer.convert_tokens_to_ids("<|MASK|>")
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                mask = tid
            elif len(tokenizer) < vocab_rows:
                mask = len(tokenizer)
        if mask < 0:
            raise UsageError(
                "cannot pick a mask token: the tokenizer has no <|MASK|> and no spare embedding row",
                hint="pass --mask-token-id ID (a row of the target embedding the data never uses)",
            )
    if not 0 <= mask < vocab_rows:
        raise UsageError(
            f"--mask-token-id={mask} is not a row of the target embedding (vocab_size={vocab_rows})",
            hint=f"pick an id in [0, {vocab_rows})",
        )
    return mask


def build_drafter_hf_config(
    target_cfg: dict[str, Any],
    *,
    base: dict[str, Any] | None,
    num_layers: int | None,
    block_size: int | None,
    target_layer_ids: Sequence[int] | None,
    mask_token_id: int,
    dflash2: Mapping[str, int | None] | None = None,
) -> dict[str, Any]:
    """The drafter's z-lab config.json: shapes from the target (hidden size must match; heads,
    FFN and RoPE mirror it, as in the released drafters), then --drafter-config, then flags.
    `dflash2` (the four DFlash 2 keys, None = from --drafter-config, else the published values) makes
    it a DFlash2DraftModel."""
    from dflash_trt.models.dflash2_config import PUBLISHED
    from dflash_trt.models.features import build_target_layer_ids

    text = target_cfg.get("text_config") or target_cfg
    t_layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(text["hidden_size"]),
        "intermediate_size": int(text.get("intermediate_size") or 4 * int(text["hidden_size"])),
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
        "vocab_size": int(text["vocab_size"]),
        "num_target_layers": t_layers,
    }
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if text.get(key) is not None:
            cfg[key] = text[key]
    if base:
        cfg.update({k: v for k, v in base.items() if k not in ("dflash_config",)})
    cfg["architectures"] = ["DFlash2DraftModel" if dflash2 is not None else "DFlashDraftModel"]
    base_dflash = dict((base or {}).get("dflash_config") or {})
    layers = num_layers or int((base or {}).get("num_hidden_layers") or max(1, min(5, t_layers // 4)))
    cfg["num_hidden_layers"] = layers
    cfg["block_size"] = block_size or int(
        (base or {}).get("block_size") or base_dflash.get("block_size") or 16
    )
    base_dflash.pop("block_size", None)
    ids = target_layer_ids or base_dflash.get("target_layer_ids") or build_target_layer_ids(t_layers, layers)
    cfg["dflash_config"] = {**base_dflash, "mask_token_id": mask_token_id, "target_layer_ids": list(ids)}
    for key, default in PUBLISHED.items():
        if dflash2 is None:
            break
        top = cfg.pop(key, None)  # DFlash 2 keys live in dflash_config
        given = dflash2.get(key)
        cfg["dflash_config"][key] = given if given is not None else base_dflash.get(key, top or default)
    for key in ("layer_types",):  # a base config written for another depth cannot keep these
        if key in cfg and len(cfg[key]) != layers:
            cfg.pop(key)
    return cfg


def _read_drafter_config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(
            f"--drafter-config={path!r} is not a readable JSON file ({exc})",
            hint="pass a z-lab drafter config.json or its directory",
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"--drafter-config={path!r} is not a JSON object", hint="pass a config.json")
    return data


def _parse_prompt_len(value: tuple[int, int]) -> tuple[int, int]:
    lo, hi = value
    if not 1 <= lo <= hi:
        raise UsageError(
            f"--regen-prompt-len={lo}:{hi} needs 1 <= MIN <= MAX", hint="e.g. --regen-prompt-len 16:256"
        )
    return lo, hi


def validate(cfg: TrainConfig) -> None:
    """Flag-level checks that need no model (each names the flag, the value and the fix)."""
    checks: list[tuple[bool, str, str]] = [
        (cfg.steps is not None and cfg.epochs is not None, "--steps and --epochs are mutually exclusive",
         "pass one of them"),
        (cfg.block_size is not None and cfg.block_size < 2, f"--block-size={cfg.block_size} must be >= 2",
         "a block is one anchor plus at least one mask slot"),
        (cfg.num_anchors < 1, f"--num-anchors={cfg.num_anchors} must be >= 1", "e.g. --num-anchors 512"),
        (not cfg.gamma > 0, f"--gamma={cfg.gamma} must be > 0", "7 for block 16, 4 for block 8"),
        (not cfg.lr > 0, f"--lr={cfg.lr} must be > 0", "e.g. --lr 6e-4"),
        (cfg.seq_len < 4, f"--seq-len={cfg.seq_len} is too short", "e.g. --seq-len 2048"),
        (cfg.save_dtype not in ("float32", "bfloat16", "float16"),
         f"--save-dtype={cfg.save_dtype!r} is not supported", "use float32, bfloat16 or float16"),
        (cfg.eval_prompts < 0, f"--eval-prompts={cfg.eval_prompts} must be >= 0", "0 skips the evaluation"),
        (not cfg.selector_loss_weight >= 0, f"--selector-loss-weight={cfg.selector_loss_weight} must be >= 0",
         "1.0 weighs the selector's cross entropy like the drafter's"),
        (cfg.loss_vocab not in LOSS_VOCABS, f"--loss-vocab={cfg.loss_vocab!r} is not one of {LOSS_VOCABS}",
         "data (the samples' tokens) or full (the whole head)"),
    ]  # fmt: skip
    for bad, message, hint in checks:
        if bad:
            raise UsageError(message, hint=hint)
    block = cfg.block_size or 16
    if cfg.seq_len < block + 1:
        raise UsageError(
            f"--seq-len={cfg.seq_len} leaves no room for a block of {block}",
            hint=f"use --seq-len >= {block + 1}",
        )
    _parse_prompt_len(cfg.regen_prompt_len)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def _sample_order(n: int, *, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"order:{seed}:{epoch}").shuffle(order)
    return order


def _anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    digest = hashlib.sha256(f"anchors:{seed}:{epoch}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))


def _collate(samples: Sequence[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input_ids [bs, S] (right-padded), loss_mask [bs, S], lengths [bs]. Right padding never
    reaches a real position of a causal target."""
    s = max(len(x.input_ids) for x in samples)
    ids = torch.full((len(samples), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.long)
    for i, x in enumerate(samples):
        ids[i, : len(x.input_ids)] = torch.tensor(x.input_ids)
        mask[i, : len(x.loss_mask)] = torch.tensor(x.loss_mask)
    lengths = torch.tensor([len(x.input_ids) for x in samples])
    return ids, mask, lengths


@torch.no_grad()
def target_features(model: Any, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """input_ids: [bs, S] -> [bs, S, K * D]: target layer outputs (HF hidden_states[l + 1])."""
    from dflash_trt.models.features import extract_context_feature

    out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return extract_context_feature(out.hidden_states, layer_ids)


def _prepare_data(
    cfg: TrainConfig, tokenizer: Any, *, target_dir: Path, out: Path, block_size: int, eos_id: int | None,
    progress: bool, report: Callable[[dict[str, Any]], None] | None,
) -> tuple[list[Sample], list[list[int]]]:  # fmt: skip
    """Training samples (regenerated if asked) and held-out prompts for the final tau."""
    from dflash_trt.training import data as d

    records = d.load_records(cfg.data)
    if tokenizer is None:
        raise UsageError(
            f"--target={cfg.target!r} has no tokenizer, and --data is text",
            hint="save the target's tokenizer into its directory",
        )
    need_eval = cfg.eval_prompts if cfg.eval_data is None else 0
    train_records, heldout = d.split_heldout(records, num_heldout=need_eval, seed=cfg.seed)
    min_len = block_size + 1
    chat = [r for r in train_records if r.messages is not None]
    text = [r for r in train_records if r.messages is None]
    text_samples = d.build_samples(text, tokenizer, seq_len=cfg.seq_len, eos_id=eos_id, min_len=min_len)
    heldout_samples: list[Sample] = []
    if need_eval and not heldout:  # too few records to spare: hold out whole samples instead
        rng = random.Random(f"heldout:{cfg.seed}")
        rng.shuffle(text_samples)
        heldout_samples, text_samples = text_samples[:need_eval], text_samples[need_eval:]
    if cfg.regenerate:
        samples = _regenerated(cfg, chat, text_samples, tokenizer, target_dir=target_dir, out=out,
                               min_len=min_len, eos_id=eos_id, progress=progress, report=report)  # fmt: skip
    else:
        chat_samples = d.build_samples(chat, tokenizer, seq_len=cfg.seq_len, eos_id=eos_id, min_len=min_len)
        samples = _cap(chat_samples + text_samples, cfg.max_samples, cfg.seed)
    samples = [s for s in samples if len(s.input_ids) >= min_len and any(s.loss_mask)]
    if not samples:
        raise UsageError(
            f"--data={cfg.data!r} gives no training sequence of at least {min_len} tokens with a loss",
            hint="add data, or lower --block-size",
        )
    return samples, _heldout_prompts(cfg, tokenizer, heldout, heldout_samples)


def _regenerated(
    cfg: TrainConfig, chat: list[Record], text_samples: list[Sample], tokenizer: Any, *, target_dir: Path,
    out: Path, min_len: int, eos_id: int | None, progress: bool, report: Callable[[dict[str, Any]], None] | None,
) -> list[Sample]:  # fmt: skip
    """Samples whose responses the target writes itself (cached under --regen-cache or OUT/regenerated)."""
    from dflash_trt.training import regenerate as rg

    jobs = rg.chat_jobs(chat, tokenizer, seq_len=cfg.seq_len, min_new_tokens=min_len)
    jobs += rg.text_jobs(
        text_samples, prompt_len=cfg.regen_prompt_len, seq_len=cfg.seq_len, min_new_tokens=min_len,
        seed=cfg.seed, eos_id=eos_id,
    )  # fmt: skip
    jobs = _cap(jobs, cfg.max_samples, cfg.seed)
    bar = _bar(len(jobs), "regenerate", progress) or _ReportProgress("regenerate", len(jobs), report)
    cache_dir = Path(cfg.regen_cache).expanduser() if cfg.regen_cache else out / "regenerated"
    try:
        return rg.regenerate(
            jobs, target_dir=target_dir, cache_dir=cache_dir, temperature=cfg.regen_temperature,
            top_p=cfg.regen_top_p, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype,
            batch_size=cfg.regen_batch_size, progress=bar,
        )  # fmt: skip
    finally:
        bar.close()


def _heldout_prompts(
    cfg: TrainConfig, tokenizer: Any, heldout: list[Record], heldout_samples: list[Sample]
) -> list[list[int]]:
    """Prompts for the final tau: from --eval-data, else the held-out records (or samples)."""
    from dflash_trt.training import data as d

    prompt_cap = max(1, cfg.seq_len // 2)
    text_prefix = sum(cfg.regen_prompt_len) // 2
    if cfg.eval_data is not None:
        recs: list[Record] = d.load_records(cfg.eval_data)[: cfg.eval_prompts]
        prompts = [
            p for r in recs if (p := d.eval_prompt_ids(tokenizer, r, max_len=prompt_cap, text_prefix=None))
        ]
    else:
        prompts = [
            p
            for r in heldout
            if (p := d.eval_prompt_ids(tokenizer, r, max_len=prompt_cap, text_prefix=text_prefix))
        ]
        prompts += [s.input_ids[:text_prefix] for s in heldout_samples]
    return prompts[: cfg.eval_prompts]


class _ReportProgress:
    """A progress sink for non-terminals: passes counts to the `report` callback."""

    def __init__(self, phase: str, total: int, report: Callable[[dict[str, Any]], None] | None) -> None:
        self.phase, self.total, self.done, self.report = phase, total, 0, report

    def update(self, n: int) -> None:
        self.done += n
        if self.report is not None and n:
            self.report({"phase": self.phase, "done": self.done, "total": self.total})

    def close(self) -> None:
        pass


def _cap(items: list[Any], cap: int | None, seed: int) -> list[Any]:
    if cap is None or len(items) <= cap:
        return items
    order = list(range(len(items)))
    random.Random(f"cap:{seed}").shuffle(order)
    return [items[i] for i in sorted(order[:cap])]


def _bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)


def _samples_digest(samples: Sequence[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------
def export_drafter(drafter: Any, out: Path, *, dtype: torch.dtype) -> None:
    """Write config.json + model.safetensors (z-lab layout) into `out`, next to the training files.
    Each file is replaced atomically; the weights go last, so a reader never pairs new weights
    with an old config."""
    from dflash_trt.models.checkpoint import save_drafter

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        save_drafter(drafter, staging / "drafter", dtype=dtype)
        os.replace(staging / "drafter" / "config.json", out / "config.json")
        os.replace(staging / "drafter" / "model.safetensors", out / "model.safetensors")
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def _save_state(path: Path, state: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    for key, value in current.items():
        if key in RESUMABLE_CHANGES or key == "resume":
            continue
        before = saved.get(key, LEGACY_VALUES.get(key))
        if before != value:
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"--resume: {flag}={value!r} differs from the saved run's {before!r}",
                hint=f"pass {flag} {before!r} to continue that run, or use another --out",
            )


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def measure_tau(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    sampling: Any = None,
) -> dict[str, Any]:
    """DFlash on each prompt with the reference loop, greedy unless `sampling` (a SamplingConfig)
    says otherwise. tau = mean over prompts of each prompt's mean round length (the reference
    benchmark's convention); pooled = all rounds."""
    from dflash_trt.reference.generate import spec_generate

    per: list[dict[str, Any]] = []
    rounds: list[int] = []
    for ids in prompts:
        r = spec_generate(
            target, drafter, list(ids), max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
            sampling=sampling,
        )  # fmt: skip
        if r.acceptance_lengths:
            per.append({"tau": r.mean_acceptance_length, "rounds": r.num_rounds, "tokens": len(r.output_ids)})
            rounds += r.acceptance_lengths
    return {
        "tau": sum(p["tau"] for p in per) / len(per) if per else None,
        "tau_pooled": sum(rounds) / len(rounds) if rounds else None,
        "num_prompts": len(per),
        "max_new_tokens": max_new_tokens,
        "block_size": drafter.block_size,
        "per_prompt": per,
    }


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pair:
    """The frozen target (with its tokenizer) and the drafter configuration built for it."""

    device: torch.device
    dtype: torch.dtype
    target_dir: Path
    tokenizer: Any
    target: HFTarget
    dcfg: DFlashConfig


@dataclass
class _Run:
    """A training run in progress: what the loop reads, and the step it advances."""

    cfg: TrainConfig
    pair: _Pair
    out: Path
    samples: list[Sample]
    samples_digest: str
    steps_per_epoch: int
    total: int
    pad_id: int
    drafter: DFlashDrafter
    opt: torch.optim.Optimizer
    step: int
    features: FeatureCache | None = None  # --feature-cache
    feature_scale: torch.Tensor | None = None  # [K * D]: fc's input scale while training (--feature-scaling)
    vocab: LossVocab | None = None  # --loss-vocab data

    def checkpoint(self) -> None:
        """Export the drafter (z-lab layout, the scale folded into fc) and save drafter + optimizer + step
        (+ the feature scale) for --resume."""
        from dflash_trt.training.feature_scale import folded

        with folded(self.drafter, self.feature_scale):
            export_drafter(self.drafter, self.out, dtype=getattr(torch, self.cfg.save_dtype))
        _save_state(
            self.out / STATE_FILE,
            {"step": self.step, "drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
             "config": self.cfg.to_json(), "samples_digest": self.samples_digest,
             "feature_scale": self.feature_scale},
        )  # fmt: skip


def train_drafter(
    cfg: TrainConfig,
    *,
    progress: bool | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train (or resume) a drafter as configured; returns the result after the final evaluation."""
    validate(cfg)
    t_start = time.perf_counter()
    progress = sys.stderr.isatty() if progress is None else progress
    out = Path(cfg.out).expanduser()
    saved = _saved_state(cfg, out)
    pair = _load_pair(cfg)
    eos = pair.tokenizer.eos_token_id if pair.tokenizer is not None else None

    out.mkdir(parents=True, exist_ok=True)
    samples, prompts = _prepare_data(
        cfg, pair.tokenizer, target_dir=pair.target_dir, out=out, block_size=pair.dcfg.block_size, eos_id=eos,
        progress=progress, report=report,
    )  # fmt: skip
    digest = _samples_digest(samples)
    if saved is not None and saved.get("samples_digest") != digest:
        raise UsageError(
            "--resume: the training samples differ from the saved run's (data, tokenizer or regeneration changed)",
            hint="resume with the same --data and target, or use another --out",
        )
    steps_per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else (cfg.epochs or 6) * steps_per_epoch
    drafter, opt, step = _init_drafter(cfg, pair, saved)
    run = _Run(
        cfg=cfg, pair=pair, out=out, samples=samples, samples_digest=digest, steps_per_epoch=steps_per_epoch,
        total=total, pad_id=int(eos if eos is not None else 0), drafter=drafter, opt=opt, step=step,
        features=_feature_cache(cfg, pair),
    )  # fmt: skip
    run.feature_scale = _feature_scale(run, saved)
    run.vocab = _loss_vocab(run)
    _write_args(run, num_eval_prompts=len(prompts))
    history, last_loss = _train_loop(run, progress=progress, report=report)
    evaluation = _evaluate(run, prompts) if prompts else None
    return TrainResult(
        out=out, steps=run.step, final_loss=last_loss, eval=evaluation, seconds=time.perf_counter() - t_start,
        log=history,
    )  # fmt: skip


def _feature_scale(run: _Run, saved: dict[str, Any] | None) -> torch.Tensor | None:
    """fc's input scale: the saved run's when resuming, else from the first batch's features."""
    from dflash_trt.training.feature_scale import channel_scales

    if not run.cfg.feature_scaling:
        return None
    if saved is not None:
        return saved.get("feature_scale")
    _, _, lengths, feats = _batch(run, _batch_samples(run, 0))
    return channel_scales(feats, lengths)


def _loss_vocab(run: _Run) -> LossVocab | None:
    """--loss-vocab data: every token of the training samples (a function of the samples alone, so a
    resumed run gets the same one)."""
    from dflash_trt.training.forward import LossVocab

    if run.cfg.loss_vocab == "full":
        return None
    tokens = torch.tensor(
        [t for s in run.samples for t in s.input_ids], dtype=torch.long, device=run.pair.device
    )
    vocab = LossVocab.of(tokens, int(run.pair.target.head()[0].shape[0]))
    log.info("train-drafter: the loss runs over the %d tokens the samples hold", vocab.ids.numel())
    return vocab


def _feature_cache(cfg: TrainConfig, pair: _Pair) -> FeatureCache | None:
    from dflash_trt.training.feature_cache import FeatureCache, target_key

    if cfg.feature_cache is None:
        return None
    key = target_key(pair.target_dir, pair.dcfg.target_layer_ids, pair.dtype)
    return FeatureCache(Path(cfg.feature_cache).expanduser(), key)


def _saved_state(cfg: TrainConfig, out: Path) -> dict[str, Any] | None:
    """The saved state to resume from (checked against `cfg`), or None for a fresh run; refuses
    --resume without a run and a fresh run over an existing one."""
    state_path = out / STATE_FILE
    if cfg.resume and not state_path.is_file():
        raise UsageError(
            f"--resume: {state_path} does not exist", hint="start without --resume, or point --out at the run"
        )
    if not cfg.resume and state_path.is_file():
        raise UsageError(
            f"--out={str(out)!r} already holds a training run",
            hint="pass --resume to continue it, or choose another --out",
        )
    if not cfg.resume:
        return None
    saved = _load_state(state_path)
    _check_resume(saved["config"], cfg.to_json())
    return saved


STATE_KEYS = frozenset({"step", "drafter", "optimizer", "config", "samples_digest"})


def _load_state(path: Path) -> dict[str, Any]:
    """The resume state, read with torch's weights-only unpickler: tensors, numbers, strings and
    containers only, so a planted state file cannot run code (what _save_state writes is all such)."""
    import pickle

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--resume: {path} is not a training state that loads without running code ({first[:200]})",
            hint="resume only runs this tool wrote; start a fresh run with another --out",
        ) from None
    if not isinstance(saved, dict) or not saved.keys() >= STATE_KEYS:
        have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise UsageError(f"--resume: {path} is not a train-drafter state (it holds {have})",
                         hint="resume only runs this tool wrote; start a fresh run with another --out")  # fmt: skip
    return saved


def _load_pair(cfg: TrainConfig) -> _Pair:
    """Load the frozen target and its tokenizer, and build the drafter configuration for it."""
    from dflash_trt.models.dflash_config import parse_dflash_config, validate_pair
    from dflash_trt.models.sources import load_tokenizer, resolve_models
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.utils.device import resolve_device, resolve_dtype

    dev = resolve_device(None if cfg.device == "auto" else cfg.device)
    dt = resolve_dtype(None if cfg.dtype == "auto" else cfg.dtype, dev)
    models = resolve_models(cfg.target)
    tokenizer = load_tokenizer(models.target_dir)
    target = HFTarget.from_pretrained(models.target_dir, device=dev, dtype=dt)
    target.model.requires_grad_(False)
    target_cfg = json.loads((models.target_dir / "config.json").read_text())
    info: TargetInfo = target.info
    mask_id = resolve_mask_token_id(tokenizer, info.vocab_size, cfg.mask_token_id)
    base = _read_drafter_config(cfg.drafter_config)
    hf_cfg = build_drafter_hf_config(
        target_cfg,
        base=base,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids,
        mask_token_id=mask_id,
        dflash2=_dflash2_keys(cfg, base),
    )
    dcfg = parse_dflash_config(hf_config=hf_cfg)
    validate_pair(dcfg, info)
    return _Pair(dev, dt, models.target_dir, tokenizer, target, dcfg)


def _dflash2_keys(cfg: TrainConfig, base: dict[str, Any] | None) -> dict[str, int | None] | None:
    """The DFlash 2 flags when the run trains one (--dflash2, or a DFlash 2 --drafter-config), else None."""
    flags = {
        "conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
        "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k,
    }  # fmt: skip
    from_base = "DFlash2DraftModel" in ((base or {}).get("architectures") or ())
    if not (cfg.dflash2 or from_base):
        given = [k for k, v in flags.items() if v is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{flag} applies to DFlash 2 drafters only", hint="add --dflash2")
        return None
    return flags


def _init_drafter(
    cfg: TrainConfig, pair: _Pair, saved: dict[str, Any] | None
) -> tuple[DFlashDrafter, torch.optim.Optimizer, int]:
    """A seeded random drafter bound to the target's frozen embedding and head, its AdamW and the
    first step; from the saved state when resuming. DFlash 2 convs start as the identity (the drafter
    starts as a v1 one); the selector's small random codebooks start near the argmax."""
    from dflash_trt.models.dflash2 import DFlash2Drafter, drafter_class

    torch.manual_seed(cfg.seed)
    drafter = drafter_class(pair.dcfg).random(pair.dcfg, seed=cfg.seed, std=0.02).to(pair.device)
    if isinstance(drafter, DFlash2Drafter):
        drafter.reset_convs()
    # Plain tensors, not Parameters: a bound Parameter would register in the drafter (its state
    # dict and its optimizer) although it belongs to the frozen target.
    head_w, head_b = pair.target.head()
    drafter.bind_target(
        pair.target.embed_weight().detach(), head_w.detach(), head_b.detach() if head_b is not None else None
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if saved is None:
        return drafter, opt, 0
    drafter.load_state_dict(saved["drafter"])
    opt.load_state_dict(saved["optimizer"])
    return drafter, opt, int(saved["step"])


def _write_args(run: _Run, *, num_eval_prompts: int) -> None:
    """Write the resolved configuration of the run (train_args.json) and log it."""
    resolved = {
        **run.cfg.to_json(),
        "drafter": run.pair.dcfg.to_hf_config(),
        "num_samples": len(run.samples),
        "num_eval_prompts": num_eval_prompts,
        "steps_per_epoch": run.steps_per_epoch,
        "total_steps": run.total,
        "target_dir": str(run.pair.target_dir),
        "device": str(run.pair.device),
        "dtype": str(run.pair.dtype).removeprefix("torch."),
    }
    (run.out / ARGS_FILE).write_text(json.dumps(resolved, indent=2, default=str) + "\n")
    log.info(
        "train-drafter: %s", json.dumps({k: v for k, v in resolved.items() if k != "drafter"}, default=str)
    )


def _train_loop(
    run: _Run, *, progress: bool, report: Callable[[dict[str, Any]], None] | None
) -> tuple[list[dict[str, Any]], float]:
    """Train from run.step to run.total, logging every log_every steps and checkpointing every
    save_every steps, at the end and on Ctrl-C. Returns (the logged entries, the last loss)."""
    cfg = run.cfg
    warmup = max(1, round(cfg.warmup_ratio * run.total))
    bar = _bar(run.total, "train-drafter", progress)
    if bar is not None:
        bar.update(run.step)
    history: list[dict[str, Any]] = []
    last_loss = math.nan
    t_loop = time.perf_counter()
    run.drafter.train()
    try:
        with (run.out / LOG_FILE).open("a") as logf:
            while run.step < run.total:
                epoch = run.step // run.steps_per_epoch
                stats, lr, grad_norm, valid = _train_step(run, warmup=warmup)
                last_loss = stats.loss
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{stats.loss:.3f}", tau=f"{stats.tau:.2f}", lr=f"{lr:.1e}")
                if run.step % cfg.log_every == 0 or run.step == run.total:
                    entry = {
                        "step": run.step, "epoch": epoch, "loss": stats.loss, "tau_estimate": stats.tau,
                        "acc": [round(a, 4) for a in stats.acc], "lr": lr, "grad_norm": grad_norm,
                        "blocks": int(valid.sum()), "elapsed_s": round(time.perf_counter() - t_loop, 2),
                    }  # fmt: skip
                    if stats.selector_acc is not None:
                        entry.update(selector_loss=stats.selector_loss, overturn=round(stats.overturn or 0.0, 4),
                                     selector_acc=[round(a, 4) for a in stats.selector_acc])  # fmt: skip
                    history.append(entry)
                    logf.write(json.dumps(entry) + "\n")
                    logf.flush()
                    if report is not None:
                        report({"phase": "train", **entry, "total": run.total})
                if run.step % cfg.save_every == 0 and run.step < run.total:
                    run.checkpoint()
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        run.checkpoint()
        log.warning("interrupted at step %d; state saved, continue with --resume", run.step)
        raise
    if bar is not None:
        bar.close()
    run.checkpoint()
    return history, last_loss


def _batch_samples(run: _Run, step: int) -> list[int]:
    """The sample indices of step `step` (a seeded order per epoch)."""
    epoch, pos = divmod(step, run.steps_per_epoch)
    order = _sample_order(len(run.samples), seed=run.cfg.seed, epoch=epoch)
    return order[pos * run.cfg.batch_size : (pos + 1) * run.cfg.batch_size]


def _batch(run: _Run, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples `idx` as a batch on the device: (ids, loss mask, lengths, the target's features [bs, S, K * D])."""
    dev = run.pair.device
    ids, mask, lengths = (t.to(dev) for t in _collate([run.samples[i] for i in idx], run.pad_id))
    layer_ids = run.pair.dcfg.target_layer_ids
    compute = lambda x: target_features(run.pair.target.model, x, layer_ids)  # noqa: E731
    feats = (
        compute(ids) if run.features is None
        else run.features.batch([run.samples[i].input_ids for i in idx], ids, compute)
    )  # fmt: skip
    return ids, mask, lengths, feats


def _train_step(run: _Run, *, warmup: int) -> tuple[Any, float, float, torch.Tensor]:
    """One optimizer step on the batch of run.step (its samples and anchors are fixed by seed,
    epoch and sample); advances run.step. Returns (loss stats, lr, gradient norm, the valid-block
    mask)."""
    from dflash_trt.training.feature_scale import scale_features
    from dflash_trt.training.forward import dflash_loss, make_block_batch, sample_anchors, training_forward
    from dflash_trt.training.target_lm import lr_at

    cfg, dev, dt = run.cfg, run.pair.device, run.pair.dtype
    block = run.pair.dcfg.block_size
    epoch = run.step // run.steps_per_epoch
    idx = _batch_samples(run, run.step)
    ids, mask, lengths, feats = _batch(run, idx)
    anchors = [
        sample_anchors(
            mask[k], length=int(lengths[k]), block_size=block, num_anchors=cfg.num_anchors,
            generator=_anchor_generator(cfg.seed, epoch, i),
        )
        for k, i in enumerate(idx)
    ]  # fmt: skip
    bb = make_block_batch(ids, mask, lengths, anchors, block_size=block, gamma=cfg.gamma)
    feats = scale_features(feats, run.feature_scale)
    lr = lr_at(run.step, total=run.total, warmup=warmup, peak=cfg.lr, min_ratio=0.0)
    for group in run.opt.param_groups:
        group["lr"] = lr
    # Mixed precision for the drafter in the target's dtype (fp32 master weights): on a CPU with bf16
    # matmuls a smollm2-135m step takes 0.79x the time of fp32 (bench/results/train-step-2026-12-06/).
    with torch.autocast(dev.type, dtype=dt, enabled=dt != torch.float32):
        hidden = training_forward(run.drafter, feats, ids, bb.anchors, bb.valid)
        loss, stats = dflash_loss(
            run.drafter, hidden, bb, selector_weight=cfg.selector_loss_weight, vocab=run.vocab
        )
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip))
    run.opt.step()
    run.step += 1
    return stats, lr, grad_norm, bb.valid


def _evaluate(run: _Run, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """tau of the exported drafter (what users will load) on the held-out prompts; writes eval.json."""
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.sources import default_stop_token_ids

    pair = run.pair
    trained = load_drafter(run.out, device=pair.device, dtype=pair.dtype)
    stops = default_stop_token_ids(pair.target_dir, pair.tokenizer)
    evaluation = measure_tau(
        pair.target, trained, prompts, max_new_tokens=run.cfg.eval_max_new_tokens, stop_token_ids=stops
    )
    evaluation["step"] = run.step
    (run.out / EVAL_FILE).write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation
