#!/usr/bin/env bash
# The GPU machine's wheel bundle (../shared/gpu/bundle.sh) with the SmolLM2 GGUF in it, which the GPU suite's colocate
# parts and drop-in case read from /tmp/gpu-extra/ (conftest.SMOLLM2_GGUF). Built without it, those cases skip: at
# ca81141 the colocate part ran nothing, a lease's call lost. Run in the project root, after `bash scripts/test.sh`
# (its .venv), then send .gpu-bundle/p0, p1, ... one call each, as bundle.sh says. The wheels are the shared list and
# scripts/gpu-serve-wheels.txt (what `vllm serve` imports): a bundle without them failed both server_* parts at
# setup (02f21fa, "No module named 'model_hosting_container_standards'"), a lease's two parts lost.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
gguf_dir="$(.venv/bin/python -c 'from qerl_trl.smollm2 import fetch_smollm2; print(fetch_smollm2())')"
if [ -z "${WHEELS_LIST:-}" ]; then
  cat ../shared/gpu/wheels.txt scripts/gpu-serve-wheels.txt > "${TMPDIR:-/tmp}/qerl-gpu-wheels.txt"
  export WHEELS_LIST="${TMPDIR:-/tmp}/qerl-gpu-wheels.txt"
fi
export BUNDLE_EXTRA="$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf ${BUNDLE_EXTRA:-}"
exec bash ../shared/gpu/bundle.sh "$@"
