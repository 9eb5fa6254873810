"""QeRL GRPO steps on one GPU, data-parallel on two (DDP x2), with tensor-parallel rollouts (TP=2), and in server
mode (a ``qerl-trl vllm-serve`` server on the second GPU, the trainer on the first) (issues #14, #39).

    python benchmarks/multi_gpu.py --work /tmp/qerl-mg --out-dir benchmarks/results  # -> multi_gpu-<gpu>x<n>.json
    python benchmarks/multi_gpu.py --modes 1gpu ddp2 --size 7b

Each mode is one ``accelerate launch`` job with the examples' accelerate config (as users launch the GRPO example)
whose ranks each build ``benchmarks/e2e_step.py``'s QeRL arm (random Qwen2.5 weights in NVFP4A16, AQN on, LoRA r32
on every linear; vLLM colocate with one engine per rank or one TP=2 engine per pair, or the server) and train
``--steps`` steps. Every rank records its step, rollout and sync times, the completion tokens it trained on, its
GPU's peak memory (NVML) and what must agree across ranks (:func:`attach_rank_recorder`): a hash of each round's
AQN-noised norms, a hash of the LoRA after each optimizer step, and vLLM's log-prob gap to the trainer on each
round; in server mode also what the server read each round and its FP4 base checksum before and after
(:func:`attach_server_recorder`). The row of a mode: ``{mode, gpus, processes, tp, step_s (min-max), rollout_s, sync_s,
tokens_per_s, tokens_per_s_vs_1gpu, peak_gib_per_gpu, checks, status}``, medians over the steps after the first, the
slowest rank's (tokens: all ranks'). A mode that fails (an OOM, a vLLM limit) is a row with its status; one cut off at
``--timeout`` also says how far each rank got (``progress``: trainer built, steps taken), and every mode's launcher
output stays in ``WORK/mode-<mode>.log``. The result file is rewritten after every mode, so a cut-off run keeps its
rows. ``--stack-every S`` samples each rank's Python stack while it builds its trainer (``WORK/mode-<mode>/
stacks<R>.txt``): it showed that 155 s of a 14B rank's 305 s start went to AQN's target trace on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: mode -> (trainer processes, vllm_tensor_parallel_size); "server": one trainer process and a server on another GPU
MODES = {"1gpu": (1, 1), "ddp2": (2, 1), "tp2": (2, 2), "server": (1, 1)}
#: GPUs a mode needs
MODE_GPUS = {"1gpu": 1, "ddp2": 2, "tp2": 2, "server": 2}
#: vLLM's log-prob gap to the trainer on noise-free rounds, nats/token: the colocate check's tolerance, set on
#: SmolLM2 (measured 0.03-0.04 there). Random 7B weights sampled at temperature 1 measure 0.059 on one GPU
#: (multi_gpu-h100x2.json), so a mode is judged against the one-GPU row of the same call when there is one:
GAP_TOLERANCE = 0.05
#: a mode's gap may exceed the same call's one-GPU gap by this factor plus GAP_SLACK (run-to-run spread)
GAP_VS_1GPU, GAP_SLACK = 1.10, 0.005


def _sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def attach_rank_recorder(trainer, write) -> None:
    """Record, through ``write(**row)``, what must agree across data-parallel ranks.

    * ``{"event": "aqn", "step", "sigma", "sha"}`` per generation round: the round's noised norm weights (what the
      rank's vLLM engine gets; wraps ``trainer.aqn.begin_rollout``);
    * ``{"event": "lora", "step", "sha"}`` after each optimizer step: the rank's LoRA parameters;
    * ``{"event": "gap", "step", "gap", "nan_fraction"}`` at each verdict of the rollout-policy guard: its measure
      of a round (vLLM's log-probs against the trainer's), ``step`` the training step the round was generated for.
      Recorded as the guard judges, not at step ends: with the fused pass a round is judged when the next starts,
      and the last one when training ends.
    """
    from transformers import TrainerCallback

    if trainer.aqn is not None:
        begin = trainer.aqn.begin_rollout

        def recorded_begin(model, state, hf_generation=False):
            weights = begin(model, state, hf_generation)
            sigma = trainer.aqn.metrics(state)["aqn/sigma"]
            write(event="aqn", step=int(state.global_step), sigma=sigma, sha=_sha(weights[k] for k in sorted(weights)))
            return weights

        trainer.aqn.begin_rollout = recorded_begin

    guard = getattr(trainer, "_rollout_guard", None)
    if guard is not None:
        update = guard.update

        def recorded_update(step, gap, nan_fraction, bad=None):
            write(event="gap", step=int(step) + 1, gap=gap, nan_fraction=nan_fraction)  # before: update may raise
            return update(step, gap, nan_fraction, bad)

        guard.update = recorded_update

    class RankRecorder(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            lora = [p for n, p in sorted(model.named_parameters()) if "lora_" in n]
            write(event="lora", step=int(state.global_step), sha=_sha(lora))

    trainer.add_callback(RankRecorder())


def attach_server_recorder(trainer, write) -> None:
    """Server mode, main process: ``{"event": "base", "when": "before", "checksums"}`` now (each server worker's
    checksum of its FP4 base) and ``{"event": "sync", "step", "read_ok", "adapter_root_ok"}`` after each round's
    sync (the server read this round's file / serves the adapter directory the trainer wrote last)."""
    sync = trainer.vllm_generation.server_sync
    write(event="base", when="before", checksums=sync.base_checksums())
    original = sync.sync

    def recorded_sync(model, norms):
        last = original(model, norms)
        write(event="sync", step=int(trainer.state.global_step), read_ok=last.get("read_ok"),
              adapter_root_ok=last.get("adapter_root_ok"))  # fmt: skip
        return last

    sync.sync = recorded_sync


# ------------------------------------------------------------------------------------------ one rank (worker)
class StackSampler(threading.Thread):
    """Appends the main thread's innermost Python frames to ``path`` every ``every`` seconds, each sample headed by
    the seconds since start. ``sys._current_frames`` under the GIL, not :mod:`faulthandler`'s watchdog, which
    crashed (SIGSEGV) sampling a trainer's start. A sample is late while the main thread holds the GIL in C."""

    def __init__(self, path: str, every: float, depth: int = 30) -> None:
        super().__init__(daemon=True)
        self.path, self.every, self.depth = path, every, depth
        self._stop_event = threading.Event()
        self.sampled = threading.Event()  #: set once a sample is on disk (what a test waits on, instead of a sleep)

    def run(self) -> None:
        main = threading.main_thread().ident
        t0 = time.perf_counter()
        with open(self.path, "w") as f:
            while not self._stop_event.wait(self.every):
                frame = sys._current_frames().get(main)
                if frame is None:
                    break
                lines = [f"  {fs.filename}:{fs.lineno} {fs.name}" for fs in traceback.extract_stack(frame)]
                f.write(f"--- {time.perf_counter() - t0:.1f} s\n" + "\n".join(lines[-self.depth:]) + "\n")
                f.flush()
                self.sampled.set()

    def finish(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def run_rank(spec, work: str, steps: int, tp: int, out_dir: str, overrides: dict | None = None,
             stack_every: float = 0.0) -> None:
    """Train on this rank and write ``out_dir/rank<R>.json``: timings, peak memory, the recorder's events.

    ``stack_every`` > 0: while the trainer is built, the main thread's Python stack goes to ``out_dir/stacks<R>.txt``
    every that many seconds (:class:`StackSampler`), a sampling profile of a start that takes minutes."""
    import torch
    from transformers import TrainerCallback

    from benchmarks import e2e_step as e2e

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    events: list[dict] = []
    result: dict[str, Any] = {"rank": rank, "events": events}
    mem = e2e._PeakMemory(device_index=local)
    t0 = time.perf_counter()

    def progress(**row) -> None:  # as it happens: a mode cut off at its time limit still says how far it got
        with open(os.path.join(out_dir, f"{PROGRESS_PREFIX}{rank}.jsonl"), "a") as f:
            f.write(json.dumps({**row, "at_s": round(time.perf_counter() - t0, 1)}) + "\n")

    sampler = StackSampler(os.path.join(out_dir, f"stacks{rank}.txt"), stack_every) if stack_every > 0 else None
    try:
        if sampler is not None:
            sampler.start()
        trainer = e2e.build_trainer(spec, work, steps, tp=tp, overrides=overrides)
        result["init_s"] = round(time.perf_counter() - t0, 1)
        if sampler is not None:
            sampler.finish()
        engine_s = getattr(getattr(trainer, "vllm_generation", None), "engine_start_seconds", 0.0)
        result["engine_start_s"] = round(engine_s, 1) if engine_s else None  # of init_s (None: no colocated engine)
        progress(event="init", engine_start_s=result["engine_start_s"])
        attach_rank_recorder(trainer, lambda **row: events.append(row))
        if (overrides or {}).get("vllm_mode") == "server" and trainer.accelerator.is_main_process:
            attach_server_recorder(trainer, lambda **row: events.append(row))
        tokens = [0]
        generate = trainer._generate

        def counted_generate(prompts):
            out = generate(prompts)
            tokens[0] += sum(len(c) for c in out[1])  # the completions this rank trains on
            return out

        trainer._generate = counted_generate
        gen = getattr(trainer, "vllm_generation", None) if spec.generation == "vllm" else None
        sync_t = e2e._Timed(gen, "sync_weights") if gen is not None else None
        roll_t = e2e._Timed(gen, "generate") if gen is not None else e2e._Timed(trainer, "_generate_single_turn")
        per_step: list[dict] = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                e2e._sync()
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                e2e._sync()
                per_step.append(dict(step_s=time.perf_counter() - self.t, rollout_s=roll_t.take(),
                                     sync_s=sync_t.take() if sync_t else 0.0, tokens=tokens[0]))  # fmt: skip
                tokens[0] = 0
                progress(event="step", step=len(per_step), step_s=round(per_step[-1]["step_s"], 2))

        trainer.add_callback(StepTimer())
        mem.start()
        trainer.train()
        result["peak_gib"] = round(mem.stop(), 2)
        result["per_step"] = per_step
        if (overrides or {}).get("vllm_mode") == "server" and trainer.accelerator.is_main_process:
            events.append({"event": "base", "when": "after",
                           "checksums": trainer.vllm_generation.server_sync.base_checksums()})  # fmt: skip
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failure is a row
        if sampler is not None:
            sampler.finish()
        mem.stop()
        result["status"] = e2e._classify(e)
        result["traceback"] = traceback.format_exc()[-3000:]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)


# ------------------------------------------------------------------------------------------ a mode (driver)
#: each rank's progress file in a mode's directory (``<prefix><rank>.jsonl``), next to its result ``rank<R>.json``
PROGRESS_PREFIX = "progress"
#: lines of a launcher's output that say nothing about where a mode stood: NCCL's and the TCP store's complaints,
#: with their C++ stack frames, as the ranks are killed at the time limit (they filled a 7B tp2 row's whole tail)
TEARDOWN_NOISE = ("frame #", "Exception raised from", "ProcessGroupNCCL.cpp", "TCPStore.cpp", "destroy_process_group")


def progress_of(out_dir: str) -> dict[str, dict]:
    """How far each rank got (``{"rank0": {"init_s", "engine_start_s", "steps_done", "last_at_s"}}``): for a row
    cut off at its limit. ``init_s`` None: the trainer (model load, then the vLLM engine's start, ``engine_start_s``
    of it) was still being built."""
    out: dict[str, dict] = {}
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith(PROGRESS_PREFIX) and name.endswith(".jsonl")):
            continue
        with open(os.path.join(out_dir, name)) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        init = next((r for r in rows if r["event"] == "init"), {})
        out["rank" + name[len(PROGRESS_PREFIX):-len(".jsonl")]] = {
            "init_s": init.get("at_s"), "engine_start_s": init.get("engine_start_s"),
            "steps_done": sum(r["event"] == "step" for r in rows), "last_at_s": rows[-1]["at_s"] if rows else None}
    return out


def useful_tail(log: str, chars: int = 2500) -> str:
    """The end of a launcher's output without the teardown noise of killed ranks."""
    lines = [line for line in log.splitlines() if not any(n in line for n in TEARDOWN_NOISE)]
    return "\n".join(lines)[-chars:]


def summarize_mode(mode: str, ranks: list[dict], steps: int) -> dict:
    """One row from the ranks' results: the slowest rank's medians, every GPU's peak, the cross-rank checks."""
    processes, tp = MODES[mode]
    row: dict[str, Any] = {"mode": mode, "gpus": processes, "processes": processes, "tp": tp, "steps": steps}
    bad = [r for r in ranks if r.get("status") != "ok"]
    if len(ranks) < processes or bad:
        row["status"] = bad[0]["status"] if bad else f"failed: {len(ranks)} of {processes} ranks reported"
        row["traceback"] = (bad[0].get("traceback") if bad else None)
        return row
    steady = [r["per_step"][1:] or r["per_step"] for r in ranks]
    for key in ("step_s", "rollout_s", "sync_s"):
        row[key] = round(max(statistics.median(s[key] for s in st) for st in steady), 3)
    slowest = max(steady, key=lambda st: statistics.median(s["step_s"] for s in st))  # the rank step_s is from
    row["step_s_min"] = round(min(s["step_s"] for s in slowest), 3)
    row["step_s_max"] = round(max(s["step_s"] for s in slowest), 3)
    row["tokens_per_s"] = round(sum(statistics.median(s.get("tokens", 0) for s in st) for st in steady)
                                / row["step_s"], 1)  # fmt: skip
    row["init_s"] = max(r["init_s"] for r in ranks)
    starts = [r.get("engine_start_s") for r in ranks if r.get("engine_start_s") is not None]
    row["engine_start_s"] = max(starts) if starts else None
    row["peak_gib_per_gpu"] = [r["peak_gib"] for r in sorted(ranks, key=lambda r: r["rank"])]

    def events(r, kind):
        return [{k: v for k, v in e.items() if k != "event"} for e in r["events"] if e["event"] == kind]

    aqn = [events(r, "aqn") for r in ranks]
    lora = [events(r, "lora") for r in ranks]
    gaps = [events(r, "gap") for r in ranks]
    clean = [[g["gap"] for g, a in zip(gp, ev, strict=False) if a["sigma"] == 0]
             for gp, ev in zip(gaps, aqn, strict=True)]  # fmt: skip
    checks = {
        "aqn_same_on_every_rank": all(a == aqn[0] for a in aqn) and len(aqn[0]) == steps,
        "lora_same_on_every_rank": all(x == lora[0] for x in lora) and len(lora[0]) == steps,
        "lora_trained": len({x["sha"] for x in lora[0]}) == steps,
        "noise_free_logprob_gap_per_rank": [round(max(c), 4) if c else None for c in clean],
    }
    # judged against GAP_TOLERANCE here, against the same call's one-GPU row by judge_rows()
    checks["noise_free_logprob_gap_ok"] = all(c and max(c) <= GAP_TOLERANCE for c in clean) if any(gaps) else None
    if mode == "server":
        main = next(r for r in ranks if r["rank"] == 0)
        syncs = events(main, "sync")
        read = [s["read_ok"] if s["read_ok"] is not None else s["adapter_root_ok"] for s in syncs]
        checks["server_served_latest_lora_every_round"] = len(read) == steps and all(read)
        base = {b["when"]: b["checksums"] for b in events(main, "base")}
        checks["server_fp4_base_untouched"] = bool(base.get("before")) and base.get("before") == base.get("after")
    row["checks"] = checks
    _set_status(row)
    return row


def _set_status(row: dict) -> None:
    checks = row["checks"]
    passed = [v for v in checks.values() if isinstance(v, bool)]
    row["status"] = "ok" if all(passed) else "check_failed: " + ", ".join(k for k, v in checks.items() if v is False)


def start_server(spec, work: str, gpu: int, fp4_kernel: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """``qerl-trl vllm-serve`` on GPU ``gpu`` for this spec's QeRL arm; returns the process and its URL."""
    from benchmarks import e2e_step as e2e
    from benchmarks._child import free_port, visible_gpu
    from qerl_trl.trainer.vllm_serving.server_command import vllm_serve_command

    port = free_port()
    argv, env, _ = vllm_serve_command(
        e2e.checkpoint_paths(work, spec.size)["nvfp4"], lora_backend=e2e.QERL_ARMS[spec.arm], lora_r=e2e.LORA_R,
        fp4_kernel=fp4_kernel, host="127.0.0.1", port=port, gpu_memory_utilization=0.85,
        max_model_len=e2e.PROMPT_TOKENS + spec.completion_len + 16,
        extra=["--max-num-seqs", str(spec.prompts * spec.generations), "--max-num-batched-tokens", "4096"],
    )  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until stop_server
    proc = subprocess.Popen(argv, env={**os.environ, **env, "CUDA_VISIBLE_DEVICES": visible_gpu(gpu)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes too), SIGKILL after 30 s."""
    from benchmarks._child import signal_group

    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def run_mode(mode: str, spec, work: str, steps: int, timeout: float, fp4_kernel: str = "auto",
             stack_every: float = 0.0) -> dict:
    from benchmarks._child import accelerate_launch, run_child, visible_gpu

    processes, tp = MODES[mode]
    out_dir = os.path.join(work, f"mode-{mode}")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, name))
    overrides: dict[str, Any] = {"vllm_fp4_kernel": fp4_kernel}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    server = None
    if mode == "server":  # the server on GPU 1 starts while the trainer loads on GPU 0 (its client waits for it)
        server, url = start_server(spec, work, 1, fp4_kernel, os.path.join(work, "server.log"))
        overrides.update(vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=timeout)
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu(0)
    worker = ["--worker", json.dumps(dataclasses.asdict(spec)), "--work", work, "--steps", str(steps), "--tp", str(tp),
              "--rank-dir", out_dir, "--overrides", json.dumps(overrides), "--stack-every", str(stack_every)]
    cmd = accelerate_launch(__file__, worker, processes)
    try:  # the launcher's whole output stays in WORK/mode-<mode>.log
        res = run_child(cmd, timeout, env=env, log_path=os.path.join(work, f"mode-{mode}.log"))
    finally:
        if server is not None:
            stop_server(server)
    timed_out, log = res.timed_out, useful_tail(res.log, 4000)
    if server is not None:
        with open(os.path.join(work, "server.log"), errors="replace") as f:
            log = log + "\n--- server ---\n" + f.read()[-4000:]
    ranks = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                ranks.append(json.load(f))
    row = summarize_mode(mode, ranks, steps)
    if timed_out and row["status"] != "ok":
        row["status"] = f"timeout after {timeout:.0f} s"
    if row["status"] != "ok":
        row["progress"] = progress_of(out_dir)
        row["log_tail"] = log[-2500:]
    row.update(size=spec.size, prompts=spec.prompts, generations=spec.generations,
               completion_len=spec.completion_len, mode_wall_s=res.wall_s)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--size", default="7b")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rank and step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=512)
    ap.add_argument("--generation", default="vllm", choices=["vllm", "hf"], help="hf: the CPU smoke test")
    ap.add_argument("--arm", default="qerl_single_lora", choices=["qerl", "qerl_single_lora"],
                    help="QeRL with its in-layer LoRA (vllm_lora_backend='qerl', the default), or with vLLM's LoRA "
                    "adapters ('qerl'; names as in e2e_step.py)")
    ap.add_argument("--fp4-kernel", default="auto", choices=["auto", "humming", "marlin"],
                    help="vllm_fp4_kernel of every mode (marlin: no Humming compile on a fresh machine)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--work", default="/tmp/qerl-mg")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds per mode, start included: on a fresh machine (no vLLM compile cache) a 14B 1gpu "
                    "mode got no further than its first step in 300 s, and a 7B tp2 mode did not finish in 200 s, on "
                    "H200s (multi_gpu-h200x2.json)")
    ap.add_argument("--stack-every", type=float, default=0.0, metavar="S",
                    help="while each rank builds its trainer, dump its Python stacks every S seconds to "
                    "WORK/mode-<mode>/stacks<R>.txt (where a start of minutes goes)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    from benchmarks import e2e_step as e2e

    if a.worker:
        run_rank(e2e.RowSpec(**json.loads(a.worker)), a.work, a.steps, a.tp, a.rank_dir, json.loads(a.overrides),
                 a.stack_every)
        return []
    import torch

    from benchmarks._common import git_commit, gpu_name, gpu_tag, result_envelope

    spec = e2e.RowSpec(a.size, a.arm, a.prompts, a.generations, a.completion_len, sleep=False, generation=a.generation)
    prep = e2e.prepare_checkpoints(a.work, a.size, need_bf16=False)
    print(f"checkpoint ready: {prep}", flush=True)
    rows = []
    gpus = torch.cuda.device_count()
    tag = gpu_tag()
    os.makedirs(a.out_dir, exist_ok=True)
    name = f"multi_gpu-{tag}x{gpus}" if tag != "cpu" else "multi_gpu-cpu"
    path = os.path.join(a.out_dir, name + ("" if a.arm == "qerl_single_lora" else f"-{a.arm}") + ".json")
    command = "python benchmarks/multi_gpu.py " + " ".join(argv or sys.argv[1:])
    for mode in a.modes:
        if MODE_GPUS[mode] > max(gpus, 1) and a.generation == "vllm":
            rows.append({"mode": mode, "gpus": MODE_GPUS[mode], "status": f"not_run: needs {MODE_GPUS[mode]} GPUs, "
                         f"this machine has {gpus}"})  # fmt: skip
        else:
            rows.append(run_mode(mode, spec, a.work, a.steps, a.timeout, a.fp4_kernel, a.stack_every))
        rows[-1].update(gpus=MODE_GPUS[mode], commit=git_commit(), gpu=gpu_name())
        judge_rows(rows)
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("log_tail", "traceback")}), flush=True)
        with open(path, "w") as f:  # after every mode: a run cut off by its time limit keeps its rows
            json.dump(result_envelope("multi_gpu", rows, command), f, indent=1, default=str)
    print(f"wrote {path}")
    return rows


def judge_rows(rows: list[dict]) -> None:
    """Against the same call's ``1gpu`` row: ``tokens_per_s_vs_1gpu`` (completion tokens/s over one GPU's) on every
    measured row, and the log-prob gap verdict: a mode serves the trained policy as well as one GPU does when its
    largest noise-free gap is at most ``GAP_VS_1GPU`` x one GPU's plus ``GAP_SLACK`` (``1gpu`` itself keeps the
    absolute ``GAP_TOLERANCE``; so does every mode of a call without a ``1gpu`` row). Statuses follow."""
    base = next((r for r in rows if r["mode"] == "1gpu" and r.get("tokens_per_s")), None)
    base_gaps = [g for g in (base or {}).get("checks", {}).get("noise_free_logprob_gap_per_rank", []) if g is not None]
    for r in rows:
        if base is None or not r.get("tokens_per_s"):
            continue
        r["tokens_per_s_vs_1gpu"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        gaps = r["checks"].get("noise_free_logprob_gap_per_rank") or []
        if r is not base and base_gaps and gaps and None not in gaps:
            limit = round(max(base_gaps) * GAP_VS_1GPU + GAP_SLACK, 4)
            r["checks"]["noise_free_logprob_gap_limit"] = limit
            r["checks"]["noise_free_logprob_gap_ok"] = max(gaps) <= limit
            _set_status(r)


if __name__ == "__main__":
    main()
