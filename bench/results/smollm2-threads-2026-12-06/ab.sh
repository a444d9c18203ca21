cd /tmp
for i in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=/tmp/ab-old; else P=/work/main; fi
    echo "=== $side $(date +%T)"
    (cd $P && PYTHONPATH=$P timeout 900 /work/main/.venv/bin/python -m dflash_trt bench engine --target smollm2-135m --batch-sizes 1,4,16 --max-tokens 128 --modes ar 2>&1 | grep -E "ar batch|refused|environment" | head -8)
  done
done
echo rc=$?
