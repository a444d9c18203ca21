#!/usr/bin/env bash
# Fetch, on a machine WITH network, the few pure-Python wheels the GPU check needs and the device
# image lacks, into .gpu-wheels/ (git-ignored) so that they travel with the check:
#     bash bench/gpu_wheels.sh            # then carry .gpu-wheels to the GPU machine
# The device image ('cuda': python3 3.12, torch 2.11+cu130, Triton 3.6, transformers 5.17) already
# has click, pyyaml, safetensors, tokenizers, numpy, tqdm, pytest and pytest-timeout; it lacks the
# authors' reference package `dflash` (the in-process comparison). Extra names may be passed:
#     bash bench/gpu_wheels.sh NAME==VERSION ...
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${GPU_WHEELS:-$ROOT/.gpu-wheels}
PY=${PYTHON:-python3}
# dflash 0.1.0's own requirements (tqdm, datasets, requests) are not imported by dflash.model,
# which is all the check uses: --no-deps on purpose.
WHEELS=("dflash==0.1.0" "$@")
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
for w in "$DEST"/*.whl; do
  case "$(basename "$w")" in
    *-none-any.whl) ;;
    *) echo "gpu_wheels.sh: $(basename "$w") is not pure Python; check that it fits the device image" >&2 ;;
  esac
done
ls -l "$DEST"
echo "carry $DEST to the GPU machine; bench/gpu_check.sh installs from it with --no-index"
