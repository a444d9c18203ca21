#!/bin/bash
# Experiment harness (2026-12-07): seconds from `dflash-trt serve` to /v1/models, with inductor's ISA record
# in the bundle's compile cache (engine/vec_isa.py) and without it, alternated. Fill the cache first:
#   dflash-trt build --target smollm2-135m --drafter smollm2-135m-dflash --output B && dflash-trt precompile --bundle B
#   bash ab_ready.sh B 3
set -u
BUNDLE=$1 RUNS=${2:-3}
CLI=${CLI:-.venv/bin/dflash-trt}
RECORD=$(ls "$BUNDLE"/compile-cache/*/vec-isa.json)
cp "$RECORD" /tmp/vec-isa.json.saved
ready() {
  local t0 t1 pid
  t0=$(date +%s.%N)
  "$CLI" serve --bundle "$BUNDLE" --http-port 18200 --grpc-port 18201 --metrics-port 18202 --openai-port 18203 \
    --openai-model-name m >"/tmp/serve-$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do curl -sf -o /dev/null http://127.0.0.1:18203/v1/models && break; sleep 0.1; done
  t1=$(date +%s.%N)
  echo "$1: ready after $(echo "$t1 - $t0" | bc) s; $(grep -o 'compiled rounds ready in [0-9.]* s' "/tmp/serve-$1.log")"
  kill $pid; wait $pid 2>/dev/null; sleep 2
}
for i in $(seq 1 "$RUNS"); do
  cp /tmp/vec-isa.json.saved "$RECORD"; ready "recorded-$i"
  rm -f "$RECORD"; ready "probed-$i"   # this start probes, and writes the record again
done
cp /tmp/vec-isa.json.saved "$RECORD"
