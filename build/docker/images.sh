#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build and test the torch-backend serving image with Debian's buildah, without a Docker daemon
# and without a registry image: the base is made from Debian packages by mmdebstrap.
#
#   build/docker/images.sh all          tools, base, wheelhouse, venv-test, build, test (make image-test)
#   build/docker/images.sh tools        apt-get install buildah mmdebstrap (root) when missing
#   build/docker/images.sh base         localhost/dflash-trt-base:bookworm from mmdebstrap's rootfs
#   build/docker/images.sh wheelhouse   dflash-trt's wheel and every pinned dependency, as wheels
#   build/docker/images.sh venv-test    pip install the wheel into a fresh venv; run image_smoke.py
#   build/docker/images.sh build        the serving image, from the base and the wheelhouse
#   build/docker/images.sh test         run make demo's serving part and image_smoke.py inside it
#
# Containers run with buildah's chroot isolation: crun cannot create containers on hosts with
# hybrid cgroups (v1 controllers plus a v2 mount), as on the project's CI machines. Everything
# lands in build/out/images/ (git-ignored). PYTHON (default .venv/bin/python: Python 3.11, as in Debian bookworm, with hatchling)
# resolves the wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/out/images
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' dflash_trt/__init__.py)
BASE_IMAGE=localhost/dflash-trt-base:bookworm
IMAGE=${IMAGE:-ghcr.io/dflash-trt/dflash-trt:${VERSION}-cpu}
BUILDAH=(buildah --storage-driver=overlay)
export BUILDAH_ISOLATION=chroot

log() { printf '>> %s\n' "$*" >&2; }

tools() {
  if command -v buildah >/dev/null && command -v mmdebstrap >/dev/null; then return; fi
  if [ "$(id -u)" != 0 ]; then
    echo "error: buildah and mmdebstrap are missing; fix: sudo apt-get install buildah mmdebstrap" >&2
    exit 1
  fi
  log "installing buildah and mmdebstrap (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >/dev/null
}

base() {
  if "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "$BASE_IMAGE exists"
    return
  fi
  mkdir -p "$OUT/base"
  log "mmdebstrap: Debian bookworm (minbase, python3, python3-venv, libpython3.11) -> $OUT/base/rootfs.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates \
    bookworm "$OUT/base/rootfs.tmp.tar" http://deb.debian.org/debian
  mv "$OUT/base/rootfs.tmp.tar" "$OUT/base/rootfs.tar"
  cp build/docker/Dockerfile.debian-base "$OUT/base/Dockerfile"
  "${BUILDAH[@]}" bud --quiet --layers=false -t "$BASE_IMAGE" "$OUT/base" >/dev/null
  rm -f "$OUT/base/rootfs.tar"
}

wheelhouse() {
  local ctx="$OUT/context"
  rm -rf "$ctx/wheelhouse.tmp"
  mkdir -p "$ctx/wheelhouse.tmp"
  log "wheel of dflash-trt $VERSION"
  "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$ctx/wheelhouse.tmp" .
  log "its dependencies, pinned by requirements/constraints.txt (torch: the CPU build)"
  "$PYTHON" -m pip download -q --only-binary=:all: -c requirements/constraints.txt \
    -d "$ctx/wheelhouse.tmp" "torch==$(sed -n 's/^torch==//p' requirements/constraints.txt)"
  "$PYTHON" -m pip download -q --only-binary=:all: -c requirements/constraints.txt \
    -d "$ctx/wheelhouse.tmp" --find-links "$ctx/wheelhouse.tmp" "dflash-trt[torch,serve]==$VERSION"
  rm -rf "$ctx/wheelhouse"
  mv "$ctx/wheelhouse.tmp" "$ctx/wheelhouse"
  log "$(ls "$ctx/wheelhouse" | wc -l) wheels, $(du -sh "$ctx/wheelhouse" | cut -f1)"
}

venv_test() {
  local venv="$OUT/venv"
  rm -rf "$venv"
  log "fresh venv: pip install dflash-trt[torch,serve] from the wheelhouse"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-index --find-links "$OUT/context/wheelhouse" "dflash-trt[torch,serve]"
  log "image_smoke.py with the fresh venv's dflash-trt"
  local root=$PWD
  (cd "$venv" && PATH="$root/$venv/bin:$PATH" "$root/$venv/bin/python" "$root/build/docker/image_smoke.py")
}

build() {
  cp build/docker/Dockerfile.serve-torch build/docker/tritonserver.sh "$OUT/context/"
  log "buildah bud $IMAGE (base $BASE_IMAGE)"
  "${BUILDAH[@]}" bud --quiet --layers=false --build-arg "BASE=$BASE_IMAGE" \
    -f "$OUT/context/Dockerfile.serve-torch" -t "$IMAGE" "$OUT/context" >/dev/null
  "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE" >&2
}

test_image() {
  CTR=$("${BUILDAH[@]}" from --pull-never "$IMAGE")
  # EXIT, not RETURN: under `set -e` a failing step leaves the script without returning.
  trap '"${BUILDAH[@]}" rm "$CTR" >/dev/null' EXIT
  local ctr=$CTR
  "${BUILDAH[@]}" copy --chown 1000:1000 "$ctr" build/docker/image_smoke.py /tmp/image_smoke.py >/dev/null
  run() { "${BUILDAH[@]}" run --network host "$ctr" -- "$@"; }
  log "inside $IMAGE: user, torch.compile's C++ compiler (no build tools beyond it), tritonserver"
  run sh -c 'test "$(id -u):$(id -g)" = 1000:1000 || { echo "runs as $(id -u), not 1000" >&2; exit 1; }'
  run sh -c 'for c in make clang cmake; do if command -v $c; then echo "build tool $c in the image" >&2; exit 1; fi; done; true'
  run python -c 'import torch; f = torch.compile(lambda x: x * 2 + 1); assert f(torch.ones(3)).tolist() == [3.0] * 3'
  run sh -c 'command -v tritonserver && tritonserver --help 2>&1 | grep -q "^Usage: tritonserver"'
  log "inside $IMAGE: make demo's serving part (python -m dflash_trt.demo_serve)"
  run python -m dflash_trt.demo_serve
  log "inside $IMAGE: image_smoke.py (serve with an API key, probes, the OpenAI front, drain)"
  run sh -c 'cd /tmp && python /tmp/image_smoke.py'
}

cmd=${1:-all}
case "$cmd" in
  tools) tools ;;
  base) tools; base ;;
  wheelhouse) wheelhouse ;;
  venv-test) venv_test ;;
  build) tools; base; [ -d "$OUT/context/wheelhouse" ] || wheelhouse; build ;;
  test) test_image ;;
  all) tools; base; wheelhouse; venv_test; build; test_image; log "image $IMAGE built and tested" ;;
  *) echo "error: unknown step $cmd; fix: one of all tools base wheelhouse venv-test build test" >&2; exit 2 ;;
esac
