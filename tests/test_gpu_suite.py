"""scripts/gpu_suite.py splits the GPU suite into parts: every GPU/vLLM test is in exactly one part."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_suite  # noqa: E402


def _collect(args: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_every_gpu_test_is_in_exactly_one_part():
    whole = _collect(["-m", "gpu or vllm", "tests"])
    assert len(whole) > 100
    seen: dict[str, str] = {}
    for part in gpu_suite.PARTS:
        for test in _collect(gpu_suite.pytest_args(part)):
            assert test not in seen, f"{test} is in parts {seen[test]} and {part}"
            seen[test] = part
    assert set(seen) == whole, sorted(whole - set(seen))[:5]
