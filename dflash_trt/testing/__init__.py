# SPDX-License-Identifier: Apache-2.0
"""Test doubles shipped with the package: a scripted KServe server that stands in for a model
server in benchmark-harness tests (`dflash-trt bench scripted-server`). Not used in serving."""
