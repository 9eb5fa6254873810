"""Does QeRL learn as well as a BF16 LoRA? The paper's learning-dynamics claims, as a comparison anyone can rerun.

The QeRL paper (arXiv 2510.11696, §4, Table 1, Fig. 12) claims that FP4 quantization noise raises policy entropy
early in RL, that AQN turns this into faster reward growth, and that the final accuracy is at least a BF16 LoRA's.
:func:`run_comparison` trains the same GRPO recipe on three arms that differ only in the base and the noise:

* ``bf16_lora``: TRL's ``GRPOTrainer`` on the 16-bit base with a PEFT LoRA (TRL merges it into vLLM each step);
* ``nvfp4_lora``: ``QeRLGRPOTrainer`` on the NVFP4 base, AQN off;
* ``nvfp4_lora_aqn``: ``QeRLGRPOTrainer`` on the NVFP4 base, AQN on the paper's schedule.

Within a seed every arm gets the same training problems in the same order (TRL's sampler is seeded by
``args.seed``), the same prompts, learning rate and LoRA shape. Per step a run records TRL's logged metrics (mean
reward, policy entropy, completion length, vLLM's log-prob gap to the trainer), the AQN σ and the training wall
time; every ``eval_every`` steps it
scores held-out problems greedily on the noise-free HF policy (:func:`qerl_trl.study.scoring.greedy_accuracy`).

Each run is a child process with its own vLLM engine, so several share one GPU (``parallel``). vLLM sizes its KV
cache from the device-wide free memory it sees while it profiles, so the engines of a wave start one at a time
(a file lock) and training starts once every engine of the wave is up (a barrier). A run's records are appended
to ``runs/<run>.jsonl`` as they happen; rerunning the command skips finished runs and restarts the others.
``qerl_trl.study.report`` turns the runs into a verdict per claim, paired by seed, and draws them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .spec import STEP_KEYS, LearningConfig, RunRecords, RunSpec, read_records

__all__ = ["child_env", "free_port", "own_rendezvous", "run_comparison", "run_one", "run_specs"]

# ---------------------------------------------------------------------------------------------------- data


def build_datasets(cfg: LearningConfig, seed: int):
    """``(train, held_out)`` with ``prompt`` and ``answer`` columns; held-out is the same for every seed."""
    if cfg.dataset_name is None:
        from .tasks import TASKS

        task = TASKS[cfg.task]
        held = task.problems(cfg.eval_size, seed=10_000)
        n_train = min(cfg.train_size or cfg.max_steps * cfg.prompts_per_step, task.count_free(held))
        return task.dataset(n_train, seed=seed, exclude=held), task.to_dataset(held)
    from datasets import load_dataset

    def load(split: str, n: int | None):
        ds = load_dataset(cfg.dataset_name, cfg.dataset_config, split=split)
        missing = [c for c in (cfg.prompt_column, cfg.answer_column) if c not in ds.column_names]
        if missing:
            raise ValueError(f"{cfg.dataset_name} split {split!r} has no column(s) {missing}; columns: {ds.column_names}")
        if n is not None:
            ds = ds.select(range(min(n, len(ds))))

        def fmt(row):
            p = row[cfg.prompt_column]
            return {"prompt": [{"role": "user", "content": p}] if cfg.chat_prompts else p, "answer": row[cfg.answer_column]}

        return ds.map(fmt, remove_columns=ds.column_names)

    return load(cfg.train_split, cfg.train_size), load(cfg.eval_split, cfg.eval_size)


def reward_function(cfg: LearningConfig):
    from .. import rewards

    return getattr(rewards, cfg.reward)


# --------------------------------------------------------------------------------------------------- trainer


def build_trainer(cfg: LearningConfig, run: RunSpec, output_dir: str, train_dataset):
    """The arm's trainer: TRL's ``GRPOTrainer`` (BF16 LoRA) or ``QeRLGRPOTrainer`` (NVFP4 LoRA, AQN on or off)."""
    import torch

    on_gpu = torch.cuda.is_available()
    common: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=cfg.max_steps,
        learning_rate=run.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        seed=run.seed,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_vllm=cfg.use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
    )
    reward = reward_function(cfg)
    if run.arm == "bf16_lora":
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, model_init_kwargs={"dtype": torch.bfloat16 if on_gpu else torch.float32})
        peft = LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear", bias="none",
            task_type="CAUSAL_LM",
        )  # fmt: skip
        return GRPOTrainer(
            model=run.bf16_model, reward_funcs=reward, args=args, train_dataset=train_dataset, peft_config=peft
        )
    from ..trainer import QeRLGRPOConfig, QeRLGRPOTrainer

    args = QeRLGRPOConfig(
        **common,
        lora_r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        aqn=run.arm == "nvfp4_lora_aqn",
        aqn_sigma_start=cfg.aqn_sigma_start,
        aqn_sigma_end=cfg.aqn_sigma_end,
        aqn_num_stages=cfg.aqn_num_stages,
    )
    return QeRLGRPOTrainer(model=run.nvfp4_model, reward_funcs=reward, args=args, train_dataset=train_dataset)


def record_prompts(trainer) -> list[str]:
    """Wrap ``trainer._generate_and_score_completions`` (TRL 1.16; called once per generation round with the
    round's inputs) to keep a hash of each round's prompts: the check that every arm of a seed saw the same data
    in the same order. Returns the list the hashes are appended to."""
    import hashlib

    seen: list[str] = []
    original = trainer._generate_and_score_completions

    def recorded(inputs, *args, **kwargs):
        text = json.dumps([x.get("prompt") for x in inputs], default=str)
        seen.append(hashlib.sha256(text.encode()).hexdigest()[:16])
        return original(inputs, *args, **kwargs)

    trainer._generate_and_score_completions = recorded
    return seen


def _curve_callback(records: RunRecords, score, eval_every: int, prompt_hashes: list[str]):
    """A ``TrainerCallback`` that writes each step's metrics and scores the held-out set at fixed intervals."""
    from transformers import TrainerCallback

    class LearningCurveCallback(TrainerCallback):
        def __init__(self):
            self.t_begin = 0.0
            self.eval_s = 0.0

        def _eval(self, step: int, model) -> None:
            t = time.perf_counter()
            acc = score(model)
            self.eval_s += time.perf_counter() - t
            records.write(event="eval", step=step, accuracy=acc, eval_s=round(time.perf_counter() - t, 2))

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._eval(0, model)
            self.t_begin = time.perf_counter()
            self.eval_s = 0.0

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % eval_every == 0 or state.global_step == state.max_steps:
                self._eval(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            row = {name: float(logs[key]) for key, name in STEP_KEYS.items() if logs.get(key) is not None}
            row.setdefault("aqn_sigma", 0.0)
            wall = time.perf_counter() - self.t_begin - self.eval_s
            if prompt_hashes:
                row["prompts_sha"] = prompt_hashes[-1]
            records.write(event="step", step=state.global_step, wall_s=round(wall, 3), **row)

    return LearningCurveCallback()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _barrier(directory: Path, name: str, size: int, timeout: float) -> None:
    """Mark ``name`` arrived, then wait until ``size`` runs have (or ``timeout`` passes)."""
    (directory / name).touch()
    deadline = time.time() + timeout
    while sum(1 for _ in directory.iterdir()) < size and time.time() < deadline:
        time.sleep(0.5)


def run_one(cfg: LearningConfig, run: RunSpec, work: Path, wave: Path, wave_size: int) -> None:
    """Train one run (in this process) and append its records to ``work/runs/<run>.jsonl``."""
    records = RunRecords(work / "runs" / f"{run.name}.jsonl")
    records.write(event="start", run=asdict(run), pid=os.getpid())
    t0 = time.perf_counter()
    trainer = None
    try:
        _import_heavy_modules(cfg.use_vllm)  # concurrently with the other runs: only the engine start is serialized
        train, held_out = build_datasets(cfg, run.seed)
        with _file_lock(wave / "init.lock"):
            trainer = build_trainer(cfg, run, str(work / "trainers" / run.name), train)
    except BaseException as e:
        records.write(event="end", status=_status(e), stage="init", error=f"{type(e).__name__}: {e}"[:2000],
                      traceback=traceback.format_exc()[-4000:])  # fmt: skip
        (wave / "ready" / run.name).touch()  # arrive, so the others do not wait for this run
        raise
    _barrier(wave / "ready", run.name, wave_size, cfg.run_timeout)
    init_s = time.perf_counter() - t0
    reward = reward_function(cfg)
    tokenizer = trainer.processing_class

    def score(model) -> float:
        from .scoring import greedy_accuracy

        if getattr(trainer, "aqn", None) is not None:
            trainer.aqn.restore()  # the held-out score is the noise-free policy's
        return greedy_accuracy(model, tokenizer, held_out, reward, cfg.max_completion_length)

    trainer.add_callback(_curve_callback(records, score, cfg.eval_every, record_prompts(trainer)))
    t1 = time.perf_counter()
    try:
        trainer.train()
    except BaseException as e:
        records.write(event="end", status=_status(e), stage="train", error=f"{type(e).__name__}: {e}"[:2000],
                      traceback=traceback.format_exc()[-4000:], init_s=round(init_s, 1))  # fmt: skip
        raise
    records.write(event="end", status="ok", init_s=round(init_s, 1), train_s=round(time.perf_counter() - t1, 1))


def _import_heavy_modules(use_vllm: bool) -> None:
    import peft  # noqa: F401
    import trl  # noqa: F401

    from .. import trainer  # noqa: F401

    if use_vllm:
        import vllm  # noqa: F401


def _status(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return "oom" if "OutOfMemory" in text or "out of memory" in text else "failed"


# ----------------------------------------------------------------------------------------------------- driver


def resolve_models(cfg: LearningConfig, work: Path) -> tuple[str, str]:
    """``(bf16 checkpoint, NVFP4A16 checkpoint)``, quantizing ``cfg.model`` once (never per run) if needed."""
    if cfg.model is None:
        from ..smollm2 import prepare_smollm2

        bf16, nvfp4 = prepare_smollm2()
        return str(bf16), str(cfg.nvfp4_model or nvfp4)
    if cfg.nvfp4_model is not None:
        return cfg.model, cfg.nvfp4_model
    target = work / "nvfp4-base"
    if not (target / "config.json").is_file():
        import shutil

        from ..quantizer import quantize_checkpoint

        tmp = work / "nvfp4-base.part"
        if tmp.exists():
            shutil.rmtree(tmp)
        quantize_checkpoint(cfg.model, tmp)
        tmp.rename(target)
    return cfg.model, str(target)


def run_specs(cfg: LearningConfig, bf16: str, nvfp4: str) -> list[RunSpec]:
    return [
        RunSpec(arm, seed, lr, bf16, nvfp4) for lr in cfg.learning_rates for seed in cfg.seeds for arm in cfg.arms
    ]


def _finished(path: Path) -> bool:
    return any(r.get("event") == "end" and r.get("status") == "ok" for r in read_records(path))


# A process that already ran a colocated trainer keeps its torch.distributed rendezvous (TRL 1.16's
# ensure_master_addr_port prefers port 29500 and exports it): a child inheriting MASTER_PORT would try to listen on
# the parent's port (EADDRINUSE). Each run is its own single-process job, so it picks a free port itself.
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


#: the ports TRL 1.16's ``ensure_master_addr_port`` tries first (``trl/trainer/utils.py::_find_free_port``): a
#: trainer started without ``MASTER_PORT`` takes one of them, so a child's own port is never one of these
TRL_PORTS = frozenset({29500, 23456, 12355, 12345})
#: the lowest port :func:`free_port` hands out (below it: well-known and registered services' ports)
LOWEST_PORT = 20000
#: Linux's default ephemeral range, where ``/proc/sys/net/ipv4/ip_local_port_range`` cannot be read
DEFAULT_EPHEMERAL = (32768, 60999)
_handed_out: set[int] = set()


def ephemeral_ports() -> tuple[int, int]:
    """The OS's ephemeral port range: where a bind to port 0 and an outgoing connection take their ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 now (bound and released at once)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port that is free now, below the OS's ephemeral range, not one of :data:`TRL_PORTS`, and not handed out
    before by this process.

    Why below the ephemeral range: a child binds its port only once it has started, tens of seconds later (a study
    wave's runs wait on a lock while each other's engines start). Meanwhile any bind to port 0 on the host (vLLM's
    engine and NCCL take their sockets that way) may take a port of that range: a learning run's port, 37053, was
    taken so (EADDRINUSE, GPU suite at 177e135). Random, so that parents of their own (two GPU-suite lanes) seldom
    pick the same one. Where the range leaves no room below it, the OS picks (a bind to port 0)."""
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_ports()
    if low - LOWEST_PORT >= 1000:
        for _ in range(200):
            port = rng.randrange(LOWEST_PORT, low)
            if port not in TRL_PORTS and port not in _handed_out and port_is_free(port):
                _handed_out.add(port)
                return port
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def own_rendezvous(parent: Mapping[str, str]) -> dict[str, str]:
    """``parent`` without its distributed rendezvous, with a port of the child's own. TRL 1.16 picks the first free
    port of a short list (29500, 23456, 12355, ...) and binds it later: trainers started side by side on one host
    (e2e runs, test lanes, a wave of runs) picked the same one and failed with EADDRINUSE: each child gets one of
    :func:`free_port`'s instead."""
    env = {k: v for k, v in parent.items() if k not in _RENDEZVOUS_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def child_env(parent: Mapping[str, str], threads: int) -> dict[str, str]:
    """The environment of one run's child process: the parent's, with a distributed rendezvous of its own
    (:func:`own_rendezvous`) and a share of the CPU threads."""
    env = own_rendezvous(parent)
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


def _run_wave(cfg: LearningConfig, work: Path, wave_runs: list[RunSpec], index: int) -> None:
    """Start every run of the wave as a child process; wait for all (killing those past ``run_timeout``)."""
    wave = work / "waves" / f"{index}-{os.getpid()}-{int(time.time())}"
    (wave / "ready").mkdir(parents=True)
    config_path = wave / "config.json"
    config_path.write_text(json.dumps(asdict(cfg)))
    threads = max(1, (os.cpu_count() or 2) // len(wave_runs))
    procs = []
    for run in wave_runs:
        env = child_env(os.environ, threads)  # a rendezvous port per run: the wave's runs start side by side
        path = work / "runs" / f"{run.name}.jsonl"
        if path.exists():  # an unfinished earlier attempt: start over
            path.rename(path.with_suffix(f".{int(time.time())}.partial"))
        log = open(work / "runs" / f"{run.name}.log", "w")
        cmd = [sys.executable, "-m", "qerl_trl.study.runner", str(config_path), json.dumps(asdict(run)), str(work),
               str(wave), str(len(wave_runs))]  # fmt: skip
        procs.append((run, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.time() + cfg.run_timeout
    for run, proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            RunRecords(work / "runs" / f"{run.name}.jsonl").write(
                event="end", status="timeout", error=f"killed after run_timeout={cfg.run_timeout:g} s"
            )
        log.close()
        records = read_records(work / "runs" / f"{run.name}.jsonl")
        if not any(r.get("event") == "end" for r in records):
            RunRecords(work / "runs" / f"{run.name}.jsonl").write(
                event="end", status="failed", error=f"process exited with {proc.returncode}; see runs/{run.name}.log"
            )


def run_comparison(cfg: LearningConfig) -> dict:
    """Run every (learning rate, seed, arm) not finished yet, then write ``comparison.json`` and the plot."""
    work = Path(cfg.output_dir).resolve()
    (work / "runs").mkdir(parents=True, exist_ok=True)
    bf16, nvfp4 = resolve_models(cfg, work)
    specs = run_specs(cfg, bf16, nvfp4)
    todo = [s for s in specs if not _finished(work / "runs" / f"{s.name}.jsonl")]
    print(f"{len(specs)} runs, {len(specs) - len(todo)} already finished; {cfg.parallel} at a time", flush=True)
    for i in range(0, len(todo), cfg.parallel):
        wave_runs = todo[i : i + cfg.parallel]
        print(f"wave {i // cfg.parallel + 1}: {', '.join(r.name for r in wave_runs)}", flush=True)
        _run_wave(cfg, work, wave_runs, i // cfg.parallel)
    from .report import format_summary, load_runs, plot_curves, summarize

    runs = load_runs(work, specs)
    summary = summarize(runs, cfg)
    plot = plot_curves(runs, work / "learning_curves.png", cfg)
    result = {"config": asdict(cfg), "models": {"bf16": bf16, "nvfp4": nvfp4}, "runs": runs, "summary": summary,
              "plot": str(plot)}  # fmt: skip
    (work / "comparison.json").write_text(json.dumps(result, indent=1, default=str))
    print(format_summary(summary), flush=True)
    return result


def _child_main(argv: list[str]) -> int:
    config_path, run_json, work, wave, wave_size = argv
    cfg = LearningConfig.from_dict(json.loads(Path(config_path).read_text()))
    run = RunSpec(**json.loads(run_json))
    run_one(cfg, run, Path(work), Path(wave), int(wave_size))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
