# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""The parts of our Triton model (`dflash_trt/triton/templates/model.py`), which composes them:

  wire.py       the llmapi wire: input tensors -> a request, outputs -> responses, errors with their trailer
  tracking.py   the requests in flight: cancellation, stop-by-id, how each one ends (final, error)
  liveness.py   heartbeat, engine-dead report, drain, the drained/finalized markers
  metrics.py    the dflash_* metric families and what feeds them
  startup.py    model.yaml (triton_config), the engine behind the model, the stub's locale and logs

The renderer (`dflash_trt/triton/repository.py`) copies this package verbatim next to model.py, as
`<repo>/tensorrt_llm/1/dflash_trt_llmapi/`: the Python backend puts the model's directory on sys.path,
and an image without dflash-trt (NGC's TensorRT-LLM image serving a `trtllm` bundle) runs the model
from that copy. Hence the rules for this package: imports between its modules are relative; nothing
here imports dflash_trt outside the branch that opens the embedded engine (and type checking); and
`triton_python_backend_utils`, which exists only inside the stub, is handed in by model.py (`pb`),
never imported, so every part imports and unit-tests without Triton.
"""
