"""The GPU suite (``pytest -m "gpu or vllm"``) in parts that each fit one 10-minute call on the GPU machine (aim: 8).

    python scripts/gpu_suite.py --list          # the parts and their tests
    python scripts/gpu_suite.py kernels         # one part (extra arguments go to pytest)

Every GPU test belongs to exactly one part (``tests/test_gpu_suite.py`` checks it on CPU), so running every part
at one commit is running the whole suite there. A part runs pytest with ``-m "gpu or vllm"`` and its files. Run them
in the order listed on one machine: ``real_shape_32b`` reuses the checkpoint ``checkpoint_32b`` writes under
``$QERL_E2E_WORK`` (alone, it writes it first and takes longer).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: part -> (pytest arguments, what it holds and its time in one H100 call at the commit named; vLLM's compile cache
#: may have been warm from an earlier part in the same lease)
PARTS: dict[str, tuple[list[str], str]] = {
    "kernels": (["-m", "gpu and not vllm", "tests", "--ignore", "tests/test_checkpoint_32b.py"],
                "NVFP4 kernels, quantizer on CUDA (215 tests, 292 s at aa48af6)"),
    "colocate": (["tests/test_trainer_vllm_gpu.py"], "SmolLM2 colocate check per LoRA backend (291 s at e987368)"),
    "vllm_layers": (["tests/test_single_lora_vllm.py", "tests/test_trainer_dropin.py"],
                    "single-LoRA layers on real Marlin, the drop-in forms under colocate (238 s)"),
    "learning": (["tests/test_learning_gpu.py"], "compare, three arms on one GPU (313 s)"),
    "real_shape": (["tests/test_real_shape_colocate.py"], "1.5B colocate training, AQN and sleep mode on (126 s)"),
    # the 32B memory step took 9.5 min with its checkpoint's write at aa48af6: the write is its own part, run first
    "checkpoint_32b": (["tests/test_checkpoint_32b.py"], "writes and checks the 32B NVFP4 checkpoint (not yet timed)"),
    "real_shape_32b": (["tests/test_real_shape_32b.py"], "32B memory step on the checkpoint above (not yet timed)"),
    "multi_gpu": (["tests/test_multi_gpu.py"], "DDP and TP=2 jobs, both LoRA backends: needs 2 GPUs (not timed)"),
}


def pytest_args(part: str) -> list[str]:
    args, _ = PARTS[part]
    return args if "-m" in args else ["-m", "gpu or vllm", *args]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", choices=list(PARTS))
    ap.add_argument("--list", action="store_true")
    a, rest = ap.parse_known_args(argv)
    if a.list or not a.part:
        for name, (args, minutes) in PARTS.items():
            print(f"{name:14s} {minutes:62s} pytest {' '.join(pytest_args(name))}")
        return 0
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args(a.part), *rest],
                           cwd=REPO)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
