"""Which TRL and vLLM this integration was written against, and the check that a usable vLLM is installed."""

from __future__ import annotations

from importlib import metadata

__all__ = ["VLLM_INSTALL_HINT", "VLLM_MIN_VERSION", "WRITTEN_AGAINST", "require_vllm"]

WRITTEN_AGAINST = {"trl": "1.16.0", "vllm": "0.24.0"}
VLLM_MIN_VERSION = "0.24.0"
VLLM_INSTALL_HINT = 'pip install "qerl-trl[vllm]"'

def _version_tuple(v: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(Version(v).base_version).release


def require_vllm(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise one ImportError that says how to install a usable one."""
    if version is None:
        try:
            version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"use_vllm=True needs vLLM >= {VLLM_MIN_VERSION}, which is not installed. Install it with "
                f"`{VLLM_INSTALL_HINT}`, or set use_vllm=False to generate with the training model."
            ) from None
    if _version_tuple(version) < _version_tuple(VLLM_MIN_VERSION):
        raise ImportError(
            f"use_vllm=True needs vLLM >= {VLLM_MIN_VERSION} (NVFP4 Marlin kernels with LoRA), found {version}. "
            f"Upgrade with `{VLLM_INSTALL_HINT}`, or set use_vllm=False."
        )
    return version
