"""Whether a ``model`` string names a local model directory or a Hub repo, checked before any Hub lookup.

Why: transformers sends any string that is not an existing directory to the Hub, so a mistyped local path fails
with the Hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'", and a path to a file with a
message about repo ids too. Neither names the path or says what was expected. Plain string rules, no imports
beyond the standard library.
"""

from __future__ import annotations

import os
import re

__all__ = ["check_model_source"]

#: what the Hub accepts as a repo id: ``name`` or ``namespace/name`` (letters, digits, ``-``, ``_``, ``.``)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_source(model: str, what: str = "model", needs_config: bool = True) -> None:
    """Raise, naming ``model``, if it is a local path that is not a model directory: a file, a directory without
    ``config.json`` (unless ``needs_config`` is False: a GGUF file's directory holds none), or a missing path
    (anything a Hub repo id cannot be: ``/abs``, ``./rel``, ``~/x``, ``a/b/c``). A string that can be a Hub id and
    is not a local directory is left to the Hub."""
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        raise ValueError(
            f"{what}={model!r} is a file; pass the directory that holds the model's config.json and weights (for a "
            "GGUF file, its directory and gguf_file=<name>), or a Hub repo id such as 'Qwen/Qwen2.5-7B-Instruct'."
        )
    if os.path.isdir(path):
        if needs_config and not os.path.isfile(os.path.join(path, "config.json")):
            adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
            raise ValueError(
                f"{what}={model!r} is a directory without config.json, so it is not a model checkpoint"
                + (
                    " (it holds a LoRA adapter: pass its base model, and the adapter as "
                    "PeftModel.from_pretrained(base, this directory))."
                    if adapter
                    else "; pass the directory that holds config.json and the weights."
                )
            )
        return
    if not HUB_ID.match(model):
        raise FileNotFoundError(
            f"{what}={model!r}: no such directory (resolved to {os.path.abspath(path)!r}). Expected a local model "
            "directory with config.json, or a Hub repo id such as 'Qwen/Qwen2.5-7B-Instruct'."
        )
