"""Shared helpers for benchmark scripts: the results envelope every ``benchmarks/results/*.json`` carries."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_uuid(device: int = 0) -> str | None:
    """GPU ``device``'s UUID (one physical device), written into every row: rows of two device calls can then be
    shown to have run on the same machine. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def keep_runs(rows: list[dict], new: list[dict], key, is_baseline=None) -> list[dict]:
    """``rows`` with ``new`` added: a new row replaces earlier rows of the same ``key(row)`` from another commit (or
    from no run, or from its own run given again); rows of one commit from different runs are all kept, since
    each run is its own comparison (one device call with a baseline arm of its own).

    Two exceptions keep a measured comparison whole: a new row that did not run (``status`` not ``ok``: a timeout,
    ``not_run``) does not replace a measured row of another commit, both stay; and with ``is_baseline``, a replaced
    baseline row (merged BF16, TRL's arm) stays while its run still has other rows, which are ratios against it."""
    ok = lambda r: r.get("status") == "ok"  # noqa: E731

    def replaces(r: dict, o: dict) -> bool:
        if key(o) != key(r):
            return False
        if o.get("commit") != r.get("commit") and ok(o) and not ok(r):
            return False
        return o.get("commit") != r.get("commit") or not o.get("run") or o.get("run") == r.get("run")

    out, dropped = list(rows), []
    for r in new:
        dropped += [o for o in out if replaces(r, o)]
        out = [o for o in out if not replaces(r, o)] + [r]
    if is_baseline is not None:
        live = {o.get("run") for o in out if o.get("run") and not is_baseline(o)}
        out += [d for d in dropped if is_baseline(d) and d.get("run") in live and d.get("run") not in
                {o.get("run") for o in out if is_baseline(o) and key(o) == key(d)}]
    return out


def gpu_tag() -> str:
    """'h100', 'h200', ... from the device name (results files are named ``<benchmark>-<tag>.json``)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for tag in ("gb200", "b200", "h200", "h100", "h20", "a100", "l40s", "l4", "a10g"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "-")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """HEAD, with ``-dirty`` when tracked files differ (so a result names the code it came from)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
    except OSError:
        head, dirty = "", ""
    if os.environ.get("QERL_COMMIT"):  # the GPU machine gets a copy of the tree without usable git history
        return os.environ["QERL_COMMIT"]
    if len(head) != 40:
        head = "unknown"
    return head + ("-dirty" if dirty else "")


def new_run_id() -> str:
    """One benchmark process's id (UTC start time + random suffix), written into each of its rows. A speed ratio is
    computed only between rows of one run: one machine, one commit, the arms back to back (rows from two device
    leases differ by 10-20% from the machines alone)."""
    import time
    import uuid

    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def result_envelope(benchmark: str, rows: list, command: str) -> dict:
    """``{"benchmark", "gpu", "versions", "commit", "command", "rows"}`` for ``benchmarks/results/*.json``. A row
    without its own ``commit`` gets the envelope's: rows are merged across files later, and each keeps its commit."""
    commit = git_commit()
    rows = [{**r, "commit": commit} if isinstance(r, dict) and "commit" not in r else r for r in rows]
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for pkg in ("transformers", "peft", "triton", "trl", "vllm"):
        v = _version(pkg)
        if v is not None:
            versions[pkg] = v
    return {
        "benchmark": benchmark,
        "gpu": gpu_name(),
        "versions": versions,
        "commit": commit,
        "command": command,
        "rows": rows,
    }


def write_result(benchmark: str, rows: list, out_dir: str, command: str | None = None) -> str:
    """(Re)write ``<out_dir>/<benchmark>-<gpu tag>.json`` with :func:`result_envelope`; returns its path.
    ``command`` defaults to this process's own command line."""
    env = result_envelope(benchmark, rows, command or "python " + " ".join(sys.argv))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{benchmark}-{gpu_tag()}.json")
    with open(path, "w") as f:
        json.dump(env, f, indent=1, default=str)
    return path
