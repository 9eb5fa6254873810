"""One benchmark arm in a child process: a fresh CUDA context and vLLM engine for every arm, as a user's run has.

``run_child`` runs the command with a time limit and kills its whole process group at the limit (a vLLM engine or
a launcher's worker left behind would hold the GPU for the next arm). The caller reads what the child wrote; when
it wrote nothing, :attr:`ChildResult.status` says why (timeout, out of memory, exit code) and ``log`` keeps the tail
of its output: where it stopped (loading, compiling, capturing CUDA graphs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qerl_trl.study.runner import free_port  # the launcher's rendezvous port: one below the ephemeral range

__all__ = ["ChildResult", "accelerate_launch", "free_port", "run_child", "signal_group", "visible_gpu"]

#: characters of a child's output kept for a failed row
LOG_TAIL = 8000
#: the accelerate configs users launch the examples with (README, ``examples/grpo_gsm8k.py``)
ACCELERATE_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                  "accelerate_configs")  # fmt: skip


def visible_gpu(index: int, environ: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that gives a child this process's GPU ``index``: the ``index``-th entry of this
    process's own list when it has one (under ``CUDA_VISIBLE_DEVICES=2,3``, GPU 1 is ``"3"``), else ``index``. A
    bare index would put the child on the machine's GPU of that number, beside whatever runs there: a GPU-suite
    lane's server test once ran its trainer and server on the other lane's GPU."""
    listed = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return str(index)
    visible = [d.strip() for d in listed.split(",") if d.strip()]
    if index >= len(visible):
        raise ValueError(f"GPU {index} asked for, but CUDA_VISIBLE_DEVICES={listed!r} shows {len(visible)}")
    return visible[index]


def accelerate_launch(script: str, args: Sequence[str], processes: int, launcher: Sequence[str] = ()) -> list[str]:
    """``accelerate launch`` of ``script`` on ``processes`` ranks with the examples' accelerate config, as a user runs
    the GRPO example: ``multi_gpu.yaml`` (DDP) for several ranks, ``single_gpu.yaml`` for one; ``launcher``: more
    options of ``accelerate launch`` (e.g. ``--use_fsdp``), which take precedence over the config's."""
    config = "multi_gpu.yaml" if processes > 1 else "single_gpu.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(ACCELERATE_CONFIGS, config), "--num_processes", str(processes), "--main_process_port",
            str(free_port()), *launcher, script, *args]  # fmt: skip


@dataclass(frozen=True)
class ChildResult:
    returncode: int | None  # None when killed at the time limit
    timed_out: bool
    timeout: float
    log: str  # the tail of stdout and stderr together
    wall_s: float

    @property
    def status(self) -> str:
        """A failed row's status: ``timeout after N s``, ``failed: exit code N``, ``oom: ...`` when the log says so."""
        status = f"timeout after {self.timeout:.0f} s" if self.timed_out else f"failed: exit code {self.returncode}"
        return "oom: " + status if "out of memory" in self.log.lower() else status


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupt_on_sigterm() -> signal.Handlers | None:
    """While a child runs, SIGTERM to a benchmark script (a device call's ``timeout``) raises KeyboardInterrupt, so
    :func:`run_child` kills the child's group (it leads its own session, so nothing else reaches it: the device
    ends a finished call's processes but not those of another session). Only where SIGTERM has its default action
    and in the main thread (pytest's ``tests/conftest.py`` has its own); returns the handler to put back, or None."""
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group ``proc`` leads (started with ``start_new_session``); none left is no error."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run_child(cmd: Sequence[str], timeout: float, *, log_path: str | None = None,
              env: Mapping[str, str] | None = None) -> ChildResult:  # fmt: skip
    """Run ``cmd`` (its output to ``log_path`` when given, else kept in memory) for at most ``timeout`` seconds. Its
    whole process group is killed at the limit, and when this process is interrupted while waiting (not in the few
    milliseconds while the child is being started: an interrupt there leaves it running)."""
    t0 = time.perf_counter()
    sink = open(log_path, "w") if log_path else subprocess.PIPE  # noqa: SIM115 - closed below
    previous = _interrupt_on_sigterm()
    try:
        proc = subprocess.Popen(list(cmd), stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=dict(env) if env is not None else None)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        except BaseException:  # interrupted (Ctrl-C, the GPU suite's SIGTERM): its vLLM engine must not outlive us
            signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if log_path:
            sink.close()
    if log_path:
        with open(log_path, errors="replace") as f:
            out = f.read()
    return ChildResult(None if timed_out else proc.returncode, timed_out, timeout, (out or "")[-LOG_TAIL:],
                       round(time.perf_counter() - t0, 1))  # fmt: skip
