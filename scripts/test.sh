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

# uv (from PyPI) installs the three venvs in seconds where pip took about two minutes each, which kept CI near its
# time limit; pip stays the fallback. The venvs are seeded with pip: the demo (which shares .venv) pip-downloads.
if "$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q --user uv >/dev/null 2>&1; then
  UV=("$PY" -m uv)
else
  UV=()
  echo "uv unavailable: installing with pip (slower)" >&2
fi
FIND_LINKS=()  # a local directory of wheels (this workplace's CPU torch), as pip's own configuration names it
[ -n "${PIP_FIND_LINKS:-}" ] && FIND_LINKS=(--find-links "$PIP_FIND_LINKS")

install() {  # install DIR [pip install arguments...]
  local dir="$1"; shift
  if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" pip install -q --python "$dir/bin/python" "${FIND_LINKS[@]}" "$@"
  else
    "$dir/bin/python" -m pip install -q "$@"
  fi
}

setup_venv() {  # setup_venv DIR [extra pip requirements...]
  local dir="$1"; shift
  if [ ! -x "$dir/bin/python" ]; then
    if [ ${#UV[@]} -gt 0 ]; then "${UV[@]}" venv -q --seed --python "$PY" "$dir"; else "$PY" -m venv "$dir"; fi
  fi
  install "$dir" torch==2.13.0 -e ".[test]" "$@"
}

export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

compat_tests() {  # the quantizer/checkpoint tests on transformers 5.17.0
  # only the modules that hold such tests are collected: importing every test module costs minutes on 2 cores
  local files
  mapfile -t files < <({ ls tests/test_*quantizer*.py tests/test_*checkpoint*.py tests/test_*compat*.py 2>/dev/null
                         grep -lE "def test_\w*(quantizer|checkpoint|compat)" tests/test_*.py; } | sort -u)
  .venv-tf517/bin/python -m pytest -q -m "not gpu and not vllm" -k "quantizer or checkpoint or compat" "${files[@]}"
}

vllm_cpu_tests() {  # our vLLM plugin against vLLM 0.24.0's own layer classes, on the CPU torch
  local files
  mapfile -t files < <(grep -l "mark.vllm_on_cpu" tests/test_*.py)
  QERL_VLLM_ON_CPU=1 .venv-vllm/bin/python -m pytest -q -m vllm_on_cpu "${files[@]}"
}

# The venvs are set up one after another (each builds this package), then the two smaller test phases run beside
# the full suite, each into its own log, printed when it ends: on 2 cores a fresh clone's run went from 665 s
# (one phase after another) to 487 s.
echo "== setting up the venvs =="
setup_venv .venv
phases=()
if [ "${QERL_SKIP_COMPAT:-0}" != "1" ]; then
  setup_venv .venv-tf517 "transformers==5.17.0" "compressed-tensors==0.17.0"
  phases+=(compat)
fi
if [ "${QERL_SKIP_VLLM_CPU:-0}" != "1" ]; then
  setup_venv .venv-vllm
  # vLLM pins torch==2.11.0 (CUDA); its Python layers run on the CPU torch, so install it without its dependencies
  # and add what its imports (and TRL's, once vLLM is importable) need.
  install .venv-vllm --no-deps "vllm==0.24.0"
  install .venv-vllm cbor2 pyzmq aiohttp openai openai-harmony cloudpickle msgspec pybase64 \
    cachetools uvloop py-cpuinfo prometheus_client "llguidance>=1.7.0,<1.8.0" "xgrammar>=0.2.1,<1.0.0" fastapi \
    partial_json_parser einops
  phases+=(vllm_cpu)
fi

logs="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT  # || true: errexit holds in traps too
declare -A pids=()
for phase in "${phases[@]}"; do
  "${phase}_tests" >"$logs/$phase.log" 2>&1 & pids[$phase]=$!
done

echo "== full CPU suite on the newest transformers =="
status=0
.venv/bin/python -m pytest -q -m "not gpu and not vllm" "$@" tests || status=$?

declare -A titles=([compat]="quantizer tests on transformers 5.17.0"
                   [vllm_cpu]="vLLM plugin tests on CPU (vLLM 0.24.0's Python code, no kernels)")
for phase in "${phases[@]}"; do
  rc=0; wait "${pids[$phase]}" || rc=$?
  echo "== ${titles[$phase]} (exit $rc) =="
  cat "$logs/$phase.log"
  [ "$rc" = 0 ] || status=$rc
done
exit "$status"
