#!/usr/bin/env bash
# Prefix caching served (issue #46): the same two sweeps against `dflash-trt serve` with the prefix cache
# on (the default) and off (--no-prefix-caching at build), one server at a time, eager rounds (no
# background compile runs beside the measurement), over the OpenAI chat endpoint.
#
#   system      every chat starts with one shared system prompt of SYSTEM_TOKENS tokens (ISL in all)
#   multiturn   conversations of TURNS turns, each resending the history (TURN_TOKENS new user tokens
#               and an OSL-token assistant reply a turn)
#
#   TARGET=smollm2-135m DRAFTER=smollm2-135m-dflash OUT=bench/results/prefix-cache-2026-11-29 \
#     bash bench/prefix_cache_served.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-smollm2-135m}
DRAFTER=${DRAFTER:-$TARGET-dflash}  # smollm2-135m ships no default drafter: its interim one is named
OUT=${OUT:-bench/results/prefix-cache-$(date +%F)}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-1500}
ISL=${ISL:-1600}
OSL=${OSL:-32}
TURNS=${TURNS:-4}
TURN_TOKENS=${TURN_TOKENS:-100}
CONCURRENCY=${CONCURRENCY:-1,4}
REQUESTS=${REQUESTS:-16}
WORKLOADS=${WORKLOADS:-system multiturn}
WORK=$(mktemp -d)
SERVER=
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

for mode in on off; do
  flag=$([ "$mode" = off ] && echo --no-prefix-caching || true)
  "$PY" -m dflash_trt build --target "$TARGET" --drafter "$DRAFTER" $flag --output "$WORK/$mode" --force >/dev/null
  http=$(free_port); grpc=$(free_port); metrics=$(free_port); oai=$(free_port)
  "$PY" -m dflash_trt serve --bundle "$WORK/$mode" --eager --quiet --http-port "$http" --grpc-port "$grpc" \
    --metrics-port "$metrics" --openai-port "$oai" 2>"$WORK/$mode.log" &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$oai/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/$mode.log"; exit 1; }
    sleep 0.5
  done
  common=(--url "http://127.0.0.1:$oai" --protocol openai-chat --model "$TARGET" --tokenizer "$TARGET"
          --osl "$OSL" --concurrency "$CONCURRENCY" --num-requests "$REQUESTS" --no-progress)
  for w in $WORKLOADS; do
    case $w in
      system) args=(--isl "$ISL" --system-prompt-tokens "$SYSTEM_TOKENS") ;;
      multiturn) args=(--isl "$TURN_TOKENS" --turns "$TURNS") ;;
      *) echo "WORKLOADS: unknown workload $w (system, multiturn)" >&2; exit 2 ;;
    esac
    "$PY" -m dflash_trt bench sweep "${common[@]}" "${args[@]}" --label "$w, cache $mode" --out "$OUT/$mode/$w"
  done
  curl -s "http://127.0.0.1:$metrics/metrics" | grep '^dflash_prefix_cache' > "$OUT/$mode/prefix_cache_metrics.txt" || true
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=
done
echo "wrote $OUT/{on,off}/{$WORKLOADS}"
