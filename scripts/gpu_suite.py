"""The GPU suite (``pytest -m "gpu or vllm"``) in parts that each fit one 10-minute call on the GPU machine (aim: 8).

    python scripts/gpu_suite.py --list          # the parts and their tests
    python scripts/gpu_suite.py kernels         # one part (extra arguments go to pytest)
    python scripts/gpu_suite.py kernels --record benchmarks/results   # and add its outcome and time to the record
    python scripts/gpu_suite.py --lanes learning,vllm_layers checkpoint_32b,real_shape_32b --record DIR
        # on a machine of several GPUs: each lane's parts in order on its own GPU, the lanes side by side

Every GPU test belongs to exactly one part (``tests/test_gpu_suite.py`` checks it on CPU), so running every part
at one commit is running the whole suite there. A part runs pytest with ``-m "gpu or vllm"`` and its files. Run them
in the order listed on one machine: ``real_shape_32b`` reuses the checkpoint ``checkpoint_32b`` writes under
``$QERL_E2E_WORK`` (alone, it writes it first and takes longer). The ``server_*`` parts and
``benchmarks/multi_gpu.py``'s server mode start ``vllm serve``, which needs the wheels of
``scripts/gpu-serve-wheels.txt`` in the device bundle.

Why lanes: a 2-GPU machine counts its held time in full, a one-GPU machine (here) at a share, and the one-GPU parts
take longer together than one machine is held; on two GPUs side by side they take about half the wall time, in one
bundle upload. Lane ``i`` sees only GPU ``i`` (``CUDA_VISIBLE_DEVICES``; ``server_*`` then share that GPU with its
trainer) and gets its own ``QERL_E2E_WORK``; its output goes to ``gpu_suite-lane<i>.log`` in the record directory (or
the working directory), and each row notes its lane. A lane's wall times are not those of a machine to itself.
Tests that start a child on "GPU i" name the lane's own GPU (``benchmarks._child.visible_gpu``).

``QERL_JOB_CONFIG='{"fused_importance_sampling": true}'`` runs the jobs of ``tests/ddp_job.py`` (the ``multi_gpu``,
``tensor_parallel`` and ``server_*`` parts) with those config fields over their own, so an option runs on several GPUs
before its default changes; each row then records them (``job_config``).

A signal (a device call's ``timeout`` sends SIGTERM) stops the suite without leaving GPU memory held: each running
part's pytest runs its finalizers, which stop the vLLM servers and engines its tests started, its process group is
killed after ``STOP_GRACE_S``, no later part starts, and the part is recorded as failed, "stopped after N s".
"""

from __future__ import annotations

import argparse
import codecs
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import TextIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks._child import signal_group, visible_gpu  # noqa: E402 - the repository root first

_SERVER_TEST = ("tests/test_server_mode_gpu.py::"
                "test_training_against_the_server_serves_the_trained_lora_and_never_writes_the_base")

#: part -> (pytest arguments, what it holds). Each part's measured time is a row of RESULTS (``--record``): the
#: rows name their commit and GPU, and ``--list`` shows the newest. vLLM's compile cache may have been warm from an
#: earlier part on the same machine.
PARTS: dict[str, tuple[list[str], str]] = {
    "kernels": (["-m", "gpu and not vllm", "tests", "--ignore", "tests/test_checkpoint_32b.py"],
                "NVFP4 kernels, quantizer on CUDA"),
    "colocate": (["tests/test_trainer_vllm_gpu.py", "-k", "not files and not fused"],
                 "SmolLM2 colocate check per LoRA backend"),
    "colocate_variants": (["tests/test_trainer_vllm_gpu.py", "-k", "files or fused"],
                          "SmolLM2 colocate check of the options off the default path, with sleep mode"),
    "vllm_layers": (["tests/test_single_lora_vllm.py", "tests/test_trainer_dropin.py"],
                    "single-LoRA layers on real Marlin, the drop-in forms under colocate"),
    "learning": (["tests/test_learning_gpu.py"], "compare, three arms on one GPU"),
    "real_shape": (["tests/test_real_shape_colocate.py"], "1.5B colocate training, AQN and sleep mode on"),
    "moe": (["tests/test_moe_colocate_gpu.py"],
            "a small Qwen3-MoE in colocate training, both backends"),
    "real_shape_moe": (["tests/test_real_shape_moe_gpu.py"],
                       "Qwen3-30B-A3B (NVFP4) colocate training: routing, AQN, log-probs"),
    # the 32B memory step took 9.5 min with its checkpoint's write at aa48af6: the write is its own part, run first
    "checkpoint_32b": (["tests/test_checkpoint_32b.py"], "writes and checks the 32B NVFP4 checkpoint"),
    "real_shape_32b": (["tests/test_real_shape_32b.py"], "32B memory step on the checkpoint above"),
    # one part per LoRA backend: together they ran past a 535 s timeout beside other lanes (2493cbf, 67f707f)
    # (one GPU shared by the server and the trainer, or the server on the second)
    "server_qerl": ([f"{_SERVER_TEST}[qerl]"], "qerl-trl vllm-serve + a server-mode trainer, the in-layer LoRA"),
    "server_vllm": ([f"{_SERVER_TEST}[vllm]"], "the same with vLLM's adapters (the \"vllm\" LoRA backend)"),
    "multi_gpu": (["tests/test_multi_gpu.py"], "DDP jobs (both LoRA backends, a resume), FSDP refused: 2 GPUs"),
    "tensor_parallel": (["tests/test_tensor_parallel_gpu.py"], "TP=2 colocated engine, both LoRA backends: 2 GPUs"),
}

#: the committed records of the parts' runs, one file per GPU kind (``--record benchmarks/results`` writes the
#: machine's own): ``--list`` shows each part's newest row over all of them, since parts run on H100s and H200s
RESULTS = os.path.join(REPO, "benchmarks", "results", "gpu_suite-*.json")


def pytest_args(part: str) -> list[str]:
    args, _ = PARTS[part]
    return args if "-m" in args else ["-m", "gpu or vllm", *args]


def _rows(path: str) -> list[dict]:
    """The rows recorded in ``path``, oldest first (none if the file is missing)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(json.load(f)["rows"])


#: pytest's closing line: "2 passed, 1 skipped in 3.1s", "1 failed, 1 passed in 0.2s", "2 skipped in 9.8s", "no tests
#: ran in 0.1s"
SUMMARY = re.compile(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in \d+(\.\d+)?s\b")
PASSED = re.compile(r"\b[1-9]\d* passed\b")


def part_status(rc: int, summary: str) -> str:
    """'passed' only where a test passed: a part whose tests all skipped (a missing SmolLM2 GGUF, one GPU for a
    two-GPU part) exits 0 and checked nothing, so its row says 'skipped' (two rows at ca81141 said 'passed')."""
    if rc != 0:
        return "failed"
    return "passed" if PASSED.search(summary) else "skipped"


#: seconds a stopped part's pytest gets to run its finalizers (stop its vLLM servers) before its group is killed
STOP_GRACE_S = 15.0
_live: set[subprocess.Popen] = set()  # the parts' pytest processes now running (each leads its own session)
_live_lock = threading.Lock()
_stopping = threading.Event()


def _stop(signum: int, frame: object) -> None:
    """SIGTERM or SIGINT to the suite (a device call's ``timeout``): every running part's pytest gets SIGTERM, which
    ``tests/conftest.py`` turns into KeyboardInterrupt so fixtures stop the servers and engines they started; whatever
    is left of a part's process group after :data:`STOP_GRACE_S` is killed. No further part starts."""
    _stopping.set()
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        signal_group(proc, signal.SIGTERM)

    def kill_rest() -> None:
        for proc in procs:
            signal_group(proc, signal.SIGKILL)

    timer = threading.Timer(STOP_GRACE_S, kill_rest)
    timer.daemon = True
    timer.start()


def _run_part(part: str, rest: list[str], env: dict[str, str] | None = None,
              out: TextIO | None = None) -> tuple[int, str, float]:
    """Runs the part's pytest (in ``env``, in its own session so that :func:`_stop` reaches all it started), echoing
    its output to ``out`` (stdout); returns (exit code, pytest's summary line, seconds). A part stopped by
    :func:`_stop` returns a non-zero code and says so in its summary."""
    # --durations: the log says which tests (and their setup: a vLLM engine's start) take a part's time
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *pytest_args(part), *rest]
    out = out or sys.stdout
    t0 = time.monotonic()
    last = ""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          start_new_session=True) as proc:  # fmt: skip
        with _live_lock:
            _live.add(proc)
        try:
            assert proc.stdout is not None
            line = ""
            # Echoed as it comes, not by line: pytest -q writes a line of progress dots over minutes, and a device
            # call killed at its time limit must leave in the log how far the part got.
            while chunk := proc.stdout.read1(65536):
                text = decode.decode(chunk)
                out.write(text)
                out.flush()
                *done, line = (line + text).split("\n")
                for full in done:
                    if SUMMARY.search(full):  # not the last line: NCCL and vLLM print warnings after the summary
                        last = full.strip()
            rest = decode.decode(b"", final=True)  # an incomplete character at the very end
            out.write(rest)
            if SUMMARY.search(line + rest):
                last = (line + rest).strip()
        finally:
            proc.wait()
            with _live_lock:
                _live.discard(proc)
    seconds = time.monotonic() - t0
    if _stopping.is_set() and proc.returncode != 0:
        signal_group(proc, signal.SIGKILL)  # what pytest started in its group and left behind
        return proc.returncode or 1, f"stopped after {seconds:.0f} s (the suite got a signal); pytest: {last}", seconds
    return proc.returncode, last.strip("= "), seconds


def record(out_dir: str, part: str, rc: int, summary: str, seconds: float, uuid: str | None = None,
           note: str | None = None) -> str:
    """Adds the part's row to ``<out_dir>/gpu_suite-<gpu>.json`` (a later row of the same part and commit replaces
    it); returns the path. Written so that a suite run leaves what passed, at which commit, on which GPU (``uuid``:
    by default this process's first GPU's), and how long each part took, rather than a timing copied into a docstring
    by hand."""
    sys.path.insert(0, REPO)
    from benchmarks._common import git_commit, gpu_tag, gpu_uuid, write_result  # torch: only on a recording run

    commit = git_commit()
    row = {"part": part, "status": part_status(rc, summary), "rc": rc, "summary": summary,
           "wall_s": round(seconds, 1), "commit": commit, "gpu_uuid": uuid or gpu_uuid(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    if note:
        row["note"] = note
    if os.environ.get("QERL_JOB_CONFIG"):  # the multi-GPU and server jobs ran with these options over their own
        row["job_config"] = _job_config(os.environ["QERL_JOB_CONFIG"])
    path = os.path.join(out_dir, f"gpu_suite-{gpu_tag()}.json")
    rows = [r for r in _rows(path) if not (r["part"] == part and r["commit"] == commit)] + [row]
    command = "python scripts/gpu_suite.py PART --record " + out_dir + " (one row per part)"
    return write_result("gpu_suite", rows, out_dir, command)


def _job_config(text: str) -> object:
    """``QERL_JOB_CONFIG`` as the row keeps it: the parsed object, or the text as given where it is not JSON (the
    jobs then stopped at their config; the part's row must still be written, saying so)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


#: what a lane's pytest must not inherit: another lane's GPUs and rendezvous (TRL 1.16 picks a free port when
#: ``MASTER_PORT`` is unset), and the scratch directory the 32B parts share within a lane
_LANE_DROPS = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "QERL_E2E_WORK")  # fmt: skip


def lane_env(parent: dict[str, str], lane: int, work_root: str) -> dict[str, str]:
    """Lane ``lane``'s environment: ``parent`` without :data:`_LANE_DROPS`, on the parent's GPU ``lane`` alone (the
    ``lane``-th of its ``CUDA_VISIBLE_DEVICES``, if set), with its own ``QERL_E2E_WORK`` under ``work_root``."""
    env = {k: v for k, v in parent.items() if k not in _LANE_DROPS}
    env.update(CUDA_VISIBLE_DEVICES=visible_gpu(lane, parent), QERL_E2E_WORK=os.path.join(work_root, f"lane{lane}"))
    return env


def run_lanes(lanes: list[list[str]], rest: list[str], record_dir: str | None) -> int:
    """Runs each lane's parts in order on its own GPU, the lanes side by side (threads waiting on pytest processes);
    returns 0 when every part passed. Rows are recorded as each part ends (one lock: one record file)."""
    log_dir = record_dir or os.getcwd()
    os.makedirs(log_dir, exist_ok=True)
    work_root = os.environ.get("QERL_E2E_WORK") or os.path.join(tempfile.gettempdir(), "qerl-e2e")
    lock = threading.Lock()
    codes: list[int] = []
    sys.path.insert(0, REPO)
    import torch

    from benchmarks._common import gpu_uuid

    if torch.cuda.is_available() and torch.cuda.device_count() < len(lanes):
        raise SystemExit(f"gpu_suite: {len(lanes)} lanes need {len(lanes)} GPUs; this machine shows "
                         f"{torch.cuda.device_count()}")  # fmt: skip
    # read before any part starts: this process then touches no GPU while a lane's vLLM engine measures free memory
    uuids = [gpu_uuid(i) for i in range(len(lanes))]

    def lane(i: int, parts: list[str]) -> None:
        beside = "; ".join(",".join(p) for j, p in enumerate(lanes) if j != i)
        with open(os.path.join(log_dir, f"gpu_suite-lane{i}.log"), "w") as log:
            for part in parts:
                if _stopping.is_set():
                    break
                rc, summary, seconds = _run_part(part, rest, env=lane_env(dict(os.environ), i, work_root), out=log)
                with lock:
                    codes.append(rc)
                    where = ""
                    if record_dir:
                        note = f"lane {i} of {len(lanes)} (GPU {i}; beside it: {beside})"
                        where = " -> " + record(record_dir, part, rc, summary, seconds, uuid=uuids[i], note=note)
                    print(f"gpu_suite: lane {i}: {part} {summary!r} in {seconds:.0f} s{where}", flush=True)

    threads = [threading.Thread(target=lane, args=(i, parts)) for i, parts in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a timed join: the main thread then runs _stop as soon as a signal comes
            t.join(timeout=0.5)
    ran_all = len(codes) == sum(len(parts) for parts in lanes)  # a lane whose thread died did not pass
    return 0 if ran_all and all(c == 0 for c in codes) else 1


def _newest(pattern: str) -> dict[str, tuple[str, dict]]:
    """Each part's newest row over the record files ``pattern`` matches, with its file's GPU tag. Newest by the row's
    ``when`` (UTC, so it sorts as text); rows without one (a part not run) rank below any with one, later rows of a
    file above earlier."""
    newest: dict[str, tuple[str, dict]] = {}
    for path in sorted(glob.glob(pattern)):
        gpu = os.path.basename(path).removeprefix("gpu_suite-").removesuffix(".json")
        for row in _rows(path):
            seen = newest.get(row["part"])
            if seen is None or (row.get("when") or "") >= (seen[1].get("when") or ""):
                newest[row["part"]] = (gpu, row)
    return newest


def _seen(seen: tuple[str, dict] | None) -> str:
    """'passed in 278 s at a29dbda (h100)', 'not_run at a29dbda (h100)' (the status up to its reason), or 'not yet
    run'; '(h200, a selection)' where the row ran only some of the part's tests (a hand-merged row's ``selection``),
    '(h100, with QERL_JOB_CONFIG)' where its jobs ran with options over their own."""
    if seen is None:
        return "not yet run"
    gpu, row = seen
    took = f" in {row['wall_s']:.0f} s" if row.get("wall_s") is not None else ""
    where = ", ".join([gpu] + ["a selection"] * bool(row.get("selection"))
                      + ["with QERL_JOB_CONFIG"] * bool(row.get("job_config")))  # not the part as shipped
    return f"{row['status'].split(':')[0]}{took} at {str(row.get('commit'))[:7]} ({where})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", choices=list(PARTS))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--record", metavar="DIR", help="add the part's outcome and time to DIR/gpu_suite-<gpu>.json")
    ap.add_argument("--lanes", nargs="+", metavar="PART,PART", help="one comma-separated list of parts per GPU: "
                    "each list in order on its own GPU, the lists side by side")  # fmt: skip
    a, rest = ap.parse_known_args(argv)
    if not (a.lanes or a.part):
        return _run(a, rest, ap)
    _stopping.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(a, rest, ap)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(a: argparse.Namespace, rest: list[str], ap: argparse.ArgumentParser) -> int:
    if a.lanes:
        lanes = [[p for p in lane.split(",") if p] for lane in a.lanes]
        unknown = sorted({p for lane in lanes for p in lane} - set(PARTS))
        if a.part or unknown or not all(lanes):
            ap.error(f"--lanes takes comma-separated parts of {', '.join(PARTS)} and no PART"
                     + (f"; unknown: {', '.join(unknown)}" if unknown else ""))  # fmt: skip
        return run_lanes(lanes, rest, a.record)
    if a.list or not a.part:
        newest = _newest(RESULTS)
        for name, (_, what) in PARTS.items():
            print(f"{name:15s} {what:70s} {_seen(newest.get(name)):46s} pytest {' '.join(pytest_args(name))}")
        return 0
    rc, summary, seconds = _run_part(a.part, rest)
    if a.record:
        print(f"gpu_suite: {a.part} {summary!r} in {seconds:.0f} s -> {record(a.record, a.part, rc, summary, seconds)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
