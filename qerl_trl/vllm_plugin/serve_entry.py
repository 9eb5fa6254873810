"""``vllm serve`` with QeRL's plugin registered first: ``python -m qerl_trl.vllm_plugin.serve_entry serve MODEL ...``.

vLLM checks ``--quantization qerl_nvfp4_lora`` against its registry in the API server process, before any engine
process starts; where qerl-trl's ``vllm.general_plugins`` entry point is not installed (a source tree on
``PYTHONPATH``) nothing would have registered it there. The engine processes get the method with the pickled config
and the float32 norm hook with the worker extension (:mod:`.server_worker`). ``qerl-trl vllm-serve`` runs this.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from . import register

    register(strict=True)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
