#!/usr/bin/env bash
# Set up and run the CPU test suite on a fresh machine (this is README's test command; CI runs it too).
#   1. a venv with torch 2.13.0 (CPU) and qerl-trl[test] on the newest transformers -> the whole CPU suite;
#   2. a second venv pinned to transformers 5.17.0 + compressed-tensors 0.17.0 (the GPU machine's and vLLM 0.24's) -> the quantizer/checkpoint tests;
#   3. a third venv with vLLM 0.24.0's Python code on the CPU torch (no CUDA, no vLLM kernels) -> the tests of our vLLM
#      plugin against vLLM's own layer classes (marker vllm_on_cpu, QERL_VLLM_ON_CPU=1). QERL_SKIP_VLLM_CPU=1 skips it.
# Triton kernels run under TRITON_INTERPRET=1 here. GPU-only tests are marked `gpu`/`vllm` and skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

setup_venv() {  # setup_venv DIR [extra pip requirements...]
  local dir="$1"; shift
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q torch==2.13.0
  "$dir/bin/python" -m pip install -q -e ".[test]" "$@"
}

export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "${QERL_SKIP_COMPAT:-0}" != "1" ]; then
  echo "== quantizer tests on transformers 5.17.0 =="
  setup_venv .venv-tf517 "transformers==5.17.0" "compressed-tensors==0.17.0"
  .venv-tf517/bin/python -m pytest -q -m "not gpu and not vllm" -k "quantizer or checkpoint or compat" tests
fi

echo "== full CPU suite on the newest transformers =="
setup_venv .venv
.venv/bin/python -m pytest -q -m "not gpu and not vllm" "$@" tests

if [ "${QERL_SKIP_VLLM_CPU:-0}" != "1" ]; then
  echo "== vLLM plugin tests on CPU (vLLM 0.24.0's Python code, no kernels) =="
  setup_venv .venv-vllm
  # vLLM pins torch==2.11.0 (CUDA); its Python layers run on the CPU torch, so install it without its dependencies
  # and add what its imports (and TRL's, once vLLM is importable) need.
  .venv-vllm/bin/python -m pip install -q --no-deps "vllm==0.24.0"
  .venv-vllm/bin/python -m pip install -q cbor2 pyzmq aiohttp openai openai-harmony cloudpickle msgspec pybase64 \
    cachetools uvloop py-cpuinfo prometheus_client "llguidance>=1.7.0,<1.8.0" "xgrammar>=0.2.1,<1.0.0" fastapi \
    partial_json_parser einops
  QERL_VLLM_ON_CPU=1 .venv-vllm/bin/python -m pytest -q -m vllm_on_cpu tests
fi
