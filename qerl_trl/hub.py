"""Push QeRL results to the Hugging Face Hub: the NVFP4 base and the LoRA adapter, each with a rendered card.

Two repos, as vLLM serves them (``vllm serve BASE --quantization compressed-tensors --enable-lora
--lora-modules name=ADAPTER``):

* :func:`push_base` uploads an NVFP4A16 ``compressed-tensors`` checkpoint directory (weights, config,
  tokenizer) with a card from ``model_cards/nvfp4_base.md`` (``base_model_relation: quantized``).
* :func:`push_adapter` uploads a PEFT adapter directory (``adapter_config.json`` pointing at the base repo,
  adapter weights, tokenizer) with a card from ``model_cards/lora_adapter.md`` (``base_model_relation:
  adapter``) carrying the recipe, AQN schedule, rewards and final metrics, read from the trainer's output dir.
* :func:`push_to_hub` does both for a finished ``QeRLGRPOTrainer``.

Each push is one commit with an explicit file list (no stray checkpoints or optimizer states). Everything goes
through ``huggingface_hub.HfApi``, so ``HF_TOKEN`` / ``HF_ENDPOINT`` work as usual.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_FILES",
    "BASE_FILES",
    "TOKENIZER_FILES",
    "TEMPLATES_DIR",
    "push_adapter",
    "push_base",
    "push_to_hub",
    "render_adapter_card",
    "render_base_card",
]

TEMPLATES_DIR = Path(__file__).parent / "model_cards"
QERL_TAGS = ["qerl", "nvfp4", "trl", "grpo"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
BASE_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


# ----------------------------------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _base_file_list(folder: Path) -> list[str]:
    names = [n for n in BASE_FILES + TOKENIZER_FILES if (folder / n).is_file()]
    names += sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    return names


def _nvfp4_summary(folder: Path) -> dict[str, Any]:
    """Check that ``folder`` holds an NVFP4A16 compressed-tensors checkpoint; return what the card shows."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass the directory written by `qerl-trl quantize`.")
    cfg = _read_json(cfg_path)
    q = cfg.get("quantization_config") or {}
    if q.get("quant_method") != "compressed-tensors" or "nvfp4" not in str(q.get("format", "")):
        raise ValueError(
            f"{folder} is not an NVFP4A16 compressed-tensors checkpoint (quantization_config="
            f"{q.get('quant_method')!r}/{q.get('format')!r}). Quantize it first: `qerl-trl quantize MODEL OUT_DIR`."
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{folder} has config.json but no *.safetensors weights.")
    from safetensors import safe_open

    n_quant = 0
    for w in weights:
        with safe_open(str(w), framework="pt") as f:
            n_quant += sum(1 for k in f.keys() if k.endswith(".weight_packed"))
    group_size = 16
    for group in (q.get("config_groups") or {}).values():
        group_size = (group.get("weights") or {}).get("group_size") or group_size
    return {
        "config": cfg,
        "num_quantized": n_quant,
        "ignored": list(q.get("ignore") or []),
        "group_size": group_size,
        "size_gb": f"{sum(w.stat().st_size for w in weights) / 1e9:.2f}",
        "dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
    }


def _source_model_of(folder: Path, cfg: Mapping[str, Any]) -> str | None:
    name = cfg.get("_name_or_path")
    return str(name) if name and str(name) != str(folder) and not Path(str(name)).is_absolute() else None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("qerl-trl", "trl", "transformers", "peft", "torch", "compressed-tensors", "vllm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _render(template: str, card_data: Any, **fields: Any) -> Any:
    from huggingface_hub import ModelCard

    path = Path(template) if template and Path(template).is_file() else TEMPLATES_DIR / template
    if not path.is_file():
        raise FileNotFoundError(f"model card template {template!r} not found (looked in {TEMPLATES_DIR}).")
    return ModelCard.from_template(card_data, template_path=str(path), **fields)


def _hub_url(repo_id: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"


# ------------------------------------------------------------------------------------------------- cards


def render_base_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    source_model: str | None = None,
    license: str = "apache-2.0",
    template: str = "nvfp4_base.md",
) -> Any:
    """The ``ModelCard`` for an NVFP4 base checkpoint directory (metadata + rendered template)."""
    from huggingface_hub import ModelCardData

    from . import __version__

    folder = Path(folder)
    info = _nvfp4_summary(folder)
    source_model = source_model or _source_model_of(folder, info["config"])
    data = ModelCardData(
        base_model=source_model,
        base_model_relation="quantized" if source_model else None,
        library_name="transformers",
        license=license,
        pipeline_tag="text-generation",
        tags=[*QERL_TAGS, "compressed-tensors", "nvfp4a16"],
    )
    return _render(
        template,
        data,
        repo_id=repo_id,
        source_model=source_model or "a 16-bit checkpoint",
        source_model_url=_hub_url(source_model) if source_model else "#",
        license=license,
        qerl_version=__version__,
        **{k: info[k] for k in ("num_quantized", "ignored", "group_size", "size_gb", "dtype")},
    )


def _final_metrics(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The last logged value of each training metric (TRL logs one dict per logging step)."""
    skip = {"epoch", "step", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    out: dict[str, Any] = {}
    for entry in log_history:
        for k, v in entry.items():
            if k not in skip and isinstance(v, (int, float)):
                out[k] = round(float(v), 6)
    if log_history:
        out["global_step"] = int(log_history[-1].get("step", 0))
    return out


def _aqn_text(aqn: Mapping[str, Any] | None, metrics: Mapping[str, Any]) -> str:
    if not aqn:
        return "Not recorded." if "aqn/sigma" not in metrics else f"Last σ: {metrics['aqn/sigma']}."
    if not aqn.get("enabled", True):
        return "Off for this run (plain NVFP4 quantization noise only)."
    parts = [
        f"σ from {aqn.get('sigma_start')} to {aqn.get('sigma_end')} over {aqn.get('num_stages')} stages",
    ]
    if aqn.get("schedule"):
        parts.append(f"({aqn['schedule']} decay)")
    text = " ".join(parts) + ": channel-wise Gaussian noise folded into the RMSNorm weights, decayed each stage."
    if "aqn/sigma" in metrics:
        text += f" Last σ: {metrics['aqn/sigma']}."
    return text


def render_adapter_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    base_repo_id: str,
    source_model: str | None = None,
    recipe: Mapping[str, Any] | None = None,
    aqn: Mapping[str, Any] | None = None,
    rewards: Sequence[str] | None = None,
    metrics: Mapping[str, Any] | None = None,
    algorithm: str | None = None,
    adapter_name: str | None = None,
    license: str = "apache-2.0",
    template: str = "lora_adapter.md",
) -> Any:
    """The ``ModelCard`` for a LoRA adapter directory trained by QeRL on ``base_repo_id``.

    ``metrics`` defaults to the last logged values in ``trainer_state.json`` when that file is in ``folder``
    (or its newest ``checkpoint-*``).
    """
    import yaml
    from huggingface_hub import ModelCardData

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no adapter_config.json: pass the trainer's output_dir after trainer.save_model()."
        )
    acfg = _read_json(folder / "adapter_config.json")
    if metrics is None:
        state = _trainer_state(folder)
        metrics = _final_metrics(state.get("log_history", [])) if state else {}
    recipe = dict(recipe) if recipe else None
    if algorithm is None:
        loss = str((recipe or {}).get("loss_type", "")).lower()
        algorithm = "DAPO" if loss in ("dapo", "bnpo") else "GRPO"
    data = ModelCardData(
        base_model=base_repo_id,
        base_model_relation="adapter",
        library_name="peft",
        license=license,
        pipeline_tag="text-generation",
        tags=[*QERL_TAGS, "lora", "reinforcement-learning"],
    )
    targets = acfg.get("target_modules")
    targets = ", ".join(sorted(targets)) if isinstance(targets, (list, tuple, set)) else str(targets)
    return _render(
        template,
        data,
        repo_id=repo_id,
        base_repo_id=base_repo_id,
        base_repo_url=_hub_url(base_repo_id),
        source_model=source_model,
        algorithm=algorithm,
        adapter_name=adapter_name or repo_id.split("/")[-1],
        lora_rank=acfg.get("r"),
        lora_alpha=acfg.get("lora_alpha"),
        target_modules=targets,
        aqn_text=_aqn_text(aqn, metrics),
        rewards=list(rewards or []),
        metrics=dict(metrics),
        recipe_yaml=yaml.safe_dump(recipe, sort_keys=False) if recipe else None,
        versions=_versions(),
    )


def _trainer_state(folder: Path) -> dict[str, Any] | None:
    candidates = [folder / "trainer_state.json"]
    ckpts = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]) if p.name[11:].isdigit() else -1)
    candidates += [c / "trainer_state.json" for c in reversed(ckpts)]
    for c in candidates:
        if c.is_file():
            return _read_json(c)
    return None


# ------------------------------------------------------------------------------------------------ pushes


def _commit(
    repo_id: str,
    files: Mapping[str, bytes | Path],
    *,
    private: bool | None,
    token: str | None,
    commit_message: str,
    revision: str | None = None,
) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    ops = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(src) if isinstance(src, Path) else src)
        for name, src in files.items()
    ]
    info = api.create_commit(
        repo_id, ops, commit_message=commit_message, repo_type="model", revision=revision
    )
    return info.commit_url


def push_base(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    source_model: str | None = None,
    license: str = "apache-2.0",
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload NVFP4A16 base (qerl-trl)",
    revision: str | None = None,
) -> str:
    """Upload an NVFP4A16 checkpoint directory (``qerl-trl quantize`` output) with its card; returns the commit URL.

    Uploaded: ``config.json``, ``generation_config.json``, the ``*.safetensors`` weights (+ index), tokenizer
    files present, and ``README.md``. Anything else in the directory is left out.
    """
    folder = Path(folder)
    card = render_base_card(folder, repo_id, source_model=source_model, license=license)
    files: dict[str, bytes | Path] = {name: folder / name for name in _base_file_list(folder)}
    files["README.md"] = str(card).encode()
    return _commit(repo_id, files, private=private, token=token, commit_message=commit_message, revision=revision)


def push_adapter(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    base_repo_id: str,
    source_model: str | None = None,
    recipe: Mapping[str, Any] | None = None,
    aqn: Mapping[str, Any] | None = None,
    rewards: Sequence[str] | None = None,
    metrics: Mapping[str, Any] | None = None,
    license: str = "apache-2.0",
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload QeRL LoRA adapter (qerl-trl)",
    revision: str | None = None,
) -> str:
    """Upload a LoRA adapter directory with its card; returns the commit URL.

    Uploaded: ``adapter_config.json`` (its ``base_model_name_or_path`` set to ``base_repo_id`` so
    ``PeftModel.from_pretrained`` finds the FP4 base), ``adapter_model.safetensors``, tokenizer files present,
    ``qerl_recipe.yaml`` (when a recipe is given) and ``README.md``.
    """
    import yaml

    folder = Path(folder)
    missing = [n for n in ADAPTER_FILES if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {', '.join(missing)}: pass the trainer's output_dir after trainer.save_model()."
        )
    card = render_adapter_card(
        folder,
        repo_id,
        base_repo_id=base_repo_id,
        source_model=source_model,
        recipe=recipe,
        aqn=aqn,
        rewards=rewards,
        metrics=metrics,
        license=license,
    )
    acfg = _read_json(folder / "adapter_config.json")
    acfg["base_model_name_or_path"] = base_repo_id
    files: dict[str, bytes | Path] = {
        "adapter_config.json": (json.dumps(acfg, indent=2, sort_keys=True) + "\n").encode(),
        "adapter_model.safetensors": folder / "adapter_model.safetensors",
    }
    files.update({n: folder / n for n in TOKENIZER_FILES if (folder / n).is_file()})
    if recipe:
        files["qerl_recipe.yaml"] = yaml.safe_dump(dict(recipe), sort_keys=False).encode()
    files["README.md"] = str(card).encode()
    return _commit(repo_id, files, private=private, token=token, commit_message=commit_message, revision=revision)


def recipe_from_args(args: Any) -> dict[str, Any]:
    """The options of a (QeRL)GRPOConfig that differ from its defaults, as a YAML-able dict (card + recipe file)."""
    from dataclasses import MISSING, fields, is_dataclass

    if not is_dataclass(args):
        return json.loads(json.dumps(dict(args), default=str))
    skip = {"output_dir", "logging_dir", "hub_token", "push_to_hub_token", "run_name"}
    out: dict[str, Any] = {}
    for f in fields(args):
        if not f.init or f.name in skip or f.name.startswith("_"):
            continue
        v = getattr(args, f.name)
        v = getattr(v, "value", v)  # enums -> their string
        if not (v is None or isinstance(v, (str, int, float, bool, list, dict))):
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING  # type: ignore[misc]
        )
        default = getattr(default, "value", default)
        if v != default:
            out[f.name] = v
    return json.loads(json.dumps(out, default=str))


def push_to_hub(
    trainer: Any,
    base_repo_id: str,
    adapter_repo_id: str | None = None,
    *,
    base_folder: str | os.PathLike | None = None,
    private: bool | None = None,
    token: str | None = None,
) -> tuple[str, str]:
    """Push a finished QeRL run: the NVFP4 base (``base_folder``, or the trainer's cached NVFP4 checkpoint) and
    the adapter from ``trainer.args.output_dir``. Returns the two commit URLs (base, adapter).
    """
    args = trainer.args
    out_dir = Path(args.output_dir)
    trainer.save_model(str(out_dir))
    adapter_repo_id = adapter_repo_id or getattr(args, "hub_model_id", None) or out_dir.name
    if base_folder is None:
        base_folder = getattr(trainer, "nvfp4_checkpoint_dir", None)
    if base_folder is None:
        raise ValueError(
            "push_to_hub needs the NVFP4 checkpoint directory: pass base_folder= (e.g. the output of "
            "`qerl-trl quantize MODEL OUT_DIR`)."
        )
    rewards = [getattr(f, "__name__", str(f)) for f in getattr(trainer, "reward_funcs", [])]
    aqn = None
    sched = getattr(trainer, "aqn_schedule", None)
    if sched is not None and hasattr(sched, "to_dict"):
        aqn = sched.to_dict()
    elif hasattr(args, "aqn_sigma_start"):
        aqn = {
            "enabled": getattr(args, "aqn", True),
            "sigma_start": args.aqn_sigma_start,
            "sigma_end": getattr(args, "aqn_sigma_end", None),
            "num_stages": getattr(args, "aqn_num_stages", None),
        }
    metrics = _final_metrics(trainer.state.log_history)
    base_url = push_base(base_folder, base_repo_id, private=private, token=token)
    adapter_url = push_adapter(
        out_dir,
        adapter_repo_id,
        base_repo_id=base_repo_id,
        recipe=recipe_from_args(args),
        aqn=aqn,
        rewards=rewards,
        metrics=metrics,
        private=private,
        token=token,
    )
    return base_url, adapter_url
