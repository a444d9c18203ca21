#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Side by side on this machine, in one run: `dflash-trt serve` as shipped (real Triton + embedded engine,
# OpenAI front) and llama.cpp's `llama-server` (plain decoding and its own DFlash at several draft lengths),
# on the same pair converted to GGUF (PAIR: the packaged `tiny` in f32, or `smollm2-135m` in bf16), the same
# held-out prompts, 128 output tokens, greedy, ignore_eos, the same client (`dflash-trt bench sweep --protocol
# openai-completions`, which renders chat prompts with the pair's own template), one server at a time. The
# project ships no llama.cpp code: the binary and the GGUF files come from the caller, or from
# ../shared/peers/llamacpp-setup.sh (run when they are missing and the script exists); the smollm2-135m GGUF
# files are converted here by that setup's converter (convert_hf_to_gguf.py) from the checkpoint `dflash-trt`
# made and our drafter.
#
# usage (project root, after `make venv`):  bash bench/compare_llamacpp.sh [OUT]
#   env: PAIR (tiny: bench/datasets/tiny-python-heldout.jsonl; smollm2-135m: bench/datasets/smollm2-chat-heldout.jsonl,
#        its bf16 checkpoint and packaged v1 drafter, plus llama.cpp on the package's native Q4_1 file, for
#        information only: run `info-llama-q4_1-ar`, left out of every ratio)
#        LLAMA_SERVER (llama-server binary)  TARGET_GGUF  DRAFTER_GGUF  (default: llamacpp-setup.sh's outputs, or
#        for smollm2-135m the conversions made here, under PEER_DIR, default /tmp/peer/llamacpp)
#        CONC (default 1,4,16)  NREQ (default 16)  THREADS (llama.cpp -t, default: all cores)
#        DRAFTS (llama.cpp draft lengths, default "15 7 3")  PARTS (default "llama ours": which servers run)  OURS (default "default": `serve`, no flag; add
#        "eager" for `serve --eager`)
#        DRAFTER (our bundle's drafter, a directory or `<pair>-dflash2`; default the packaged v1 drafter). The DFlash 2
#        pair: DRAFTER=tiny-dflash2 and DRAFTER_GGUF its GGUF (llama.cpp's convert_hf_to_gguf.py
#        dflash_trt/assets/tiny/drafter-dflash2 --target-model-dir dflash_trt/assets/tiny/target --outtype f32);
#        use a new OUT (a bundle already in OUT is reused)
#        BASELINE_DRAFTER (optional: a second drafter for the same target, e.g. the packaged v1 at
#        dflash_trt/assets/tiny/drafter): served in the same run after ours, as ours-<variant>-baseline-dflash,
#        so that DRAFTER / BASELINE_DRAFTER is a ratio taken in one run (the summary prints it)
# Run it under default scheduling: `chrt -r` (real-time round robin) cost our multi-process server ~18 % at
# c=1 on a 2-core host (bench/results/sched-2026-11-27/).
# Writes OUT/<label>/ sweep directories, OUT/texts/<label>.json (greedy texts of the first 8 prompts, 64 tokens, taken
# after each sweep), OUT/config.txt and OUT/summary.txt (bench/compare_summary.py --peer llama, then whether the
# servers' greedy texts agree: bench/greedy_texts.py compare).
set -u
OUT=${1:-bench/runs/llamacpp-cpu}; CONC=${CONC:-1,4,16}; NREQ=${NREQ:-16}; THREADS=${THREADS:-$(nproc)}
DRAFTS=${DRAFTS:-15 7 3}; OURS=${OURS:-default}; PARTS=${PARTS:-llama ours}
PEER_DIR=${PEER_DIR:-/tmp/peer/llamacpp}; DRAFTER=${DRAFTER:-}; BASELINE_DRAFTER=${BASELINE_DRAFTER:-}
SETUP=${SETUP:-$(cd "$(dirname "$0")/../.." && pwd)/shared/peers/llamacpp-setup.sh}
LLAMA_SERVER=${LLAMA_SERVER:-$PEER_DIR/llama.cpp/build/bin/llama-server}
CLI=$PWD/.venv/bin/dflash-trt
PAIR=${PAIR:-tiny}; Q4_GGUF=
case "$PAIR" in
  tiny) DATASET=bench/datasets/tiny-python-heldout.jsonl; GGUF_TYPE=f32 ;;
  smollm2-135m) DATASET=bench/datasets/smollm2-chat-heldout.jsonl; GGUF_TYPE=bf16  # its default decodes plainly:
    DRAFTER=${DRAFTER:-$PWD/dflash_trt/assets/smollm2-135m/drafter}  # name the packaged v1 drafter
    Q4_GGUF=$(.venv/bin/python -c 'from dflash_trt.smollm2 import gguf_path; print(gguf_path())') || exit 1 ;;
  *) echo "error: PAIR=$PAIR is not a packaged pair; fix: PAIR=tiny or PAIR=smollm2-135m" >&2; exit 2 ;;
esac
TARGET_GGUF=${TARGET_GGUF:-$PEER_DIR/gguf/$PAIR-target-$GGUF_TYPE.gguf}
DRAFTER_GGUF=${DRAFTER_GGUF:-$PEER_DIR/gguf/$PAIR-drafter-$GGUF_TYPE.gguf}
if [ ! -x "$LLAMA_SERVER" ] || { [ "$PAIR" = tiny ] && { [ ! -s "$TARGET_GGUF" ] || [ ! -s "$DRAFTER_GGUF" ]; }; }; then
  if [ -f "$SETUP" ]; then
    echo "llama.cpp or the GGUF files are missing: running $SETUP (builds llama.cpp, converts tiny)" >&2
    bash "$SETUP" "$PEER_DIR" || { echo "error: $SETUP failed" >&2; exit 1; }
  else
    echo "error: LLAMA_SERVER=$LLAMA_SERVER, TARGET_GGUF or DRAFTER_GGUF missing; fix: set them, or provide $SETUP" >&2
    exit 2
  fi
fi
if [ "$PAIR" = smollm2-135m ] && { [ ! -s "$TARGET_GGUF" ] || [ ! -s "$DRAFTER_GGUF" ]; }; then
  .venv/bin/python bench/smollm2_gguf.py --converter "$PEER_DIR" --target-gguf "$TARGET_GGUF" \
    --drafter "$DRAFTER" --drafter-gguf "$DRAFTER_GGUF" || exit 1
fi
mkdir -p "$OUT"
COMMON=(--tokenizer "$PAIR" --dataset "$DATASET" --osl 128
        --num-requests "$NREQ" --warmup 2 --temperature 0 --ignore-eos --request-timeout 300 --overwrite
        --protocol openai-completions --model "$PAIR")
# wait_url URL SECONDS PID: ready, or give up when the server process is gone
wait_url() { for _ in $(seq 1 "$2"); do curl -sf -o /dev/null "$1" && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 1; done; return 1; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), native bf16: $(grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo yes || echo no), load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "ours: dflash-trt $("$CLI" --version | awk '{print $NF}'), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), variants: $OURS, drafter: ${DRAFTER:-$PAIR (v1)}${BASELINE_DRAFTER:+, baseline drafter: $BASELINE_DRAFTER}"
  echo "peer: llama.cpp $("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version | xargs), -t $THREADS, $GGUF_TYPE GGUF ($TARGET_GGUF, $DRAFTER_GGUF), DFlash draft lengths: $DRAFTS${Q4_GGUF:+; for information: plain decoding of $Q4_GGUF}"
  echo "workload: $PAIR pair, $DATASET, 128 output tokens, greedy, ignore_eos, concurrency $CONC, $NREQ requests per point"
} | tee "$OUT/config.txt"
[ -d "$OUT/bundle" ] || "$CLI" build --target "$PAIR" ${DRAFTER:+--drafter "$DRAFTER"} --output "$OUT/bundle" >/dev/null || exit 1
if [ -n "$BASELINE_DRAFTER" ] && [ ! -d "$OUT/bundle-baseline" ]; then
  "$CLI" build --target "$PAIR" --drafter "$BASELINE_DRAFTER" --output "$OUT/bundle-baseline" >/dev/null || exit 1
fi
# texts LABEL URL: the server's greedy texts for the first prompts (bench/greedy_texts.py), after its sweep
texts() { .venv/bin/python bench/greedy_texts.py fetch --url "$2" --model "$PAIR" --tokenizer "$PAIR" --dataset "$DATASET" \
  --out "$OUT/texts/$1.json" >>"$OUT/texts.log" 2>&1 || echo "greedy texts of $1 failed (see $OUT/texts.log)"; }
sweep() { local label=$1 url=$2 conc=$3
  "$CLI" bench sweep --url "$url" --label "$label" --out "$OUT/$label" --concurrency "$conc" "${COMMON[@]}" >>"$OUT/$label.log" 2>&1 \
    || echo "$label failed (see $OUT/$label.log)"; }
# llama-server runs once per concurrency with as many slots (-np) as requests in flight: more slots than
# that slow it down (its c=1 with 16 slots ran at ~0.6x its c=1 with 1). Runs are named LABEL-<slots>,
# and compare_summary.py takes the best of them per concurrency, as for repeated runs.
llama() { local label=$1 model=$2; shift 2
  for c in ${CONC//,/ }; do
    "$LLAMA_SERVER" -m "$model" --host 127.0.0.1 --port 18400 --alias "$PAIR" -t "$THREADS" -tb "$THREADS" \
      -c $((2048 * c)) -np "$c" "$@" >"$OUT/$label-$c.log" 2>&1 &
    local pid=$!
    wait_url http://127.0.0.1:18400/health 120 $pid && sweep "$label-$c" http://127.0.0.1:18400 "$c" \
      && { [ -f "$OUT/texts/$label.json" ] || texts "$label" http://127.0.0.1:18400; }
    kill $pid; wait $pid 2>/dev/null; sleep 1
  done; }
ours() { local label=$1 bundle=$2; shift 2
  "$CLI" serve --bundle "$bundle" --quiet --http-port 18200 --grpc-port 18201 --metrics-port 18202 --openai-port 18203 \
    --openai-model-name "$PAIR" --ready-timeout 1800 "$@" >"$OUT/$label.log" 2>&1 &
  local pid=$! t0=$SECONDS
  wait_url http://127.0.0.1:18203/v1/models 1800 $pid && echo "$label: ready after $((SECONDS - t0)) s" | tee -a "$OUT/ready.txt" && sweep "$label" http://127.0.0.1:18203 "$CONC" \
    && texts "$label" http://127.0.0.1:18203
  kill $pid; wait $pid 2>/dev/null; sleep 1; }
if [[ " $PARTS " == *" llama "* ]]; then
  llama llama-ar "$TARGET_GGUF"
  for n in $DRAFTS; do
    llama "llama-dflash-n$n" "$TARGET_GGUF" -md "$DRAFTER_GGUF" --spec-type draft-dflash --spec-draft-n-max "$n" -td "$THREADS" -tbd "$THREADS"
  done
  [ -z "$Q4_GGUF" ] || llama info-llama-q4_1-ar "$Q4_GGUF"  # another precision: in the table, in no ratio
fi
if [[ " $PARTS " == *" ours "* ]]; then
  # The default `serve` compiles its rounds in the background while it serves eagerly: fill the bundle's
  # compile cache first (what a pre-warm Job does), so that the sweeps measure the compiled steady state.
  # The cold compile's time lands in OUT/precompile-*.log; every `serve` below starts warm.
  if [[ " $OURS " == *" default "* ]]; then
    "$CLI" precompile --bundle "$OUT/bundle" >"$OUT/precompile-dflash.log" 2>&1 || echo "precompile failed (see $OUT/precompile-dflash.log)"
    "$CLI" precompile --bundle "$OUT/bundle" --no-draft >"$OUT/precompile-ar.log" 2>&1 || echo "precompile --no-draft failed"
    if [ -n "$BASELINE_DRAFTER" ]; then
      "$CLI" precompile --bundle "$OUT/bundle-baseline" >"$OUT/precompile-baseline.log" 2>&1 || echo "precompile of the baseline failed"
    fi
  fi
  for variant in $OURS; do
    flags=(); [ "$variant" = eager ] && flags=(--eager)
    ours "ours-$variant-dflash" "$OUT/bundle" "${flags[@]}"; ours "ours-$variant-ar" "$OUT/bundle" --no-draft "${flags[@]}"
    [ -z "$BASELINE_DRAFTER" ] || ours "ours-$variant-baseline-dflash" "$OUT/bundle-baseline" "${flags[@]}"
  done
fi
.venv/bin/python bench/compare_summary.py "$OUT" --peer llama --json "$OUT/summary.json" | tee "$OUT/summary.txt"
.venv/bin/python bench/greedy_texts.py compare "$OUT/texts" | tee -a "$OUT/summary.txt"
