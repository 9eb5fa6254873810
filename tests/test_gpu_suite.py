"""scripts/gpu_suite.py splits the GPU suite into parts: every GPU/vLLM test is in exactly one part."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_suite  # noqa: E402


def _collect(args: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {line.strip() for line in out.splitlines() if "::" in line}


def _matches(expr: str | None, has: Callable[[str], bool]) -> bool:
    """pytest's ``-m``/``-k`` grammar (names joined by ``and``, ``or``, ``not`` and parentheses), each name decided by
    ``has``: for ``-m`` a marker's name, for ``-k`` a case-insensitive substring of a keyword (pytest's documented
    semantics). None matches everything."""
    if expr is None:
        return True
    tokens = re.findall(r"\(|\)|[^\s()]+", expr)
    code = " ".join(t if t in ("(", ")", "and", "or", "not") else repr(has(t)) for t in tokens)
    return bool(eval(code, {"__builtins__": {}}))  # only True, False, and/or/not and parentheses


def _part_tests(part: str, whole: set[str], seen: dict | None = None) -> set[str]:
    """A part's tests. With ``seen`` (the session's node ids, markers and keywords: conftest's GPU_SUITE_SEEN), its
    files, ``-m``, ``-k`` and ``--ignore`` select them here, as pytest would; without it a part that names files holds
    the GPU tests of those files and a part with its own ``-m`` or ``-k`` is collected in a child pytest (each child
    imports the test modules, which took 28 s of CI's 2 cores for three parts)."""
    args = gpu_suite.pytest_args(part)
    if seen is None:
        if args[:2] == ["-m", "gpu or vllm"] and "-k" not in args:
            paths = [a.rstrip("/") for a in args[2:]]  # files, folders, or test ids (``file::test[param]``)
            return {t for t in whole if any(_under(t, p) for p in paths)}
        return _collect(args)
    options: dict[str, str | None] = {"-m": None, "-k": None}
    paths, ignored = [], []
    rest = iter(args)
    for arg in rest:
        if arg in options:
            options[arg] = next(rest)
        elif arg == "--ignore":
            ignored.append(next(rest).rstrip("/"))
        else:
            assert not arg.startswith("-"), f"part {part}: {arg} is not an option this test can apply"
            paths.append(arg.rstrip("/"))
    return {t for t, (marks, words) in seen.items()
            if any(_under(t, p) for p in paths) and not any(_under(t, p) for p in ignored)
            and _matches(options["-m"], lambda name: name in marks)
            and _matches(options["-k"], lambda name: any(name.lower() in w for w in words))}  # fmt: skip


def _under(test: str, path: str) -> bool:
    """``test`` (a node id) is ``path``, in the file ``path``, or under the folder ``path``."""
    return test == path or test.split("::")[0] == path or test.startswith(path + "/")


def test_the_selection_reads_m_and_k_as_pytest_does():
    marks, words = frozenset({"gpu"}), frozenset({"test_x[files_sleep]", "test_trainer_vllm_gpu.py", "tests", "gpu"})
    is_mark, has_word = (lambda n: n in marks), (lambda n: any(n.lower() in w for w in words))
    assert _matches("gpu and not vllm", is_mark) and not _matches("not gpu", is_mark)
    assert _matches("(vllm or gpu) and not (vllm)", is_mark)
    assert _matches("files or fused", has_word) and not _matches("not files and not fused", has_word)
    assert _matches("FILES", has_word) and _matches(None, has_word)


def test_every_gpu_test_is_in_exactly_one_part(request):
    from conftest import GPU_SUITE_SEEN

    seen_here = request.config.stash.get(GPU_SUITE_SEEN, None)  # this session's, when it collected every module
    whole = set(seen_here) if seen_here is not None else _collect(["-m", "gpu or vllm", "tests"])
    assert len(whole) > 100
    seen: dict[str, str] = {}
    for part in gpu_suite.PARTS:
        for test in _part_tests(part, whole, seen_here):
            assert test not in seen, f"{test} is in parts {seen[test]} and {part}"
            seen[test] = part
    assert set(seen) == whole, sorted(whole - set(seen))[:5]


def test_a_recorded_part_leaves_its_outcome_commit_and_time(tmp_path, monkeypatch, capsys):
    tiny = tmp_path / "test_tiny.py"
    tiny.write_text(textwrap.dedent("""
        import atexit

        import pytest


        @pytest.mark.gpu
        def test_ok():
            pass


        @pytest.mark.gpu
        def test_bad():
            assert False


        @pytest.mark.gpu
        def test_skipping():
            pytest.skip("what this machine lacks")


        def teardown_module():  # as NCCL does at exit: a line after pytest's summary, which the record must skip
            atexit.register(print, "[rank0]: Warning: destroy_process_group() was not called")
    """))
    monkeypatch.setitem(gpu_suite.PARTS, "tiny", ([str(tiny)], "one passing and one failing test"))
    monkeypatch.setenv("QERL_COMMIT", "a" * 40)
    out = tmp_path / "out"

    assert gpu_suite.main(["tiny", "--record", str(out), "-k", "skipping"]) == 0
    (path,) = out.iterdir()
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["status"], row["rc"]) == ("skipped", 0) and row["summary"].startswith("1 skipped, 2 deselected")
    assert gpu_suite.main(["tiny", "--record", str(out), "-k", "ok"]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "passed"
    assert gpu_suite.main(["tiny", "--record", str(out)]) == 1  # the same part at the same commit again: replaces

    (path,) = out.iterdir()
    result = json.loads(path.read_text())
    assert set(result) == {"benchmark", "gpu", "versions", "commit", "command", "rows"}
    (row,) = result["rows"]
    assert (row["part"], row["status"], row["rc"], row["commit"]) == ("tiny", "failed", 1, "a" * 40)
    assert row["summary"].startswith("1 failed, 1 passed, 1 skipped") and " in " in row["summary"] and row["wall_s"] > 0
    assert "test_bad" in capsys.readouterr().out  # pytest's output still reaches the console


def test_a_parts_output_reaches_the_log_before_its_line_ends(tmp_path, monkeypatch):
    """pytest -q prints a line of progress dots over minutes: the log gets each dot as it comes, so a part killed
    mid-line (a device call's time limit) still shows how far it got. The second test waits for the first's dot in
    the log the suite writes; an echo by whole lines never shows it, and the test fails at its deadline."""
    log = tmp_path / "part.log"
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent(f"""
        import time

        import pytest


        @pytest.mark.gpu
        def test_first():
            pass


        @pytest.mark.gpu
        def test_sees_the_first_dot_in_the_log():
            deadline = time.monotonic() + 60
            while "." not in open({str(log)!r}).read():
                assert time.monotonic() < deadline, "the first test's dot never reached the log"
                time.sleep(0.1)
    """))
    monkeypatch.setitem(gpu_suite.PARTS, "probe", ([str(probe)], "a dot in the log before the line ends"))
    with open(log, "w") as out:
        rc, summary, _ = gpu_suite._run_part("probe", [], out=out)
    assert rc == 0 and summary.startswith("2 passed"), (rc, summary, log.read_text())


def test_the_list_shows_each_parts_newest_record(tmp_path, monkeypatch, capsys):
    """Over every GPU's record file: a part run on an H200 after its H100 row shows the H200 row."""
    h100 = [{"part": "kernels", "status": "failed", "wall_s": 300.0, "commit": "1" * 40},
            {"part": "kernels", "status": "passed", "wall_s": 278.4, "commit": "2" * 40},
            {"part": "multi_gpu", "status": "not_run: needs 2 GPUs", "wall_s": None, "commit": "2" * 40},
            {"part": "server_qerl", "status": "failed", "wall_s": 431.0, "commit": "2" * 40,
             "when": "2026-11-25T21:36"},
            {"part": "learning", "status": "passed", "wall_s": 270.0, "commit": "4" * 40, "when": "2026-11-26T09:00"}]
    h200 = [{"part": "multi_gpu", "status": "passed", "wall_s": 446.3, "commit": "3" * 40, "when": "2026-11-26T04:45"},
            {"part": "server_qerl", "status": "passed", "wall_s": 201.4, "commit": "3" * 40, "when": "2026-11-26T02:35",
             "selection": "-k qerl"},
            {"part": "learning", "status": "failed", "wall_s": 9.0, "commit": "3" * 40, "when": "2026-11-26T01:00"},
            {"part": "tensor_parallel", "status": "failed", "wall_s": 72.3, "commit": "3" * 40,
             "when": "2026-11-28T00:40", "job_config": {"vllm_lora_expand_in_gemm": True}}]
    (tmp_path / "gpu_suite-h100.json").write_text(json.dumps({"rows": h100}))
    (tmp_path / "gpu_suite-h200.json").write_text(json.dumps({"rows": h200}))
    monkeypatch.setattr(gpu_suite, "RESULTS", str(tmp_path / "gpu_suite-*.json"))
    assert gpu_suite.main(["--list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "passed in 278 s at 2222222 (h100)" in lines["kernels"]
    assert "passed in 446 s at 3333333 (h200)" in lines["multi_gpu"]
    assert "passed in 201 s at 3333333 (h200, a selection)" in lines["server_qerl"]
    assert "passed in 270 s at 4444444 (h100)" in lines["learning"]
    assert "not yet run" in lines["colocate"]
    assert "failed in 72 s at 3333333 (h200, with QERL_JOB_CONFIG)" in lines["tensor_parallel"]  # not as shipped


def test_lanes_run_their_parts_in_order_each_on_its_own_gpu(tmp_path, monkeypatch, capsys):
    """``--lanes a,b c``: lane 0 runs a then b on GPU 0, lane 1 runs c on GPU 1 at the same time, each with its own
    scratch directory and no inherited rendezvous; every part is a row naming its lane, and one failure fails all."""
    seen = tmp_path / "seen"
    seen.mkdir()
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent(f"""
        import os
        import time

        import pytest


        @pytest.mark.gpu
        def test_probe(request):
            name = request.config.getoption("markexpr") + "-" + str(time.monotonic_ns())
            env = {{k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "QERL_E2E_WORK", "MASTER_PORT")}}
            start = time.time()
            time.sleep(2.0)
            env["span"] = (start, time.time())
            open(os.path.join({str(seen)!r}, env["CUDA_VISIBLE_DEVICES"] + "-" + name), "w").write(repr(env))
            assert os.environ.get("QERL_PROBE_FAIL") != env["CUDA_VISIBLE_DEVICES"]
    """))
    for name in ("p1", "p2", "p3"):
        monkeypatch.setitem(gpu_suite.PARTS, name, ([str(probe)], "a probe"))
    monkeypatch.setenv("QERL_COMMIT", "b" * 40)
    monkeypatch.setenv("MASTER_PORT", "29500")  # a parent's rendezvous: no lane may inherit it
    monkeypatch.setenv("QERL_E2E_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"

    assert gpu_suite.main(["--lanes", "p1,p2", "p3", "--record", str(out)]) == 0
    envs = {path.name.split("-")[0]: [] for path in seen.iterdir()}
    for path in seen.iterdir():
        envs[path.name.split("-")[0]].append(eval(path.read_text()))  # noqa: S307 - our own repr of a dict
    assert sorted(envs) == ["0", "1"] and len(envs["0"]) == 2 and len(envs["1"]) == 1
    for lane, runs in envs.items():
        for env in runs:
            work = str(tmp_path / "work" / f"lane{lane}")
            assert {k: v for k, v in env.items() if k != "span"} == {
                "CUDA_VISIBLE_DEVICES": lane, "MASTER_PORT": None, "QERL_E2E_WORK": work}
    first, second = sorted(env["span"] for env in envs["0"])
    assert first[1] <= second[0]  # lane 0: p1, then p2
    (p3,) = [env["span"] for env in envs["1"]]
    assert p3[0] < second[1] and first[0] < p3[1]  # lane 1 ran while lane 0 did: side by side
    (record,) = [p for p in out.iterdir() if p.suffix == ".json"]
    rows = json.loads(record.read_text())["rows"]
    assert sorted(r["part"] for r in rows) == ["p1", "p2", "p3"] and all(r["status"] == "passed" for r in rows)
    notes = {r["part"]: r["note"] for r in rows}
    assert notes["p1"].startswith("lane 0 of 2") and "beside it: p3" in notes["p1"]
    assert notes["p3"].startswith("lane 1 of 2") and "beside it: p1,p2" in notes["p3"]
    assert "1 passed" in (out / "gpu_suite-lane0.log").read_text()  # each lane's pytest output in its own log
    assert "gpu_suite: lane 1: p3" in capsys.readouterr().out

    monkeypatch.setenv("QERL_PROBE_FAIL", "1")  # lane 1's part fails: the run fails, lane 0's parts still ran
    assert gpu_suite.main(["--lanes", "p1", "p3", "--record", str(out)]) == 1
    rows = {r["part"]: r for r in json.loads(record.read_text())["rows"]}
    assert rows["p3"]["status"] == "failed" and rows["p1"]["status"] == "passed"


def test_lanes_refuse_an_unknown_part_before_running_any(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--lanes", "kernels,no_such_part", "learning"])
    assert "unknown: no_such_part" in capsys.readouterr().err


def test_a_lane_takes_the_parents_gpu_of_its_index():
    """Under ``CUDA_VISIBLE_DEVICES=2,3`` lane 1 is physical GPU 3, not 1; without it, GPU 1."""
    env = gpu_suite.lane_env({"CUDA_VISIBLE_DEVICES": "2,3", "MASTER_PORT": "29500", "PATH": "/bin"}, 1, "/w")
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "QERL_E2E_WORK": "/w/lane1", "PATH": "/bin"}
    assert gpu_suite.lane_env({}, 1, "/w")["CUDA_VISIBLE_DEVICES"] == "1"
    # a test's own child on "the second GPU" inside lane 1 (CUDA_VISIBLE_DEVICES=3) is refused, not put on GPU 1
    from benchmarks._child import visible_gpu

    assert visible_gpu(0, {"CUDA_VISIBLE_DEVICES": "3"}) == "3"
    with pytest.raises(ValueError, match="shows 1"):
        visible_gpu(1, {"CUDA_VISIBLE_DEVICES": "3"})


def test_a_signal_stops_the_suite_and_nothing_its_parts_started_outlives_it(tmp_path, monkeypatch):
    """A device call's ``timeout`` sends SIGTERM to the suite: the running part's pytest gets it (``tests/conftest.py``
    makes it KeyboardInterrupt), its fixtures' finalizers and ``run_child`` stop what they started in their own
    sessions, what else is left of its group is killed, no later part starts, and the part is a failed row saying
    it was stopped. At d251c46 a killed lane left a vLLM server holding 44 GiB of the GPU for the next call."""
    import signal
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    ours_conftest = os.path.join(REPO, "tests", "conftest.py")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util

        spec = importlib.util.spec_from_file_location("qerl_tests_conftest", {ours_conftest!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its SIGTERM handler, as in tests/
    """))
    (tmp_path / "test_stopped.py").write_text(textwrap.dedent(f"""
        import os
        import subprocess
        import sys

        import pytest

        sys.path.insert(0, {REPO!r})
        from benchmarks._child import run_child

        PIDS = {str(pids)!r}


        @pytest.fixture
        def server():
            proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a vLLM server's place
            open(os.path.join(PIDS, "server"), "w").write(str(proc.pid))
            yield
            os.killpg(proc.pid, 15)
            proc.wait()
            open(os.path.join(PIDS, "finalized"), "w").write("yes")


        @pytest.mark.gpu
        def test_stopped(server):
            stray = subprocess.Popen(["sleep", "300"])  # in pytest's own group, no finalizer
            open(os.path.join(PIDS, "stray"), "w").write(str(stray.pid))
            suite = os.getppid()  # the child of run_child signals the suite, then waits as an engine would; it waits
            # a second first, so the signal comes while run_child waits on it, not while it is being started
            run_child(["sh", "-c", f"echo $$ > {{PIDS}}/child; sleep 1; kill -TERM {{suite}}; sleep 300"], timeout=120)
    """))
    (tmp_path / "test_after.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_after():\n"
                                            f"    open({str(pids / 'after')!r}, 'w').write('ran')\n")  # fmt: skip
    monkeypatch.setitem(gpu_suite.PARTS, "stopped", ([str(tmp_path / "test_stopped.py")], "a probe"))
    monkeypatch.setitem(gpu_suite.PARTS, "after", ([str(tmp_path / "test_after.py")], "a probe"))
    monkeypatch.setenv("QERL_COMMIT", "c" * 40)
    monkeypatch.setenv("QERL_E2E_WORK", str(tmp_path / "work"))
    ours = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"

    t0 = time.monotonic()
    assert gpu_suite.main(["--lanes", "stopped,after", "--record", str(out)]) == 1
    assert time.monotonic() - t0 < 60  # not the sleeps' 300 s
    assert signal.getsignal(signal.SIGTERM) is ours  # the suite gave the handler back
    assert (pids / "finalized").exists() and not (pids / "after").exists()
    for name in ("server", "stray", "child"):
        pid = int((pids / name).read_text())
        try:
            os.kill(pid, 0)
            alive = open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except ProcessLookupError:
            alive = False
        assert not alive, f"{name} ({pid}) outlived the stopped suite"
    rows = json.loads(next(out.glob("gpu_suite-*.json")).read_text())["rows"]
    assert [(r["part"], r["status"]) for r in rows] == [("stopped", "failed")]
    assert rows[0]["summary"].startswith("stopped after")


def test_a_part_run_with_job_options_says_so_in_its_row(tmp_path, monkeypatch):
    """QERL_JOB_CONFIG changes what the multi-GPU and server jobs run: a row measured with it must name it, or a pass
    with an option on would read as a pass of the defaults."""
    tiny = tmp_path / "test_tiny.py"
    tiny.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_ok():\n    pass\n")
    monkeypatch.setitem(gpu_suite.PARTS, "tiny", ([str(tiny)], "one passing test"))
    monkeypatch.setenv("QERL_COMMIT", "b" * 40)
    monkeypatch.setenv("QERL_JOB_CONFIG", '{"fused_importance_sampling": true}')
    assert gpu_suite.main(["tiny", "--record", str(tmp_path / "on")]) == 0
    (path,) = (tmp_path / "on").iterdir()
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "passed" and row["job_config"] == {"fused_importance_sampling": True}
    monkeypatch.setenv("QERL_JOB_CONFIG", "{fused: 1}")  # not JSON: the jobs refuse it, the row still says it
    assert gpu_suite.main(["tiny", "--record", str(tmp_path / "bad")]) == 0
    (path,) = (tmp_path / "bad").iterdir()
    (row,) = json.loads(path.read_text())["rows"]
    assert row["job_config"] == "{fused: 1}"
    monkeypatch.delenv("QERL_JOB_CONFIG")
    assert gpu_suite.main(["tiny", "--record", str(tmp_path / "off")]) == 0
    (path,) = (tmp_path / "off").iterdir()
    (row,) = json.loads(path.read_text())["rows"]
    assert "job_config" not in row
