set -u
cd /work/main
CLI=.venv/bin/dflash-trt
OUT=${OUT:-/tmp/s8/prof16}; rm -rf $OUT; mkdir -p $OUT
$CLI serve --bundle /tmp/s8/bundleB --quiet --http-port 18200 --grpc-port 18201 --metrics-port 18202 --openai-port 18203 \
  --openai-model-name tiny ${SERVE_FLAGS:---no-draft} > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf -o /dev/null http://127.0.0.1:18203/v1/models && break; sleep 1; done
echo "ready after $i s"
(sleep 6; top -b -d 5 -n 3 -w 250 > $OUT/top.txt) &
if [ -n "${PYSPY:-}" ]; then
  (sleep 8; EP=$(pgrep -f "dflash_trt.api.process" | head -1); echo "engine pid $EP" > $OUT/pyspy.log; .venv/bin/py-spy record -d 10 -r 250 -p $EP -f raw -o $OUT/engine.raw ${PYSPY_FLAGS:-} >> $OUT/pyspy.log 2>&1) &
fi
$CLI bench sweep --url http://127.0.0.1:18203 --label c16 --out $OUT/sweep --concurrency ${CONC:-16} --tokenizer tiny \
  --dataset bench/datasets/tiny-python-heldout.jsonl --osl 128 --num-requests ${NREQ:-64} --warmup 2 --temperature 0 \
  --ignore-eos --protocol openai-completions --model tiny --overwrite > $OUT/sweep.log 2>&1
grep -E "tok/s" $OUT/sweep.log | head -5
kill $SP; wait $SP 2>/dev/null
