"""The GRPO step end to end: TRL BF16 LoRA vs QeRL vs TRL QLoRA, vLLM colocate, on Qwen2.5-shaped models.

    python benchmarks/e2e_step.py --sizes 7b --out-dir /tmp/e2e            # every row of the 7B matrix
    python benchmarks/e2e_step.py --sizes 7b --arms qerl --only 8x8-512-sleep
    python benchmarks/e2e_step.py --merge A.jsonl B.jsonl --out-dir benchmarks/results   # -> e2e_step-<gpu>.json

Arms, each a user's real TRL run (random weights, so no Hub is needed; every completion runs to the length limit
because a random model almost never samples EOS, so every arm does the same work):

* ``trl_bf16``: TRL's ``GRPOTrainer``, BF16 base + PEFT LoRA, vLLM colocate, TRL's own merged weight sync (sleep
  mode: TRL's level 2);
* ``qerl``: ``QeRLGRPOTrainer`` on an NVFP4A16 checkpoint, AQN on, vLLM colocate with the LoRA served as an
  adapter loaded from files every round (``vllm_lora_sync_in_place=False``; sleep mode: level 1);
* ``qerl_single_lora``: the same with ``vllm_lora_backend="qerl"``: the LoRA inside QeRL's vLLM quantization method;
* ``qerl_inplace``: ``qerl`` with ``vllm_lora_sync_in_place=True`` (the default): after the first round, the
  adapter's weights are written into the loaded adapter on the GPU instead of loaded from files;
* ``trl_qlora``: TRL's ``GRPOTrainer`` with a bitsandbytes NF4 base (QLoRA, the paper's other baseline). TRL 1.16
  builds its colocated engine with vLLM's in-flight bitsandbytes quantization and syncs by merging the LoRA into
  the NF4 base; ``qlora_generation`` rows with ``hf`` generate with the training model instead (``use_vllm=False``).

An arm may run at its own settings: ``ARM:mbN`` (N completions per micro-batch instead of ``MICRO_BATCH``'s),
``ARM:nogc`` (no gradient checkpointing) and, for QeRL arms, ``ARM:fis`` (``fused_importance_sampling=True``),
e.g. ``--arms trl_bf16:mb16 qerl_single_lora:mb16:fis``; the row names them, and the speed-up's baseline is TRL's
fastest setting of the run. ``qerl:experts`` / ``qerl_inplace:experts`` (vLLM's adapters) add a LoRA on a MoE's
routed experts (issue #54; a dense size is ``not_run``). ``qerl_single_lora:ahead`` sets
``vllm_humming_compile_ahead=True``; with
``--cold-humming`` every QeRL row starts on an empty Humming cache of its own (``init_s`` is then a first start's
on this machine, issue #55 item 4).

LoRA r32 (alpha 64) on every linear, gradient checkpointing, bf16, 128-token prompts, AdamW, ``max_steps`` steps
of one generation round each (``per_device_train_batch_size`` completions per micro-batch, gradient accumulation
over the round). Each row runs in its own process (a fresh CUDA context and vLLM engine) and reports the median of
the steps after the first (``--steps 6``: five measured steps; ``step_s_min`` / ``step_s_max`` over them):
``step_s`` (optimizer step to optimizer step, CUDA-synchronized), ``rollout_s`` (vLLM ``generate``, or HF
generation), ``sync_s`` (the trainer's weight/adapter push into vLLM; QeRL rows split it by phase in
``sync_phases_per_step``; ``QERL_E2E_PROFILE_SYNC=1`` adds its cProfile as ``sync_profile``;
``QERL_E2E_PROFILE_ROLLOUT=N`` profiles step N's rollout with torch's profiler: ``rollout_profile``), ``train_s``
(the rest: log-probs, loss, backward, optimizer), ``peak_gib`` (device memory in use, sampled every 20 ms by NVML
during the training steps: vLLM's pools included; ``peak_gib_by_phase``: the same in the rollouts, the syncs and the
rest) and ``torch_peak_gib``. An OOM or a failure is a row with its ``status``.
Every row keeps its ``commit`` and its ``run`` (one invocation: one machine, the arms back to back), and
``speedup_vs_trl_bf16`` is computed only against the TRL row of the same run.

Checkpoints are written once per machine under ``--work``: BF16 with ``from_config`` on the GPU (7B, 14B), NVFP4A16
with random packed weights directly (every size; a 32B BF16 checkpoint, 65 GB, does not fit a 64 GiB disk).
``--sizes 30b-a3b`` (Qwen3-30B-A3B, issue #54): QeRL arms train from the NVFP4A16 checkpoint; TRL's arm is
``not_run`` on a card smaller than its two BF16 copies (``unrunnable``), and elsewhere needs the BF16 checkpoint
(61 GB: a 4-GPU machine's disk).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ARMS = ("trl_bf16", "qerl", "trl_qlora", "qerl_single_lora", "qerl_inplace")
#: QeRL arms: "qerl" serves the LoRA through vLLM's LoRA adapters, "qerl_single_lora" through QeRL's single-LoRA
#: vLLM method (QeRLGRPOConfig.vllm_lora_backend="qerl"), "qerl_inplace" through vLLM's adapters refreshed in place
QERL_ARMS = {"qerl": "vllm", "qerl_single_lora": "qerl", "qerl_inplace": "vllm"}
#: further QeRLGRPOConfig options of a QeRL arm
ARM_OPTIONS: dict[str, dict[str, Any]] = {"qerl": {"vllm_lora_sync_in_place": False},
                                          "qerl_inplace": {"vllm_lora_sync_in_place": True}}
DEFAULT_ARMS = ("trl_bf16", "qerl", "trl_qlora", "qerl_single_lora")
SIZES = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "14b": "qwen2.5-14b", "32b": "qwen2.5-32b",
         "30b-a3b": "qwen3-30b-a3b"}
#: mixture-of-experts sizes (issue #54): QeRL arms train them from NVFP4A16; TRL's arms need their
#: BF16 checkpoint (61 GB: a 4-GPU machine's disk), written only where a TRL arm can run (``unrunnable``)
MOE_SIZES = ("30b-a3b",)
#: vLLM's share of the GPU, the same for every arm of a size (what a BF16 engine needs for weights + KV cache).
#: 30B-A3B: 0.35 (28 GiB of an H100: 17 GiB of NVFP4 weights, about 8 GiB of KV cache where a 2 x 8 x 512 round
#: needs 1 GiB); its rows at 0.45 peaked at 62.4 GiB on an H100, in the rollout, over issue #54's 60 GiB target.
GPU_MEMORY_UTILIZATION = {"1.5b": 0.3, "7b": 0.35, "14b": 0.55, "32b": 0.45, "30b-a3b": 0.35}
#: an H100 80GB's memory as torch reports it (about): ``--card-gib`` for "would this fit an 80 GB card"
H100_80GB_GIB = 79.2
PROMPT_TOKENS = 128
LORA_R, LORA_ALPHA = 32, 64
#: completions per micro-batch (fwd/bwd): ~5k tokens each
MICRO_BATCH = {512: 8, 2048: 2}
#: a 32B BF16 checkpoint does not fit the GPU machine's disk, and its weights alone (61 GiB) plus vLLM's copy do
#: not fit 80 GB: those rows are recorded, not run
BF16_MAX_SIZE = ("1.5b", "7b", "14b")


@dataclasses.dataclass(frozen=True)
class RowSpec:
    size: str
    arm: str
    prompts: int
    generations: int
    completion_len: int
    sleep: bool
    generation: str = "vllm"  # "vllm" (colocate) or "hf" (the training model's generate)
    micro_batch: int | None = None  # completions per micro-batch; None: MICRO_BATCH's for the completion length
    grad_ckpt: bool = True  # gradient checkpointing
    fused_is: bool = False  # QeRL arms: fused_importance_sampling
    humming_ahead: bool = False  # qerl_single_lora: vllm_humming_compile_ahead
    expand_in_gemm: bool = False  # qerl_single_lora: vllm_lora_expand_in_gemm
    lora_experts: bool = False  # QeRL arms on vLLM's adapters, MoE sizes: a LoRA on the routed experts too

    @property
    def arm_options(self) -> str:
        """The arm as ``--arms`` names it: ``qerl_single_lora:mb16:nogc:fis``."""
        return (self.arm + (f":mb{self.micro_batch}" if self.micro_batch else "") + ("" if self.grad_ckpt else ":nogc")
                + (":fis" if self.fused_is else "") + (":ahead" if self.humming_ahead else "")
                + (":expand" if self.expand_in_gemm else "") + (":experts" if self.lora_experts else ""))

    @property
    def name(self) -> str:
        return (f"{self.size}/{self.arm_options}/{self.prompts}x{self.generations}-{self.completion_len}"
                f"-{'sleep' if self.sleep else 'nosleep'}{'' if self.generation == 'vllm' else '-hf'}")

    @property
    def short(self) -> str:
        return f"{self.prompts}x{self.generations}-{self.completion_len}-{'sleep' if self.sleep else 'nosleep'}"


def parse_arm(text: str) -> dict[str, Any]:
    """``"trl_bf16:mb16:nogc"`` -> ``{"arm": "trl_bf16", "micro_batch": 16, "grad_ckpt": False, "fused_is": False}``:
    an arm of :data:`ARMS`, optionally at another micro-batch (``:mbN``), without gradient checkpointing
    (``:nogc``) or, for a QeRL arm, with ``fused_importance_sampling`` (``:fis``; without it the arm passes
    ``False``, whatever the config's default), so each arm can run at its own best settings beside the others;
    ``qerl_single_lora:ahead``: ``vllm_humming_compile_ahead``;
    ``qerl_single_lora:expand``: ``vllm_lora_expand_in_gemm``."""
    arm, *options = text.split(":")
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r} in {text!r}: one of {ARMS}, with :mbN, :nogc and/or :fis (:ahead)")
    out: dict[str, Any] = {"arm": arm, "micro_batch": None, "grad_ckpt": True, "fused_is": False,
                           "humming_ahead": False, "expand_in_gemm": False, "lora_experts": False}
    for option in options:
        if re.fullmatch(r"mb[1-9]\d*", option):
            out["micro_batch"] = int(option[2:])
        elif option == "nogc":
            out["grad_ckpt"] = False
        elif option == "fis" and arm in QERL_ARMS:
            out["fused_is"] = True
        elif option == "ahead" and QERL_ARMS.get(arm) == "qerl":
            out["humming_ahead"] = True
        elif option == "expand" and QERL_ARMS.get(arm) == "qerl":
            out["expand_in_gemm"] = True
        elif option == "experts" and QERL_ARMS.get(arm) == "vllm":  # vLLM's fused-MoE LoRA serves it
            out["lora_experts"] = True
        else:
            raise ValueError(f"unknown arm option {option!r} in {text!r}: :mbN (completions per micro-batch), :nogc "
                             "or, on a QeRL arm, :fis, on qerl_single_lora :ahead or :expand, on qerl / qerl_inplace "
                             ":experts")
    return out


def default_matrix(arms: tuple[str, ...] | list[str] = DEFAULT_ARMS) -> list[RowSpec]:
    """The committed matrix, in the order it is run (most informative first: device time is finite). 7B: 2x8 and
    8x8 completions, 512 and 2048 tokens, sleep mode on and off (``--only 2x8-512-nosleep 2x8-2048-sleep
    8x8-512-nosleep`` are the step table of README); 14B and 32B: sleep on, which a colocated engine
    beside a 14B/32B policy needs on 80 GB. QLoRA also with HF generation, in case TRL's vLLM QLoRA path fails."""
    settings = [
        # issue #25's three 7B settings (one run each: TRL BF16 LoRA and QeRL with both LoRA backends)
        ("7b", 2, 8, 512, False),
        ("7b", 2, 8, 2048, True),  # the long completions of reasoning RL; TRL needs sleep mode here on 80 GB
        ("7b", 8, 8, 512, False),
        ("7b", 8, 8, 512, True),
        ("32b", 1, 8, 2048, True),
        ("14b", 8, 8, 512, True),
        ("30b-a3b", 2, 8, 512, True),  # issue #54's MoE row: Qwen3-30B-A3B, sleep mode on
        ("7b", 2, 8, 512, True),  # the dense step beside it, as it runs (#54: the MoE step within 1.5x of it)
    ]
    rows = [RowSpec(size=size, prompts=p, generations=g, completion_len=length, sleep=sleep, **parse_arm(arm))
            for size, p, g, length, sleep in settings for arm in arms]
    if "trl_qlora" in arms:
        rows.append(RowSpec("7b", "trl_qlora", 2, 8, 512, False, "hf"))
    return rows


# ------------------------------------------------------------------------------------------ checkpoints
def checkpoint_paths(work: str, size: str) -> dict[str, str]:
    return {"bf16": os.path.join(work, f"{size}-bf16"), "nvfp4": os.path.join(work, f"{size}-nvfp4")}


def prepare_checkpoints(work: str, size: str, need_bf16: bool) -> dict[str, float]:
    """Write this size's checkpoints (skipped when present) after deleting other sizes' (disk)."""
    import torch

    from benchmarks import random_models as rm

    for other in SIZES:
        if other != size:
            for p in checkpoint_paths(work, other).values():
                shutil.rmtree(p, ignore_errors=True)
    paths = checkpoint_paths(work, size)
    out = {}
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rm.write_nvfp4_checkpoint(paths["nvfp4"], SIZES[size], device=device, seed=0)
    out["nvfp4_write_s"] = round(time.perf_counter() - t0, 1)
    if need_bf16:
        t0 = time.perf_counter()
        rm.write_bf16_checkpoint(paths["bf16"], SIZES[size], device=device, seed=0)
        out["bf16_write_s"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------------ one row (child)
def nvml_handle(nvml: Any, device_index: int) -> Any:
    """NVML's handle of torch's ``cuda:<device_index>``. NVML numbers every GPU of the machine and ignores
    ``CUDA_VISIBLE_DEVICES``, so the index would read another GPU in a lane that sees only GPU 1 (a 7B row there once
    reported GPU 0's 121.7 GiB); the UUID names the same physical device in both."""
    from benchmarks._common import gpu_uuid

    uuid = gpu_uuid(device_index)
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)


class _PeakMemory:
    """Device memory in use (NVML, every 20 ms, the whole GPU: vLLM's pools included) between start() and stop(),
    overall and by phase of the step: :class:`_Timed` methods switch :attr:`phase` while they run ("rollout",
    "sync"; "train" otherwise), so a row says whether its peak came with the engine awake beside the trainer or in
    the training pass (issue #54: the 30B-A3B row's 62.9 GiB)."""

    def __init__(self, interval: float = 0.02, device_index: int = 0):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.device_index = device_index
        self._thread: threading.Thread | None = None
        self.phase = "train"
        self.by_phase: dict[str, int] = {}

    def sample(self) -> None:
        used = self._used()
        self.peak = max(self.peak, used)
        self.by_phase[self.phase] = max(self.by_phase.get(self.phase, 0), used)

    def enter(self, phase: str) -> str:
        """Samples the phase that ends, then switches to ``phase``; returns the phase it left."""
        if self._thread is not None and not self._stop.is_set():
            self.sample()
        left, self.phase = self.phase, phase
        return left

    def by_phase_gib(self) -> dict[str, float]:
        return {phase: round(used / 2**30, 2) for phase, used in sorted(self.by_phase.items())}

    def _used(self) -> int:
        import torch

        if self._nvml is not None:
            return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
        free, total = torch.cuda.mem_get_info()
        return total - free

    def start(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, nvml_handle(pynvml, self.device_index)
        except Exception:  # no NVML: torch's view of the device
            self._nvml = None
        self.sample()

        def loop():
            while not self._stop.wait(self.interval):
                self.sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._thread is not None:
            self.sample()
        return self.peak / 2**30


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timed:
    """Wraps a bound method: CUDA-synchronized wall time of each call, accumulated until ``take()``; with ``memory``,
    the calls are that sampler's ``phase``."""

    def __init__(self, obj: Any, name: str, memory: _PeakMemory | None = None, phase: str = ""):
        self.total = 0.0
        original = getattr(obj, name)

        def wrapped(*a, **kw):
            _sync()
            left = memory.enter(phase) if memory is not None else None
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                _sync()
                self.total += time.perf_counter() - t0
                if memory is not None:
                    memory.enter(left)

        setattr(obj, name, wrapped)

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


class _profile_round:
    """torch's profiler over the ``index``-th call (1-based) of a bound method (``QERL_E2E_PROFILE_ROLLOUT=N``: the
    rollout of step N). Issue #55: at 7B 8 x 8 x 512 on an H100, QeRL's rollout phase ran at 6337 tokens/s where its
    engine decodes about 9100 alone, and TRL's at 7417; the profile says whether the round's time is GPU work (by
    :mod:`benchmarks.decode_profile`'s kernel categories; in a BF16 arm every linear is a "logits_gemm") or the GPU
    waiting on the host. Wrap it around the rollout timer: the profiled step's own timings then include CUPTI's cost,
    and the row's medians exclude at most that one step of five."""

    def __init__(self, obj: Any, name: str, index: int):
        self.calls, self.index, self.result = 0, index, None
        original = getattr(obj, name)

        def wrapped(*a, **kw):
            self.calls += 1
            if self.calls != self.index:
                return original(*a, **kw)
            import torch

            from benchmarks.decode_profile import gpu_events, summarize

            _sync()
            t0 = time.perf_counter()
            kinds = torch.profiler.ProfilerActivity
            with torch.profiler.profile(activities=[kinds.CUDA if torch.cuda.is_available() else kinds.CPU]) as prof:
                out = original(*a, **kw)
                _sync()
            wall_ms = (time.perf_counter() - t0) * 1000
            self.result = self.summary(summarize(gpu_events(prof)), wall_ms)
            return out

        setattr(obj, name, wrapped)

    def summary(self, events: dict[str, Any], wall_ms: float) -> dict[str, Any]:
        """One round in milliseconds: its wall time, the GPU's busy time and the rest (the GPU waiting on the host,
        across the round), the time by kernel category and the 15 costliest kernels."""
        busy = events["busy_us"] / 1000
        top = sorted(events["by_name"].items(), key=lambda kv: -kv[1][0])[:15]
        return {"step": self.index, "wall_ms": round(wall_ms, 1), "gpu_busy_ms": round(busy, 1),
                "gpu_idle_ms": round(wall_ms - busy, 1), "gpu_span_ms": round(events["span_us"] / 1000, 1),
                "ms_by_category": {c: round(us / 1000, 1) for c, us in
                                   sorted(events["us_by_category"].items(), key=lambda kv: -kv[1])},
                "top_kernels": [{"kernel": n[:140], "ms": round(us / 1000, 1), "calls": calls}
                                for n, (us, calls) in top]}  # fmt: skip


class _profile_calls:
    """cProfile over every call of a bound method (``QERL_E2E_PROFILE_SYNC=1``: the sync's hot spots in the row)."""

    def __init__(self, obj: Any, name: str):
        import cProfile

        self.prof = cProfile.Profile()
        original = getattr(obj, name)

        def wrapped(*a, **kw):
            self.prof.enable()
            try:
                return original(*a, **kw)
            finally:
                self.prof.disable()

        setattr(obj, name, wrapped)

    def report(self, top: int = 30) -> str:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(self.prof, stream=buf).sort_stats("cumulative").print_stats(top)
        return buf.getvalue()[-6000:]


def _reward(completions, **kwargs):
    """Any reward with variance across a group (the content of random-model text does not matter)."""
    import zlib

    texts = [c if isinstance(c, str) else str(c) for c in completions]
    return [float(zlib.crc32(t.encode()) % 1000) / 1000.0 for t in texts]


def vllm_memory_utilization(size: str, card_gib: float | None = None) -> float:
    """vLLM's share of this GPU for ``size``. With ``card_gib``, on a larger card, the share that gives vLLM the GiB
    it would get on a card of ``card_gib``: vLLM sizes its KV cache as a fraction of the whole card, so the same
    fraction on a 141 GB H200 holds 27 GiB more at 32B than on an 80 GB H100, and the peak says nothing about the
    smaller card."""
    share = GPU_MEMORY_UTILIZATION[size]
    if card_gib is None:
        return share
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else card_gib
    return round(share * min(1.0, card_gib / total), 4)


def build_trainer(spec: RowSpec, work: str, steps: int, seed: int = 0, tp: int = 1, overrides: dict | None = None,
                  card_gib: float | None = None):
    """The arm's trainer; ``overrides``: further QeRLGRPOConfig options of a QeRL arm (multi_gpu.py's server mode);
    ``card_gib``: size vLLM's share as on a card of that many GiB (:func:`vllm_memory_utilization`)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from benchmarks import random_models as rm

    paths = checkpoint_paths(work, spec.size)
    n_completions = spec.prompts * spec.generations
    micro = spec.micro_batch or min(MICRO_BATCH.get(spec.completion_len, 8), n_completions)
    if n_completions % micro:
        raise ValueError(f"{spec.name}: {n_completions} completions do not split into micro-batches of {micro}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["nvfp4"] if spec.arm in QERL_ARMS else paths["bf16"])
    prompts = rm.make_prompts(spec.prompts * (steps + 2), PROMPT_TOKENS, seed=seed, tokenizer=tok)
    dataset = Dataset.from_dict({"prompt": prompts})
    common = dict(
        output_dir=os.path.join(work, "out", spec.name.replace("/", "_")),
        report_to="none",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        seed=seed,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # CPU: the smoke test, with generation="hf"
        gradient_checkpointing=spec.grad_ckpt,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n_completions // micro,
        num_generations=spec.generations,
        max_completion_length=spec.completion_len,
        use_vllm=spec.generation == "vllm",
        # equal work in every arm: random weights rarely sample EOS, but a 32B row once did (mean length 1887 of 2048);
        # vLLM takes ignore_eos, transformers' generate (the hf rows) min_new_tokens
        generation_kwargs=({"ignore_eos": True} if spec.generation == "vllm"
                           else {"min_new_tokens": spec.completion_len}),
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=vllm_memory_utilization(spec.size, card_gib),
        vllm_max_model_length=PROMPT_TOKENS + spec.completion_len + 16,
        vllm_enable_sleep_mode=spec.sleep,
        vllm_tensor_parallel_size=tp,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if spec.arm in QERL_ARMS:
        from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
        from qerl_trl.quantizer.moe import MOE_LORA_TARGETS

        args = QeRLGRPOConfig(**{**common, "lora_r": LORA_R, "lora_alpha": LORA_ALPHA, "aqn": True,
                                 "nvfp4_cache_dir": os.path.join(work, "qerl-cache"),
                                 "vllm_lora_backend": QERL_ARMS[spec.arm], **ARM_OPTIONS.get(spec.arm, {}),
                                 "fused_importance_sampling": spec.fused_is,
                                 "vllm_humming_compile_ahead": spec.humming_ahead,
                                 "vllm_lora_expand_in_gemm": spec.expand_in_gemm,
                                 **({"lora_target_modules": [*MOE_LORA_TARGETS, "experts"]} if spec.lora_experts
                                    else {}),
                                 **(overrides or {})})
        return QeRLGRPOTrainer(model=paths["nvfp4"], reward_funcs=_reward, args=args, train_dataset=dataset,
                               processing_class=tok)
    from trl import GRPOConfig, GRPOTrainer

    quant = None
    if spec.arm == "trl_qlora":
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
    args = GRPOConfig(**common, model_init_kwargs={"dtype": "bfloat16"})
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", bias="none",
                      task_type="CAUSAL_LM")
    kwargs = dict(quantization_config=quant) if quant is not None else {}
    return GRPOTrainer(model=paths["bf16"], reward_funcs=_reward, args=args, train_dataset=dataset,
                       processing_class=tok, peft_config=lora, **kwargs)


def _classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "out of memory" in low or "outofmemory" in low or "no available memory for the cache blocks" in low \
            or "insufficient memory" in low or "cuda_error_out_of_memory" in low:
        return "oom: " + text[:400]
    return "failed: " + text[:400]


def row_name(row: dict) -> str:
    """The matrix name of a result row (``RowSpec.name``)."""
    fields = dataclasses.fields(RowSpec)
    return RowSpec(**{f.name: row.get(f.name, f.default) if f.default is not dataclasses.MISSING else row[f.name]
                      for f in fields}).name  # rows from before an option was recorded ran at its default


#: a Qwen3-30B-A3B BF16 copy (GiB): TRL colocate holds two (the policy and vLLM's engine)
MOE_BF16_GIB = 57.0


def unrunnable(spec: RowSpec, card_gib: float | None = None) -> str | None:
    """The ``not_run`` status of a row this machine cannot run by design (32B BF16/QLoRA; a MoE's TRL arms on a card
    smaller than its two BF16 copies), else None. ``card_gib``: the card's memory (default: this machine's GPU 0)."""
    if spec.lora_experts and spec.size not in MOE_SIZES:
        return f"not_run: {spec.size} is a dense model: it has no routed experts for :experts' LoRA"
    if spec.size in MOE_SIZES:
        if spec.arm in QERL_ARMS:
            return None
        if card_gib is None:
            import torch

            card_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0
        if card_gib < 2 * MOE_BF16_GIB + 8:
            return (f"not_run: TRL colocate holds the BF16 policy ({MOE_BF16_GIB:.0f} GiB) and vLLM's BF16 copy, more "
                    f"than this {card_gib:.0f} GiB card (QeRL holds the NVFP4 base, about 16 GiB, twice)")
        return None
    if spec.arm in QERL_ARMS or spec.size in BF16_MAX_SIZE:
        return None
    why = ("and TRL colocate would hold the BF16 policy (61 GiB) plus vLLM's BF16 copy: more than 80 GB"
           if spec.arm == "trl_bf16" else "and both TRL's bitsandbytes load and vLLM's in-flight bitsandbytes "
           "quantization read it")
    return f"not_run: a 32B BF16 checkpoint (65 GB) does not fit the GPU machine's 64 GiB disk, {why}"


def humming_cache_entries() -> int:
    """Compiled kernels in Humming's on-disk cache (one directory each, ``HUMMING_CACHE_DIR`` or
    ``~/.humming/cache``): a row's start that adds some compiled them, one that adds none loaded them."""
    from qerl_trl.vllm_plugin.fp4_kernel import humming_cache_dir

    cache = humming_cache_dir()
    return len(os.listdir(cache)) if os.path.isdir(cache) else 0


def run_row(spec: RowSpec, work: str, steps: int, card_gib: float | None = None) -> dict:
    """Build the arm's trainer, train ``steps`` steps, return the row (in this process); ``card_gib``: see
    :func:`vllm_memory_utilization` (the row keeps it and the share it gave)."""
    import torch
    from transformers import TrainerCallback

    row: dict[str, Any] = dict(size=spec.size, arm=spec.arm, prompts=spec.prompts, generations=spec.generations,
                               completion_len=spec.completion_len, sleep=spec.sleep, generation=spec.generation,
                               micro_batch=spec.micro_batch, grad_ckpt=spec.grad_ckpt, fused_is=spec.fused_is,
                               humming_ahead=spec.humming_ahead, expand_in_gemm=spec.expand_in_gemm,
                               lora_experts=spec.lora_experts,
                               prompt_len=PROMPT_TOKENS, lora_r=LORA_R, steps=steps,
                               vllm_gpu_memory_utilization=vllm_memory_utilization(spec.size, card_gib))
    if card_gib is not None:
        row["card_gib"] = card_gib
    if why := unrunnable(spec, card_gib):
        row["status"] = why
        return row
    t0 = time.perf_counter()
    mem = _PeakMemory()
    humming_before = humming_cache_entries()
    try:
        trainer = build_trainer(spec, work, steps, card_gib=card_gib)
        row["init_s"] = round(time.perf_counter() - t0, 1)
        gen = getattr(trainer, "vllm_generation", None) if spec.generation == "vllm" else None
        if spec.arm in QERL_ARMS and gen is not None:  # "auto" resolved on this machine (Humming or Marlin)
            row["fp4_kernel"] = gen.serving.fp4_kernel
            row["engine_start_s"] = round(gen.engine_start_seconds, 1)
            # a cold start compiles Humming's kernels (issue #55 item 4): how many this start added to the cache
            row["humming_cache_entries"] = humming_before
            row["humming_kernels_compiled"] = humming_cache_entries() - humming_before
        profile = None
        if gen is not None:
            profile = _profile_calls(gen, "sync_weights") if os.environ.get("QERL_E2E_PROFILE_SYNC") else None
            sync_t, roll_t = _Timed(gen, "sync_weights", mem, "sync"), _Timed(gen, "generate", mem, "rollout")
        else:
            sync_t, roll_t = None, _Timed(trainer, "_generate_single_turn", mem, "rollout")
        profiled_step = int(os.environ.get("QERL_E2E_PROFILE_ROLLOUT") or 0)
        rollout_profile = None
        if profiled_step:  # outside the rollout timer (set just above), so that step's time includes the profiler's
            rollout_profile = _profile_round(gen, "generate", profiled_step) if gen is not None else _profile_round(
                trainer, "_generate_single_turn", profiled_step)
        per_step: list[dict] = []
        sync_phases: list[dict] = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                _sync()
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                _sync()
                per_step.append(dict(step_s=time.perf_counter() - self.t, rollout_s=roll_t.take(),
                                     sync_s=sync_t.take() if sync_t else 0.0))
                if getattr(gen, "last_sync_phases", None) is not None:  # QeRL: where the sync's time went
                    sync_phases.append(gen.last_sync_phases)
                    gen.last_sync_phases = {}

        trainer.add_callback(StepTimer())
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        mem.start()
        t1 = time.perf_counter()
        trainer.train()
        row["train_wall_s"] = round(time.perf_counter() - t1, 1)
        row["peak_gib"] = round(mem.stop(), 2)
        row["peak_gib_by_phase"] = mem.by_phase_gib()
        if torch.cuda.is_available():
            row["torch_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        mem.stop()
        row["status"] = _classify(e)
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for s in per_step:
        s["train_s"] = s["step_s"] - s["rollout_s"] - s["sync_s"]
    measured = per_step[1:] if len(per_step) > 1 else per_step
    for key in ("step_s", "rollout_s", "sync_s", "train_s"):
        row[key] = round(statistics.median(s[key] for s in measured), 3)
        row[key + "_per_step"] = [round(s[key], 3) for s in per_step]
    if sync_phases:
        row["sync_phases_per_step"] = sync_phases
    if profile is not None:
        row["sync_profile"] = profile.report()
    if rollout_profile is not None:
        row["rollout_profile"] = rollout_profile.result or {"step": rollout_profile.index,
                                                            "status": f"not profiled: {rollout_profile.calls} calls"}
    row["step_s_min"] = round(min(s["step_s"] for s in measured), 3)
    row["step_s_max"] = round(max(s["step_s"] for s in measured), 3)
    lengths = [h.get("completions/mean_length") for h in logs]
    row["mean_completion_len_per_step"] = lengths
    row["losses"] = [h.get("loss") for h in logs]
    row.update(rollout_agreement(logs, getattr(trainer, "_rollout_guard", None)))
    row["tokens_per_step"] = spec.prompts * spec.generations * spec.completion_len
    row["rollout_tokens_per_s"] = round(row["tokens_per_step"] / row["rollout_s"], 1) if row["rollout_s"] else None
    ok_len = all(x is not None and abs(x - spec.completion_len) <= 0.02 * spec.completion_len for x in lengths)
    finite = all(x is not None and math.isfinite(x) for x in row["losses"])
    row["status"] = "ok" if (ok_len and finite and len(per_step) == steps) else (
        f"check_failed: completion lengths {lengths} (want {spec.completion_len}), losses finite={finite}, "
        f"{len(per_step)} of {steps} steps timed")
    return row


#: TRL's per-step metrics of vLLM's log-probs against the trainer's (logged by TRL, or by the fused pass)
AGREEMENT_METRICS = {
    "logp_gap_mean_per_step": "sampling/sampling_logp_difference/mean",
    "logp_gap_max_per_step": "sampling/sampling_logp_difference/max",
    "is_ratio_min_per_step": "sampling/importance_sampling_ratio/min",
    "is_ratio_max_per_step": "sampling/importance_sampling_ratio/max",
}


def rollout_agreement(logs: list[dict], guard: Any) -> dict:
    """How closely vLLM served the policy being trained, at the row's real shape: TRL's log-prob gap and
    importance-ratio metrics per step (``None`` where a step logged none), and for QeRL arms the rollout guard's
    verdict (bad rounds in a row at the end, the last round's mean gap)."""
    out: dict[str, Any] = {key: [h.get(metric) for h in logs] for key, metric in AGREEMENT_METRICS.items()}
    if guard is not None:
        out["guard_bad_rounds"] = len(guard.bad_rounds)
        out["guard_last_gap"] = None if guard.last is None else round(guard.last[0], 4)
    return out


# ------------------------------------------------------------------------------------------ driver (parent)
def _child(spec: RowSpec, work: str, steps: int, out: str, card_gib: float | None = None) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # TRL 1.16 sets vLLM's level to ERROR when unset (trl._compat._patch_vllm_logging): the start-up lines of the
    # row's engine_phases are INFO (an H200 cold-start row at 02f21fa had none of them)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    import logging

    ahead = logging.getLogger("qerl_trl.vllm_plugin.humming_ahead")  # its timing lines: the row's engine_phases
    ahead.setLevel(logging.INFO)
    if not ahead.handlers:
        ahead.addHandler(logging.StreamHandler())
    row = run_row(spec, work, steps, card_gib)
    with open(out, "w") as f:
        json.dump(row, f, default=str)


#: what a trainer start spends its time on, from the lines vLLM 0.24 (and ``humming_ahead``) log while the engine
#: starts: name -> (pattern, how several matches combine). Issue #55 item 4 (a cold start within TRL's + 30 s).
ENGINE_LOG_PHASES = {
    "load_weights_s": (r"Loading weights took ([\d.]+) seconds", "first"),
    "model_loading_s": (r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds", "first"),
    "dynamo_s": (r"Dynamo bytecode transform time: ([\d.]+) s", "sum"),
    "inductor_s": (r"Compiling a graph for compile range .*? takes ([\d.]+) s", "sum"),
    "torch_compile_s": (r"torch\.compile took ([\d.]+) s in total", "first"),
    "memory_profiling_s": (r"Memory profiling takes ([\d.]+) seconds", "first"),
    "cuda_graphs_s": (r"Graph capturing finished in ([\d.]+) secs", "first"),
    "init_engine_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", "first"),
    "humming_ahead_last_done_s": (r"compiled Humming's kernels ahead for .*? ([\d.]+) s after the first was queued",
                                  "last"),
}


def engine_log_phases(log: str) -> dict[str, float]:
    """The start-up phases a child's log names (:data:`ENGINE_LOG_PHASES`), in seconds; a phase the log does not name
    is left out (a warm torch.compile cache logs no inductor compile, say)."""
    import re

    phases: dict[str, float] = {}
    for name, (pattern, how) in ENGINE_LOG_PHASES.items():
        found = [float(m) for m in re.findall(pattern, log)]
        if found:
            phases[name] = round(sum(found) if how == "sum" else found[0] if how == "first" else found[-1], 2)
    return phases


def run_matrix(specs: list[RowSpec], work: str, steps: int, jsonl: str, timeout: float, run: str,
               card_gib: float | None = None, cold_humming: bool = False) -> list[dict]:  # fmt: skip
    """Each spec in its own child process, one after another; every row is appended to ``jsonl`` as it finishes,
    tagged with ``run``. ``cold_humming``: each QeRL row gets an empty ``HUMMING_CACHE_DIR`` of its own."""
    from benchmarks._child import run_child
    from benchmarks._common import gpu_uuid
    from qerl_trl.study.runner import own_rendezvous

    uuid = gpu_uuid()
    rows = []
    by_size: dict[str, list[RowSpec]] = {}
    for s in specs:
        by_size.setdefault(s.size, []).append(s)
    for size, group in by_size.items():
        need_bf16 = any(s.arm not in QERL_ARMS for s in group if size in BF16_MAX_SIZE
                        or (size in MOE_SIZES and unrunnable(s) is None))  # fmt: skip
        t0 = time.perf_counter()
        prep = subprocess.run([sys.executable, __file__, "--prepare", size, "--work", work]
                              + (["--with-bf16"] if need_bf16 else []), capture_output=True, text=True)
        print(f"[{size}] checkpoints ready in {time.perf_counter() - t0:.0f} s (rc {prep.returncode})", flush=True)
        if prep.returncode:
            print(prep.stdout[-2000:], prep.stderr[-4000:], flush=True)
        for spec in group:
            out = os.path.join(work, f"row-{run}.json")  # runs side by side may share --work
            if os.path.exists(out):
                os.remove(out)
            t0 = time.perf_counter()
            if prep.returncode:
                row = dict(dataclasses.asdict(spec), status=f"failed: checkpoint preparation: {prep.stderr[-400:]}")
            else:
                cmd = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(spec)), "--work", work,
                       "--steps", str(steps), "--row-out", out]
                if card_gib is not None:
                    cmd += ["--card-gib", str(card_gib)]
                env = own_rendezvous(os.environ)  # runs side by side on a host
                if cold_humming and spec.arm in QERL_ARMS:
                    env["HUMMING_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"humming-{run}-", dir=work)
                log = os.path.join(work, f"row-{run}.log")
                res = run_child(cmd, timeout, env=env, log_path=log)
                if not res.timed_out and os.path.exists(out):
                    with open(out) as f:
                        row = json.load(f)
                    with open(log, errors="replace") as f:
                        row["engine_phases"] = engine_log_phases(f.read())
                else:
                    row = dict(dataclasses.asdict(spec), status=res.status, log_tail=res.log[-2500:])
            row["row_wall_s"] = round(time.perf_counter() - t0, 1)
            row["run"], row["gpu_uuid"] = run, uuid
            rows.append(row)
            with open(jsonl, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            brief = {k: row.get(k) for k in ("step_s", "rollout_s", "sync_s", "train_s", "peak_gib", "init_s",
                                             "row_wall_s")}
            print(f"{spec.name}: {row['status'][:160]} {brief}", flush=True)
            if row["status"] != "ok" and "traceback" in row:
                print(row["traceback"][-2500:], flush=True)
    return rows


def write_meta(jsonl: str, run: str) -> None:
    """First line of a run's JSONL: where and with what it ran (``--merge`` builds the result envelope from it)."""
    from importlib import metadata

    from benchmarks._common import gpu_tag, gpu_uuid, result_envelope

    env = result_envelope("e2e_step", [], "python " + " ".join(sys.argv))
    for pkg in ("bitsandbytes", "compressed-tensors", "datasets", "accelerate"):
        try:
            env["versions"][pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    meta = {k: env[k] for k in ("gpu", "versions", "commit", "command")}
    meta["gpu_tag"], meta["gpu_uuid"] = gpu_tag(), gpu_uuid()
    meta["run"] = run
    with open(jsonl, "a") as f:
        f.write(json.dumps({"_meta": meta}) + "\n")


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_trl_bf16``: TRL BF16 LoRA's median step time (its fastest arm's, where it ran at several
    micro-batches) over this row's, same size and setting, same run (rows of no run, or of another run, get None:
    they ran on another machine or at another commit)."""
    def key(r):
        return r["size"], r["prompts"], r["generations"], r["completion_len"], r["sleep"], r.get("run")

    base: dict[tuple, float] = {}
    for r in rows:  # TRL's fastest setting of the run (its arms may run at several micro-batches)
        if r["arm"] == "trl_bf16" and r.get("status") == "ok" and r.get("run"):
            base[key(r)] = min(base.get(key(r), math.inf), r["step_s"])
    for r in rows:
        b = base.get(key(r))
        r["speedup_vs_trl_bf16"] = round(b / r["step_s"], 3) if b and r.get("status") == "ok" else None


def canonical_arm(text: str) -> str:
    """An ``--arms`` entry as rows name it (its options in one order: ``qerl:experts:fis`` -> ``qerl:fis:experts``)."""
    return RowSpec("", prompts=0, generations=0, completion_len=0, sleep=False, **parse_arm(text)).arm_options


def select(specs: list[RowSpec], sizes, arms, only) -> list[RowSpec]:
    wanted = {canonical_arm(a) for a in arms or ()}
    return [s for s in specs if (not sizes or s.size in sizes) and (not arms or s.arm_options in wanted)
            and (not only or s.short in only or s.name in only)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", choices=list(SIZES), help="sizes of the default matrix to run")
    ap.add_argument("--arms", nargs="*", help=f"of {ARMS}, each optionally :mbN (completions per micro-batch) and/or "
                    ":nogc (no gradient checkpointing) and, on QeRL arms, :fis (fused_importance_sampling), e.g. "
                    "trl_bf16:mb16 qerl_single_lora:mb16:fis")
    ap.add_argument("--only", nargs="*", help="settings to run, e.g. 8x8-512-sleep or a full row name")
    ap.add_argument("--steps", type=int, default=6, help="steps per row; the median is over all but the first")
    ap.add_argument("--work", default="/tmp/qerl-e2e", help="checkpoints and trainer outputs")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--jsonl", default=None,
                    help="append each row here as it finishes (default: <out-dir>/e2e_step-rows.jsonl)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per row before it is recorded as a timeout")
    ap.add_argument("--card-gib", type=float, default=None, help="on a larger GPU, give vLLM the memory it would "
                    f"get on a card of this many GiB (e.g. {H100_80GB_GIB}: does the row fit an 80 GB H100)")
    ap.add_argument("--cold-humming", action="store_true", help="each QeRL row starts on an empty Humming kernel "
                    "cache of its own (a first start on this machine)")
    ap.add_argument("--list", action="store_true", help="print the matrix and exit")
    ap.add_argument("--merge", nargs="*", help="JSONL files of rows to merge into <out-dir>/e2e_step-<gpu>.json")
    ap.add_argument("--gpu-tag", default=None, help="with --merge: the GPU tag of the rows (default: this machine's)")
    ap.add_argument("--command", default=None, help="with --merge: the command line that produced the rows")
    ap.add_argument("--commit", default=None, help="with --merge: the commit the rows were measured at "
                    "(default: the runs' commits)")
    ap.add_argument("--row-status", nargs="*", default=[], metavar="NAME=STATUS",
                    help="with --merge: the status of a matrix row that left no result (e.g. cut off by a time limit)")
    ap.add_argument("--missing-status", default="not_run: not measured",
                    help="with --merge: the status of the other matrix rows that have no result")
    # internal
    ap.add_argument("--prepare", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--with-bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        for text in a.arms or []:  # a misspelt arm fails before any checkpoint is written
            parse_arm(text)
    except ValueError as e:
        ap.error(str(e))

    if a.prepare:
        print(json.dumps(prepare_checkpoints(a.work, a.prepare, a.with_bf16)))
        return
    if a.child:
        _child(RowSpec(**json.loads(a.child)), a.work, a.steps, a.row_out, a.card_gib)
        return
    specs = select(default_matrix(a.arms or DEFAULT_ARMS), a.sizes, a.arms, a.only)
    if a.list:
        for s in specs:
            print(s.name)
        return
    if a.merge is not None:
        bad = [x for x in a.row_status if "=" not in x]
        if bad:
            ap.error(f"--row-status takes NAME=STATUS, got {bad}")
        merge(a.merge, a.out_dir, a.gpu_tag, a.command, a.commit,
              dict(x.split("=", 1) for x in a.row_status), a.missing_status)
        return
    if not specs:  # a misspelt --only once ran nothing and wrote an empty result after a device call
        known = sorted({s.short for s in default_matrix(a.arms or DEFAULT_ARMS) if not a.sizes or s.size in a.sizes})
        ap.error(f"no row of the matrix matches --sizes {a.sizes} --arms {a.arms} --only {a.only}; settings: "
                 f"{', '.join(known)} (--list prints the rows)")
    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    jsonl = a.jsonl or os.path.join(a.out_dir, "e2e_step-rows.jsonl")
    from benchmarks._common import new_run_id

    run = new_run_id()
    write_meta(jsonl, run)
    rows = run_matrix(specs, a.work, a.steps, jsonl, a.timeout, run, a.card_gib, a.cold_humming)
    add_speedups(rows)
    from benchmarks._common import write_result

    print("wrote", write_result("e2e_step", rows, a.out_dir))


def merge(files: list[str], out_dir: str, gpu_tag: str | None, command: str | None, commit: str | None,
          row_status: dict[str, str] | None = None, missing: str = "not_run: not measured") -> str:
    """Rows from several runs (device calls) -> one result file with every row of the default matrix.

    A later row replaces earlier rows of the same name from another commit; rows of one commit from several runs
    are all kept (a setting whose arms do not fit one call runs as calls that each hold TRL's arm, so each
    speed-up stays within its call). Each row keeps the ``commit`` and ``run`` it came from.
    ``row_status`` ({row name: status}) records what happened to a row that left no JSONL line (a run cut off by
    the device's time limit); other absent rows get their by-design ``not_run`` reason, or ``missing``. Rows are
    ordered as in the default matrix."""
    from benchmarks._common import keep_runs, result_envelope

    row_status = row_status or {}
    kept: list[dict] = []
    meta: dict[str, Any] = {}
    for path in files:
        file_commit = file_run = None
        new: list[dict] = []
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if "_meta" in r:
                        meta.update(r["_meta"])
                        file_commit, file_run = r["_meta"].get("commit"), r["_meta"].get("run")
                        continue
                    r.setdefault("commit", file_commit)
                    r.setdefault("run", file_run)
                    new.append(r)
        kept = keep_runs(kept, new, row_name, is_baseline=lambda r: r["arm"] == "trl_bf16")
    commits: list[str] = []
    for r in kept:
        if r["commit"] and r["commit"] not in commits:
            commits.append(r["commit"])
    latest = {row_name(r): r for r in kept}
    measured = sorted(set(row_status) & set(latest))
    if measured:
        raise ValueError(f"--row-status {measured}: measured rows; their status comes from their run")
    order = {s.name: i for i, s in enumerate(default_matrix())}
    unknown = sorted(set(row_status) - set(order))
    if unknown:
        raise ValueError(f"--row-status names rows outside the matrix: {unknown}; see --list")
    for spec in default_matrix():
        if spec.name not in latest:
            status = row_status.get(spec.name) or unrunnable(spec, card_gib=math.inf) or missing
            kept.append(dict(dataclasses.asdict(spec), prompt_len=PROMPT_TOKENS, lora_r=LORA_R, status=status))
    rows = sorted(kept, key=lambda r: (order.get(row_name(r), 10**6), r.get("run") or ""))
    add_speedups(rows)
    env = result_envelope("e2e_step", rows, command or meta.get("command") or "python " + " ".join(sys.argv))
    env["gpu"] = meta.get("gpu", env["gpu"])
    env["versions"] = meta.get("versions", env["versions"])
    env["commit"] = commit or (", ".join(commits) if commits else meta.get("commit", env["commit"]))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"e2e_step-{gpu_tag or meta.get('gpu_tag') or 'unknown'}.json")
    with open(path, "w") as f:
        json.dump(env, f, indent=1, default=str)
    print("wrote", path, len(rows), "rows")
    return path


if __name__ == "__main__":
    main()
