cd /work/main
for t in 2 1 2 1; do
  echo "=== OMP_NUM_THREADS=$t $(date +%T)"
  OMP_NUM_THREADS=$t .venv/bin/dflash-trt bench engine --target smollm2-135m --batch-sizes 1,2,4,8,16 --max-tokens 64 --modes ar 2>&1 | grep -vE "^\s*$" | tail -25
done
echo rc=$?
