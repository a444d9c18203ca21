#!/usr/bin/env bash
# The GPU check, in one command, on a bare GPU machine with no network (bench/README.md):
#     bash bench/gpu_check.sh [PART...]     PART: env tests kernels p1 reference (default: these, in order)
#                                           or compiled (not in the default: minutes of compilation)
# It installs the carried wheels (.gpu-wheels/, made here by bench/gpu_wheels.sh) with --no-index,
# then runs, each part bounded in time and within one overall budget (GPU_CHECK_BUDGET s, 570):
#   env        nvidia-smi and the versions of everything the check imports
#   tests      the CUDA tests (pytest -m gpu): the dflash:: kernels vs their references (block attention,
#              context K/V, acceptance, tree attention, DFlash 2 conv and selector walk); CUDA-graph
#              rounds equal eager rounds (linear DFlash, DDTree budgets, the tiny DFlash 2 drafter);
#              not the compile=True tests (minutes of compilation: they are in `compiled`)
#   kernels    bench/plugin_kernels.py: each kernel vs the copy-bandwidth floor, engine rounds
#   p1         bench/p1_qwen3_8b.py: Qwen3-8B shapes, random bf16 weights made on the GPU: the plain
#              step vs the weight-streaming floor, the DFlash round at batch 16 vs the plain step
#   compiled   the compile=True CUDA tests (compiled rounds equal eager rounds, plain and DFlash; ~190 s on
#              an H100), then bench/p1_qwen3_8b.py --compiled-dflash: the DFlash round compiled against the
#              eager one (~130 s of compilation for an 8B target on torch 2.11)
#   reference  bench/reference_speed.py --device cuda: ours vs the authors' dflash_generate on the
#              tiny pair (float32, must be identical) and on the random qwen3-0.3b pair (bfloat16)
# Everything is written under $OUT (the device tool's folder; default bench/runs/gpu-check), at most
# 8 files: summary.txt, env.txt, gpu_check.log and one JSON per measurement.
# Exit status: the number of failed parts (0 = all passed).
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/bench/runs/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
SITE=${GPU_SITE:-/tmp/dflash-trt-gpu-site}
BUDGET=${GPU_CHECK_BUDGET:-570}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRANSFORMERS_VERBOSITY=error
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY" "$LOG"; }

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env tests kernels p1 reference)
for p in "${parts[@]}"; do
  case "$p" in
    env | tests | kernels | p1 | compiled | reference) ;;
    *) echo "gpu_check.sh: unknown part '$p'; use env, tests, kernels, p1, compiled or reference" >&2; exit 2 ;;
  esac
done

note "# dflash-trt GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); parts: ${parts[*]}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl >>"$LOG" 2>&1; then
    note "FAILED: installing the carried wheels from $WHEELS (see gpu_check.log)"
    exit 1
  fi
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  note "wheels installed from $WHEELS: $(cd "$WHEELS" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  note "no wheels in $WHEELS (run bench/gpu_wheels.sh where there is network and carry .gpu-wheels)"
fi

failures=0
step() { # NAME LIMIT_S COMMAND...: run within min(LIMIT_S, what is left of the budget)
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    note "$name: SKIPPED (budget of ${BUDGET} s spent)"
    failures=$((failures + 1))
    return
  fi
  echo "=== $name (limit ${limit} s): $*" >>"$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local verdict=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="TIMED OUT"
  elif [ $rc -ne 0 ]; then
    verdict=FAILED
  fi
  [ $rc -eq 0 ] || failures=$((failures + 1))
  note "$name: $verdict (exit $rc, $((SECONDS - t0)) s)"
}

has() { for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
# pytest_line NAME: pytest's closing line from the log into the summary, prefixed with NAME
pytest_line() { tail -n 6 "$LOG" | grep -E "passed|failed|error" | tail -n 1 | sed "s/^/$1: /" | tee -a "$SUMMARY"; }

if has env; then
  {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not installed"; fi
    "$PY" - <<'PY'
import importlib, platform
from importlib import metadata
print("python", platform.python_version(), platform.machine())
for name, dist in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                   ("tokenizers", "tokenizers"), ("safetensors", "safetensors"), ("numpy", "numpy"),
                   ("click", "click"), ("yaml", "pyyaml"), ("pytest", "pytest"),
                   ("pytest_timeout", "pytest-timeout"), ("dflash", "dflash"), ("dflash_trt", None)):
    try:
        m = importlib.import_module(name)
        version = metadata.version(dist) if dist else m.__version__
        print(f"{name:16s} {version:24s} {getattr(m, '__file__', '')}")
    except Exception as exc:  # report, do not stop: the parts below say what they need
        print(f"{name:16s} MISSING ({exc})")
import torch
print("cuda available", torch.cuda.is_available(), "torch.version.cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "sm", f"{p.major}.{p.minor}",
          "SMs", p.multi_processor_count)
PY
  } >"$OUT/env.txt" 2>&1
  note "env: $(grep -m1 '^device' "$OUT/env.txt" || echo 'no CUDA device')"
fi

if has tests; then
  step tests 330 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA -k "not compile_true" \
    tests/plugins/test_gpu.py tests/plugins/test_tree_attention.py tests/plugins/test_dflash2_gpu.py \
    tests/engine/test_llm.py tests/engine/test_cuda_rounds.py
  pytest_line tests
fi
if has kernels; then
  step kernels 180 "$PY" bench/plugin_kernels.py --json "$OUT/plugin_kernels.json"
fi
if has p1; then
  step p1 200 "$PY" bench/p1_qwen3_8b.py --json "$OUT/p1_qwen3_8b.json"
  grep -E "^(weights streamed|plain step \(|DFlash round \()" "$LOG" | tail -n 4 | tee -a "$SUMMARY"
fi
if has compiled; then
  step compiled-tests 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA -k compile_true \
    tests/engine/test_cuda_rounds.py
  pytest_line compiled-tests
  step compiled 360 "$PY" bench/p1_qwen3_8b.py --compiled-dflash --json "$OUT/p1_compiled.json"
  grep -E "^(DFlash round \(|DFlash round, compiled)" "$LOG" | tail -n 2 | tee -a "$SUMMARY"
fi
if has reference; then
  step reference-tiny 120 "$PY" bench/reference_speed.py --device cuda --json "$OUT/reference_speed_tiny.json"
  grep -E "^ratio ours / reference" "$LOG" | tail -n 1 | sed 's/^/tiny fp32: /' | tee -a "$SUMMARY"
  step reference-0.3b 150 "$PY" bench/reference_speed.py --device cuda --shape qwen3-0.3b \
    --dtype bfloat16 --allow-mismatch --json "$OUT/reference_speed_qwen3-0.3b.json"
  grep -E "^ratio ours / reference" "$LOG" | tail -n 1 | sed 's/^/qwen3-0.3b bf16: /' | tee -a "$SUMMARY"
fi
note "# done in ${SECONDS} s; failed parts: $failures"
exit "$failures"
