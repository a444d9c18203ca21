#!/bin/sh
# tritonserver from the nvidia-pytriton wheel (installed by Dockerfile.serve-torch): the
# interpreter's libpython first, then the wheel's own libraries, and the Python backend with
# the stub for this image's Python. Arguments pass through (the chart's, or dflash-trt serve's).
LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu:/opt/tritonserver/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec /opt/tritonserver/tritonserver --backend-directory=/opt/tritonserver/backends "$@"
