"""The one place that reaches into TRL / vLLM internals. Written against TRL 1.16.0 and vLLM 0.24.0.

Why it exists: TRL 1.16 syncs a PEFT policy to vLLM by merging the LoRA into the base and pushing every tensor
(``VLLMGeneration._iter_named_params`` / ``sync_weights``), which cannot work on a packed FP4 base. Here the base
stays frozen inside vLLM and the LoRA is served as a vLLM adapter:

* ``QeRLVLLMGeneration`` subclasses TRL's ``trl.generation.vllm_generation.VLLMGeneration`` and overrides
  ``_init_vllm`` (build the one colocated ``LLM`` on the NVFP4A16 checkpoint with ``enable_lora=True``) and
  ``sync_weights`` (push the LoRA as an adapter + the AQN-noised norms, reset the prefix cache). TRL's ``generate``
  is reused unchanged; the engine it calls is a ``LoRAServingLLM`` proxy that adds ``lora_request=`` and maps sleep
  level 2 (which TRL 1.16 hard-codes, and which breaks LoRA) to level 1.
* ``swap_trl_vllm_generation`` swaps the ``VLLMGeneration`` name that ``trl.trainer.grpo_trainer`` instantiates in
  ``GRPOTrainer.__init__``, so only one engine is ever built.
* ``fp32_norms_during_load`` converts the AQN target norms of vLLM's model to float32 right after vLLM loads the
  weights (wrapping ``BaseModelLoader.load_model``), i.e. before vLLM compiles the model and captures CUDA graphs.
  vLLM 0.24's ``ir.ops.rms_norm`` dispatch then skips the ``vllm_c`` CUDA kernel (it requires weight dtype ==
  activation dtype) and uses the native implementation, ``(x_hat.to(fp32) * w_fp32).to(bf16)``: small AQN σ
  (5e-4, below bf16's 2^-7 step near 1.0) survives into the rollouts.

The adapter travels through a RAM-backed directory (``/dev/shm``) with vLLM's public ``LoRARequest`` /
``llm_engine.add_lora`` API; the files are deleted as soon as vLLM has loaded them.

With ``vllm_lora_backend="qerl"`` the engine instead runs QeRL's quantization method ``qerl_nvfp4_lora``
(:mod:`qerl_trl.vllm_plugin`): ``enable_lora`` stays off, the LoRA lives in each linear layer, and ``sync_weights``
copies it in place through ``LLM.apply_model`` (:func:`single_lora_engine_kwargs`, ``push_lora``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..vllm_plugin import OTHER_BACKEND_HINT  # the package imports no vLLM

logger = logging.getLogger(__name__)

WRITTEN_AGAINST = {"trl": "1.16.0", "vllm": "0.24.0"}
VLLM_MIN_VERSION = "0.24.0"
VLLM_INSTALL_HINT = 'pip install "qerl-trl[vllm]"'
# vLLM 0.24 `vllm.config.lora.MaxLoRARanks`
VLLM_ALLOWED_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

__all__ = [
    "VLLM_ALLOWED_LORA_RANKS",
    "require_vllm",
    "vllm_max_lora_rank",
    "check_lora_config_for_vllm",
    "peft_to_vllm_lora_tensors",
    "peft_lora_modules",
    "write_adapter_dir",
    "LoRAServingLLM",
    "VLLMServingSpec",
    "cast_norms_to_fp32",
    "fp32_norms_during_load",
    "swap_trl_vllm_generation",
    "make_qerl_vllm_generation_class",
]


# ----------------------------------------------------------------------------------------------- pure helpers


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


def vllm_max_lora_rank(lora_rank: int, requested: int | None = None) -> int:
    """vLLM's ``max_lora_rank`` for a LoRA of rank ``lora_rank``.

    vLLM only accepts ``max_lora_rank`` in ``VLLM_ALLOWED_LORA_RANKS``; any adapter rank up to it is served (its
    GPU buffers are zero-padded to ``max_lora_rank``), so a rank such as 24 is served padded to 32 with a warning.
    """
    if lora_rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {lora_rank}.")
    if requested is not None:
        if requested not in VLLM_ALLOWED_LORA_RANKS:
            raise ValueError(
                f"vllm_max_lora_rank={requested} is not a rank vLLM accepts; use one of {VLLM_ALLOWED_LORA_RANKS}."
            )
        if requested < lora_rank:
            raise ValueError(
                f"vllm_max_lora_rank={requested} is smaller than the LoRA rank {lora_rank}; set it to at least "
                f"{lora_rank} or leave it unset."
            )
        return requested
    for allowed in VLLM_ALLOWED_LORA_RANKS:
        if allowed >= lora_rank:
            if allowed != lora_rank:
                logger.warning(
                    "LoRA rank %d is not a rank vLLM serves natively; vLLM will serve it padded to max_lora_rank=%d "
                    "(same outputs, buffers sized for rank %d).",
                    lora_rank,
                    allowed,
                    allowed,
                )
            return allowed
    raise ValueError(
        f"LoRA rank {lora_rank} is larger than the largest rank vLLM can serve ({VLLM_ALLOWED_LORA_RANKS[-1]}). "
        "Use a smaller rank, or use_vllm=False."
    )


def check_lora_config_for_vllm(cfg: Any) -> int:
    """Raise a clear error for PEFT settings vLLM cannot serve as an adapter; return the LoRA rank."""
    problems = []
    if type(cfg).__name__ != "LoraConfig" and not hasattr(cfg, "lora_alpha"):
        raise ValueError(f"use_vllm=True serves LoRA adapters only; got a {type(cfg).__name__}.")
    if getattr(cfg, "use_dora", False):
        problems.append("DoRA (use_dora=True) is not supported by vLLM: set use_dora=False")
    if getattr(cfg, "bias", "none") != "none":
        problems.append(f"LoRA bias={cfg.bias!r} is not supported by vLLM: set bias='none'")
    if getattr(cfg, "modules_to_save", None):
        problems.append(
            f"modules_to_save={list(cfg.modules_to_save)} cannot be served by vLLM (it keeps the base frozen): "
            "remove modules_to_save"
        )
    ranks = set((getattr(cfg, "rank_pattern", None) or {}).values())
    if ranks - {cfg.r}:
        problems.append("per-module ranks (rank_pattern) are not supported by vLLM: use one rank")
    alphas = set((getattr(cfg, "alpha_pattern", None) or {}).values())
    if alphas - {cfg.lora_alpha}:
        problems.append("per-module alphas (alpha_pattern) are not supported by vLLM: use one lora_alpha")
    if getattr(cfg, "target_parameters", None):
        problems.append("target_parameters LoRA is not supported by the vLLM adapter path")
    targets = cfg.target_modules
    if isinstance(targets, (list, set, tuple)):
        bad = sorted(t for t in targets if t in ("lm_head", "embed_tokens"))
        if bad:
            problems.append(f"LoRA on {bad} is not served on the FP4 base: target only Linear layers")
    if problems:
        raise ValueError("This LoRA config cannot be served by vLLM: " + "; ".join(problems) + ".")
    return int(cfg.r)


def peft_to_vllm_lora_tensors(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names vLLM's LoRA loader parses (PEFT's saved-adapter names).

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` etc.: PEFT's own serialization, so vLLM's
    ``parse_fine_tuned_lora_name`` maps them onto its (packed) qkv_proj / gate_up_proj LoRA slices.
    """
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not (name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")):
            raise ValueError(
                f"Adapter tensor {name!r} is not a LoRA A/B weight; vLLM can serve only plain LoRA adapters "
                "(no DoRA magnitudes, biases, embeddings or modules_to_save)."
            )
        out[name] = t.detach()
    if not out:
        raise ValueError(f"The model has no LoRA weights for adapter {adapter_name!r}.")
    return out


def peft_lora_modules(
    model: nn.Module, adapter_name: str = "default"
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """The policy's LoRA for the single-LoRA engine path (:mod:`qerl_trl.vllm_plugin`):
    ``({module name in vLLM's tree: (A [r, in], B [out, r])}, scaling)``.

    PEFT's ``base_model.model.`` prefix is dropped (``model.layers.0.self_attn.q_proj``: the decoder models vLLM and
    transformers share name their modules alike). The tensors are PEFT's own (no copy); the engine folds the one
    ``scaling`` (``lora_alpha / r``, or rsLoRA's) into B as it copies it. :func:`check_lora_config_for_vllm` has
    ruled out per-module alphas, so every module has the same scaling; a model where they differ is an error.
    """
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings = set()
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or adapter_name not in lora_a:
            continue
        out[name.removeprefix("base_model.model.")] = (lora_a[adapter_name].weight.detach(),
                                                       lora_b[adapter_name].weight.detach())  # fmt: skip
        scalings.add(float(module.scaling[adapter_name]))
    if not out:
        raise ValueError(f"The model has no LoRA modules for adapter {adapter_name!r}.")
    if len(scalings) != 1:
        raise ValueError(f"vllm_lora_backend='qerl' serves one LoRA scaling, the model has {sorted(scalings)}. "
                         f"{OTHER_BACKEND_HINT}")  # fmt: skip
    return out, scalings.pop()


def write_adapter_dir(
    path: str, tensors: dict[str, torch.Tensor], peft_config: Any, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (the layout vLLM's loader reads)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = peft_config.to_dict()
    cfg = json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(
        {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )


def cast_norms_to_fp32(model: nn.Module, param_names: Iterable[str]) -> list[str]:
    """Make the named 1-D norm weights float32 Parameters in place (keeping device); return the names changed.

    The module's ``weight`` attribute is replaced by a float32 Parameter so that vLLM's RMSNorm multiplies in fp32.
    """
    changed = []
    for name in param_names:
        mod_name, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(mod_name)
        except AttributeError:
            raise ValueError(
                f"AQN norm {name!r} was not found in vLLM's model ({type(model).__name__}); the HF and vLLM module "
                "trees differ for this architecture."
            ) from None
        w = getattr(module, attr)
        if w.dtype != torch.float32:
            setattr(module, attr, nn.Parameter(w.data.to(torch.float32), requires_grad=False))
            changed.append(name)
    return changed


# ---------------------------------------------------------------------------------------- vLLM-facing parts


@contextlib.contextmanager
def fp32_norms_during_load(param_names: list[str]) -> Iterator[None]:
    """While building a vLLM ``LLM``: right after vLLM loads its weights, cast ``param_names`` to float32.

    Wraps ``vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model`` (vLLM 0.24), which runs
    inside the worker's "weights" memory pool (so sleep level 1 offloads/restores them too) and before
    torch.compile tracing and CUDA-graph capture.
    """
    if not param_names:
        yield
        return
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        changed = cast_norms_to_fp32(model, param_names)
        logger.info("AQN: %d vLLM norm weights kept in float32", len(changed))
        return model

    base_loader.BaseModelLoader.load_model = load_model
    try:
        yield
    finally:
        base_loader.BaseModelLoader.load_model = original


def compile_cache_marker(fp32_norm_names: Iterable[str], hf_overrides: dict | None = None) -> dict[str, str]:
    """vLLM ``additional_config`` that gives engines with float32 norms their own torch.compile cache.

    vLLM 0.24 keys its compile cache (``vllm/compilation/backends.py``) on its configs, env and the traced source
    files, not on parameter dtypes. :func:`fp32_norms_during_load` changes the norms' dtype after the configs are
    hashed, so without a marker an AQN engine loads the kernels another engine compiled for bf16 norms on the same
    checkpoint (or the reverse) and generates garbage. ``VllmConfig.additional_config`` is hashed into that key.
    Engines without fp32 norms get a marker too, so a cache an AQN engine filled before this marker existed is
    never read by them.

    The single-LoRA engine (lora_backend="qerl") sizes its LoRA buffers from ``hf_overrides``, which vLLM leaves
    out of that key too (``ModelConfig.compute_hash`` ignores ``hf_overrides``): its LoRA spec goes in as well, so a
    run with another rank or other target modules never loads kernels compiled for the old shapes.
    """
    names = sorted(fp32_norm_names)
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16] if names else "none"
    marker = {"qerl_fp32_norms": digest}
    if hf_overrides:
        marker["qerl_overrides"] = hashlib.sha256(json.dumps(hf_overrides, sort_keys=True).encode()).hexdigest()[:16]
    return marker


class LoRAServingLLM:
    """Proxy for a vLLM ``LLM`` used by TRL's ``VLLMGeneration.generate``.

    * ``generate`` gets ``lora_request=<current adapter>`` (so rollouts use the trained LoRA on the FP4 base);
    * ``sleep(level=2)`` becomes level 1: level 2 discards weights and its reload path breaks LoRA in vLLM 0.24.
    Everything else is forwarded unchanged.
    """

    def __init__(self, llm: Any, adapters: bool = True):
        self._llm = llm
        self.adapters = adapters  # False: the LoRA is built into the engine's layers (lora_backend="qerl")
        self.lora_request = None

    def generate(self, *args, **kwargs):
        if self.adapters and kwargs.get("lora_request") is None:
            if self.lora_request is None:
                raise RuntimeError("No LoRA adapter has been pushed to vLLM yet: call sync_weights() first.")
            kwargs["lora_request"] = self.lora_request
        return self._llm.generate(*args, **kwargs)

    def sleep(self, level: int = 1, **kwargs):
        return self._llm.sleep(level=1, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._llm, name)


@dataclass
class VLLMServingSpec:
    """What QeRL's vLLM engine serves: the NVFP4A16 checkpoint, the LoRA rank bound and the fp32 norm names."""

    checkpoint: str
    tokenizer: str
    max_lora_rank: int
    fp32_norm_names: list[str] = field(default_factory=list)
    enforce_eager: bool = False
    lora_sync_dir: str = "/dev/shm"
    dtype: str = "bfloat16"
    lora_backend: str = "vllm"  # "vllm": vLLM's LoRA adapters; "qerl": the LoRA inside our quantization method


class _AdapterPusher:
    """Pushes one adapter per round into the engine; only the newest one stays loaded."""

    def __init__(self, llm: Any, sync_dir: str):
        self.llm = llm
        self.sync_dir = sync_dir
        self.current_id = 0

    def push(self, tensors: dict[str, torch.Tensor], peft_config: Any):
        from vllm.lora.request import LoRARequest

        new_id = self.current_id + 1
        tmp = tempfile.mkdtemp(prefix=f"qerl-lora-{os.getpid()}-", dir=self.sync_dir)
        try:
            write_adapter_dir(tmp, tensors, peft_config)
            request = LoRARequest(lora_name=f"qerl-{new_id}", lora_int_id=new_id, lora_path=tmp)
            engine = self.llm.llm_engine
            if self.current_id:
                engine.remove_lora(self.current_id)
            engine.add_lora(request)  # loads the files now (to CPU; moved to the GPU slot on first use)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.current_id = new_id
        return request


def push_norm_weights(llm: Any, noised: dict[str, torch.Tensor]) -> int:
    """Copy AQN-noised norm weights (keyed by vLLM parameter name) in place into vLLM's model; return count."""

    def _apply(model: nn.Module) -> int:
        params = dict(model.named_parameters())
        n = 0
        for name, value in noised.items():
            p = params.get(name)
            if p is None:
                raise KeyError(f"vLLM's model has no parameter {name!r} for the AQN noise.")
            p.data.copy_(value.to(device=p.device, dtype=p.dtype))
            n += 1
        return n

    return sum(llm.apply_model(_apply))


def make_qerl_vllm_generation_class():
    """Build ``QeRLVLLMGeneration`` (a subclass of TRL 1.16's ``VLLMGeneration``); imported lazily with vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration, empty_cache
    from trl.trainer.utils import ensure_master_addr_port

    class QeRLVLLMGeneration(VLLMGeneration):
        """TRL's colocated vLLM backend, serving the NVFP4 base + the policy LoRA as an in-memory adapter."""

        serving: VLLMServingSpec

        def __init__(self, *args, serving: VLLMServingSpec, **kwargs):
            self.serving = serving
            self.pending_norms: dict[str, torch.Tensor] | None = None
            self.last_sync_seconds = 0.0
            super().__init__(*args, **kwargs)

        def _init_vllm(self):
            from vllm import LLM

            if self.mode != "colocate":
                raise ValueError("QeRLGRPOTrainer supports vllm_mode='colocate' only.")
            accelerator = self.accelerator
            if accelerator.num_processes % self.tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size ({self.tensor_parallel_size}) must divide world size "
                    f"({accelerator.num_processes}) evenly."
                )
            if self.tensor_parallel_size > 1:
                self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                    [
                        list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                        for i in range(accelerator.num_processes // self.tensor_parallel_size)
                    ]
                )
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            spec = self.serving
            if spec.lora_backend == "qerl":
                engine_lora = single_lora_engine_kwargs(spec.checkpoint, self.model)
            else:
                engine_lora = {"enable_lora": True, "max_lora_rank": spec.max_lora_rank, "max_loras": 1,
                               "max_cpu_loras": 2}  # fmt: skip
            with fp32_norms_during_load(spec.fp32_norm_names):
                llm = LLM(
                    model=spec.checkpoint,
                    tokenizer=spec.tokenizer,
                    dtype=spec.dtype,
                    tensor_parallel_size=self.tensor_parallel_size,
                    gpu_memory_utilization=self.gpu_memory_utilization,
                    max_model_len=self.max_model_length,
                    max_num_seqs=self.max_num_seqs,
                    enable_sleep_mode=self.enable_sleep_mode,
                    model_impl=self.model_impl,
                    distributed_executor_backend="external_launcher",
                    seed=accelerator.process_index // self.tensor_parallel_size,
                    max_num_batched_tokens=4096,
                    logprobs_mode="processed_logprobs",
                    trust_remote_code=self.trust_remote_code,
                    enforce_eager=spec.enforce_eager,
                    additional_config=compile_cache_marker(spec.fp32_norm_names, engine_lora.get("hf_overrides")),
                    **engine_lora,
                )
            self.llm = LoRAServingLLM(llm, adapters=spec.lora_backend != "qerl")
            self._pusher = _AdapterPusher(llm, spec.lora_sync_dir) if spec.lora_backend != "qerl" else None
            if self.enable_sleep_mode:
                self.llm.sleep(level=1)
            self._llm_weights_sleeping = self.enable_sleep_mode
            accelerator.wait_for_everyone()

        def sync_weights(self):
            """Push the current LoRA as a new adapter and the pending AQN norms; never touch the FP4 base."""
            t0 = time.perf_counter()
            if self.enable_sleep_mode and self._llm_weights_sleeping:
                empty_cache()
                self.llm.wake_up(tags=["weights"])
            lora_params = [p for n, p in self.model.named_parameters() if "lora_" in n]
            single_lora = self.serving.lora_backend == "qerl"
            with self._dist.gather_params(lora_params):
                if single_lora:  # copied into the engine's layers while gathered
                    self.push_lora(*peft_lora_modules(self.model))
                else:
                    tensors = {k: v.clone() for k, v in peft_to_vllm_lora_tensors(self.model).items()}
            if not single_lora:
                self.llm.lora_request = self._pusher.push(tensors, self.model.peft_config["default"])
            if self.pending_norms:
                push_norm_weights(self.llm, self.pending_norms)
                self.pending_norms = None
            self.llm.reset_prefix_cache()
            # Level-1 sleep keeps the weights (offloaded to CPU); TRL's generate() must not re-sync.
            self._llm_weights_sleeping = False
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.last_sync_seconds = time.perf_counter() - t0

        def push_lora(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float = 1.0) -> int:
            """lora_backend="qerl": copy the LoRA into the engine's layers in place (every module must land)."""
            from ..vllm_plugin.single_lora import push_lora_in_place

            return sum(self.llm.apply_model(lambda model: push_lora_in_place(model, adapters, scaling)))

        def clear_lora(self) -> int:
            """lora_backend="qerl": serve the bare NVFP4 base (zero LoRA) until the next sync; for checks."""
            n = self.push_lora({})  # every LoRA slot missing from the push is zeroed
            self.llm.reset_prefix_cache()  # cached KV was computed with the LoRA
            return n

    return QeRLVLLMGeneration


def single_lora_engine_kwargs(checkpoint: str, model: nn.Module) -> dict[str, Any]:
    """``LLM(...)`` arguments for lora_backend="qerl": our quantization method (registered here too, in case vLLM's
    plugin entry point is not installed), told the LoRA's rank and target modules through ``hf_overrides``."""
    from ..vllm_plugin import QUANT_NAME, lora_quantization_overrides, register

    register(strict=True)
    rank = int(model.peft_config["default"].r)  # not the tensors' shapes: ZeRO-3 shards them to size 0 here
    targets = {name.rsplit(".", 1)[-1] for name in peft_lora_modules(model)[0]}
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    return {"quantization": QUANT_NAME, "hf_overrides": lora_quantization_overrides(config, rank, targets)}


@contextlib.contextmanager
def swap_trl_vllm_generation(factory: Callable[..., Any]) -> Iterator[None]:
    """During ``GRPOTrainer.__init__`` (TRL 1.16), make ``VLLMGeneration(...)`` build ``factory(...)`` instead."""
    from trl.trainer import grpo_trainer

    if not hasattr(grpo_trainer, "VLLMGeneration"):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.VLLMGeneration not found: this TRL version differs from the one QeRL's vLLM "
            f"integration was written against (TRL {WRITTEN_AGAINST['trl']})."
        )
    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
