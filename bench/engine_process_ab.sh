#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The served engine in a process of its own (triton_config.engine_process: true, the default) against the
# engine on a thread of the Triton stub (engine_process: false), interleaved on this machine: the same
# `tiny` bundle rendered twice, the same compile cache (filled first by `dflash-trt precompile`), the same
# client (`dflash-trt bench sweep` through the OpenAI front), 16 held-out prompts x 128 tokens, greedy,
# ignore_eos. Each repetition runs the thread layout, then the process layout, at every concurrency; the
# round time comes from the server's own dflash_round_duration_seconds histogram (sum / count over the sweep).
#
# usage (project root, after `make venv`):  bash bench/engine_process_ab.sh [OUT]
#   env: CONC (default 1,4,16)  NREQ (default 16)  REPS (default 3)  MODES (default "dflash plain")
# Writes OUT/config.txt, OUT/<mode>-<layout>-<rep>/ sweep directories with round.txt, and OUT/summary.txt.
set -u
OUT=${1:-bench/runs/engine-process}; CONC=${CONC:-1,4,16}; NREQ=${NREQ:-16}; REPS=${REPS:-3}
MODES=${MODES:-dflash plain}
CLI=$PWD/.venv/bin/dflash-trt
mkdir -p "$OUT"
export DFLASH_TRT_COMPILE_CACHE=${DFLASH_TRT_COMPILE_CACHE:-$PWD/$OUT/compile-cache}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), native bf16: $(grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo yes || echo no), load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "dflash-trt $("$CLI" --version | awk '{print $NF}') at $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo '+changes'), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
  echo "workload: tiny, bench/datasets/tiny-python-heldout.jsonl, $NREQ requests x 128 tokens, greedy, ignore_eos, concurrency $CONC, OpenAI front; modes: $MODES; $REPS repetitions, thread then process"
  echo "compile cache: $DFLASH_TRT_COMPILE_CACHE"
} | tee "$OUT/config.txt"
for layout in process thread; do
  [ -d "$OUT/bundle-$layout" ] && continue
  "$CLI" build --target tiny --output "$OUT/bundle-$layout" >/dev/null || exit 1
done
sed -i 's/^\(  engine_process:\) true$/\1 false/' "$OUT/bundle-thread/model_repository/tensorrt_llm/1/model.yaml"
grep -q '^  engine_process: false$' "$OUT/bundle-thread/model_repository/tensorrt_llm/1/model.yaml" \
  || { echo "error: could not set engine_process: false in bundle-thread" >&2; exit 1; }
"$CLI" precompile --bundle "$OUT/bundle-process" >"$OUT/precompile-dflash.log" 2>&1 || echo "precompile failed (see $OUT/precompile-dflash.log)"
"$CLI" precompile --bundle "$OUT/bundle-process" --no-draft >"$OUT/precompile-plain.log" 2>&1 || echo "precompile --no-draft failed"

rounds() { curl -s http://127.0.0.1:18302/metrics | awk '/^dflash_round_duration_seconds_count/{c=$2} /^dflash_round_duration_seconds_sum/{s=$2} END{print c+0, s+0}'; }
wait_url() { for _ in $(seq 1 "$2"); do curl -sf -o /dev/null "$1" && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 1; done; return 1; }
run() { local label=$1 bundle=$2; shift 2
  "$CLI" serve --bundle "$bundle" --quiet --http-port 18300 --grpc-port 18301 --metrics-port 18302 --openai-port 18303 \
    --openai-model-name tiny --ready-timeout 600 "$@" >"$OUT/$label.log" 2>&1 &
  local pid=$!
  if wait_url http://127.0.0.1:18303/v1/models 600 $pid; then
    for c in ${CONC//,/ }; do
      local before after
      before=$(rounds)
      "$CLI" bench sweep --url http://127.0.0.1:18303 --label "$label" --out "$OUT/$label-c$c" --concurrency "$c" \
        --tokenizer tiny --dataset bench/datasets/tiny-python-heldout.jsonl --osl 128 --num-requests "$NREQ" --warmup 2 \
        --temperature 0 --ignore-eos --request-timeout 300 --overwrite --protocol openai-completions --model tiny \
        >>"$OUT/$label.log" 2>&1 || echo "$label c=$c failed (see $OUT/$label.log)"
      after=$(rounds)
      echo "$before $after" >"$OUT/$label-c$c/round.txt"
    done
  else
    echo "$label: the server did not come up (see $OUT/$label.log)"
  fi
  kill $pid; wait $pid 2>/dev/null; sleep 1
}
for rep in $(seq "$REPS"); do
  for mode in $MODES; do
    flags=(); [ "$mode" = plain ] && flags=(--no-draft)
    for layout in thread process; do
      run "$mode-$layout-$rep" "$OUT/bundle-$layout" "${flags[@]}"
    done
  done
done
.venv/bin/python bench/engine_process_summary.py "$OUT" | tee "$OUT/summary.txt"
