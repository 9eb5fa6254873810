"""The learning-dynamics comparison (``qerl-trl compare``): config checks, verdicts, and the whole driver on a
tiny random model without vLLM (child processes, JSONL records, resume, failures kept as rows, plot)."""

from __future__ import annotations

import json
import os

import pytest

from qerl_trl.study.report import summarize, verdict
from qerl_trl.study.spec import ARMS, LearningConfig


def test_config_rejects_bad_input_with_what_to_do():
    with pytest.raises(ValueError, match="subset of"):
        LearningConfig(arms=["bf16", "nvfp4_lora"])
    with pytest.raises(ValueError, match="number_reward"):
        LearningConfig(reward="exact_match")
    with pytest.raises(ValueError, match="TASKS|dataset_name"):
        LearningConfig(task="multiply")
    with pytest.raises(ValueError, match="num_generations"):
        LearningConfig(num_generations=1)
    with pytest.raises(ValueError, match="seed"):
        LearningConfig(seeds=[])


@pytest.mark.parametrize(
    ("diffs", "at_least", "expected"),
    [
        ([0.1, 0.2, 0.05], False, "holds on every seed"),
        ([0.3, -0.1, 0.1], False, "mixed: holds on 2 of 3 seeds"),
        ([-0.3, 0.1, 0.1], False, "mixed: holds on 2 of 3 seeds"),
        ([-0.1, -0.2, 0.0], False, "does not hold on any seed"),
        ([0.0, 0.0, 0.1], True, "holds on every seed"),
        ([0.0, 0.0, 0.1], False, "mixed: holds on 1 of 3 seeds"),
        ([0.2], False, "one seed only: no verdict"),
        ([], False, "not measured"),
    ],
)
def test_verdict(diffs, at_least, expected):
    assert verdict(diffs, at_least) == expected


def _run(arm, seed, rewards, entropies, accs, status="ok", lr=5e-4):
    n = len(rewards)
    return {
        "name": f"{arm}-s{seed}", "arm": arm, "seed": seed, "learning_rate": lr, "status": status,
        "steps": {"step": list(range(1, n + 1)), "reward": rewards, "entropy": entropies,
                  "prompts_sha": [f"{seed}-{i}" for i in range(n)]},
        "evals": {"step": [0, n], "accuracy": accs},
    }  # fmt: skip


def test_summarize_pairs_by_seed_and_skips_failed_runs():
    cfg = LearningConfig(max_steps=10, seeds=[0, 1], early_fraction=0.2)
    runs = []
    for seed in (0, 1):
        runs.append(_run("bf16_lora", seed, [0.1] * 10, [1.0] * 10, [0.1, 0.4]))
        runs.append(_run("nvfp4_lora", seed, [0.1] * 10, [1.5, 1.5] + [1.0] * 8, [0.1, 0.3]))
        runs.append(_run("nvfp4_lora_aqn", seed, [0.1] * 5 + [0.5] * 5, [1.2] * 10, [0.1, 0.5 + seed / 10]))
    runs.append(_run("nvfp4_lora_aqn", 2, [1.0] * 10, [9.0] * 10, [0.0, 1.0], status="failed"))
    s = summarize(runs, cfg)["0.0005"]
    assert s["arms"]["nvfp4_lora"]["early_entropy"] == {"mean": 1.5, "std": 0.0, "n": 2}  # steps 1..2
    assert s["arms"]["nvfp4_lora_aqn"]["mean_reward"]["mean"] == pytest.approx(0.3)
    assert s["arms"]["nvfp4_lora_aqn"]["final_accuracy"] == {"mean": 0.55, "std": pytest.approx(0.0707, abs=1e-4), "n": 2}
    claims = {(c["claim"], c["metric"], c["comparison"]): c for c in s["claims"]}
    ent = claims[("fp4_raises_early_entropy", "early_entropy", "nvfp4_lora - bf16_lora")]
    assert ent["per_seed"] == {0: 0.5, 1: 0.5} and ent["verdict"] == "holds on every seed"
    aqn = claims[("aqn_speeds_reward_growth", "mean_reward", "nvfp4_lora_aqn - nvfp4_lora")]
    assert aqn["mean"] == pytest.approx(0.2) and aqn["verdict"] == "holds on every seed"
    acc = claims[("final_accuracy_at_least_bf16", "final_accuracy", "nvfp4_lora - bf16_lora")]
    assert acc["verdict"] == "does not hold on any seed"
    assert s["same_data_order"] == {0: True, 1: True}


def test_cli_compare_bad_arm_is_a_clear_error(capsys):
    from qerl_trl.cli import main

    assert main(["compare", "--arms", "fp8_lora"]) == 1
    assert "arms must be a non-empty subset" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_runs_arms_as_child_processes_keeps_a_failed_run_and_resumes(tmp_path):
    """One driver run in three calls (each child process costs ~10 s of imports on CI's 2 cores, so the arms are the
    BF16 one and the NVFP4 + AQN one, which also covers NVFP4 without noise until AQN's first stage): a missing NVFP4
    base fails its runs, kept as rows, while the BF16 runs go on; with the input fixed only the failed runs train;
    then nothing does."""
    from test_examples import tiny_checkpoint

    from qerl_trl.study.runner import run_comparison

    src = tiny_checkpoint(tmp_path / "tiny")
    cfg = LearningConfig(
        model=str(src), nvfp4_model=str(tmp_path / "missing"), use_vllm=False, seeds=[0, 1],
        arms=["bf16_lora", "nvfp4_lora_aqn"], max_steps=3, prompts_per_step=2, num_generations=2, eval_every=2,
        eval_size=4, lora_r=8, lora_alpha=16, aqn_num_stages=2, parallel=2, output_dir=str(tmp_path / "cmp"),
    )  # fmt: skip
    work = tmp_path / "cmp"
    first = {r["name"]: r for r in run_comparison(cfg)["runs"]}
    for seed in (0, 1):
        assert first[f"bf16_lora-lr0.0005-s{seed}"]["status"] == "ok"
        failed = first[f"nvfp4_lora_aqn-lr0.0005-s{seed}"]
        assert failed["status"] == "failed" and "missing" in failed["error"]
    stamps = {p: os.path.getmtime(p) for p in (work / "runs").glob("bf16_lora-*.jsonl")}

    # run again with the input fixed: only the failed runs train, and each keeps how its first attempt ended
    cfg.nvfp4_model = None
    result = run_comparison(cfg)
    runs = {r["name"]: r for r in result["runs"]}
    assert len(runs) == 4 and all(r["status"] == "ok" for r in runs.values()), [r.get("error") for r in runs.values()]
    assert {p: os.path.getmtime(p) for p in (work / "runs").glob("bf16_lora-*.jsonl")} == stamps
    for r in runs.values():
        assert r["steps"]["step"] == [1, 2, 3] and r["evals"]["step"] == [0, 2, 3]
        assert all(e > 0 for e in r["steps"]["entropy"]) and all(0 <= x <= 1 for x in r["steps"]["reward"])
        assert r["steps"]["wall_s"] == sorted(r["steps"]["wall_s"])
        sigmas = r["steps"]["aqn_sigma"]
        assert sigmas == ([0.0, 0.0, 1e-2] if r["arm"] == "nvfp4_lora_aqn" else [0.0] * 3)
        if r["arm"] == "nvfp4_lora_aqn":
            (earlier,) = r["earlier_attempts"]
            assert earlier["status"] == "failed" and earlier["stage"] == "init" and "missing" in earlier["error"]
        else:
            assert "earlier_attempts" not in r
    # both arms of a seed saw the same prompts in the same order; the two seeds did not
    for seed in (0, 1):
        orders = {tuple(runs[f"{a}-lr0.0005-s{seed}"]["steps"]["prompts_sha"]) for a in cfg.arms}
        assert len(orders) == 1
    assert runs["bf16_lora-lr0.0005-s0"]["steps"]["prompts_sha"] != runs["bf16_lora-lr0.0005-s1"]["steps"]["prompts_sha"]
    assert result["summary"]["0.0005"]["same_data_order"] == {0: True, 1: True}
    assert (work / "nvfp4-base" / "config.json").is_file()  # quantized once, for every NVFP4 run
    png = (work / "learning_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20000
    saved = json.loads((work / "comparison.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(result["summary"]))

    # a third call finds every run finished and trains nothing
    stamps = {p: os.path.getmtime(p) for p in (work / "runs").glob("*.jsonl")}
    again = run_comparison(cfg)
    assert {p: os.path.getmtime(p) for p in (work / "runs").glob("*.jsonl")} == stamps
    assert [r["status"] for r in again["runs"]] == ["ok"] * 4


def test_child_runs_do_not_inherit_the_parents_distributed_rendezvous():
    from qerl_trl.study.runner import child_env

    parent = {"PATH": "/bin", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1",
              "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "16"}  # fmt: skip
    env = child_env(parent, threads=2)
    port = env.pop("MASTER_PORT")
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2",
                   "TOKENIZERS_PARALLELISM": "false", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    assert port != "29500" and 0 < int(port) < 65536  # its own port: not the parent's, nor TRL's first pick
    assert parent["MASTER_PORT"] == "29500"  # the parent's own environment is left as it was


def test_children_started_side_by_side_get_a_port_each(monkeypatch):
    """TRL's pick from a fixed list raced when trainers started at once on one host (EADDRINUSE): each child's port
    is a fresh pick of the OS's."""
    import itertools

    from qerl_trl.study import runner

    picks = itertools.count(40001)
    monkeypatch.setattr(runner, "free_port", lambda: next(picks))
    ports = [runner.child_env({}, threads=1)["MASTER_PORT"] for _ in range(3)]
    ports.append(runner.own_rendezvous({})["MASTER_PORT"])
    assert ports == ["40001", "40002", "40003", "40004"]


def test_free_port_can_be_bound():
    import socket

    from qerl_trl.study.runner import free_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))  # raises if the port it gave is taken


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_trls_or_given_twice(monkeypatch):
    """A learning run's OS-picked port was taken by another process's bind to port 0 before the run bound it (GPU
    suite at 177e135): ports come from below the ephemeral range, where no bind to port 0 lands."""
    import random

    from qerl_trl.study import runner

    monkeypatch.setattr(runner, "ephemeral_ports", lambda: (32768, 60999))
    monkeypatch.setattr(runner, "_handed_out", set())
    rng = random.Random(0)
    ports = [runner.free_port(rng) for _ in range(300)]
    assert all(runner.LOWEST_PORT <= p < 32768 for p in ports)
    assert len(set(ports)) == len(ports)  # never the same port twice in one process
    assert not set(ports) & runner.TRL_PORTS


def test_free_port_skips_ports_in_use_and_trls(monkeypatch):
    import socket

    from qerl_trl.study import runner

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    busy = held.getsockname()[1]
    try:
        wanted = iter([29500, busy, 24001])  # TRL's first pick, a port someone listens on, then a free one

        class Picks:
            def randrange(self, low, high):
                return next(wanted)

        monkeypatch.setattr(runner, "ephemeral_ports", lambda: (32768, 60999))
        monkeypatch.setattr(runner, "_handed_out", set())
        if not runner.port_is_free(24001):
            pytest.skip("port 24001 is in use on this machine")
        assert runner.free_port(Picks()) == 24001
    finally:
        held.close()


def test_free_port_falls_back_to_the_os_where_the_range_leaves_no_room(monkeypatch):
    from qerl_trl.study import runner

    monkeypatch.setattr(runner, "ephemeral_ports", lambda: (runner.LOWEST_PORT + 10, 60999))
    assert runner.port_is_free(runner.free_port())


def test_the_launcher_port_of_the_benchmarks_is_the_same_pick():
    from benchmarks import _child
    from qerl_trl.study import runner

    assert _child.free_port is runner.free_port


def _write_runs(work, arms, seeds, steps=4):
    (work / "runs").mkdir(parents=True)
    for arm in arms:
        for seed in seeds:
            lines = [{"event": "start", "run": {"arm": arm, "seed": seed}}, {"event": "eval", "step": 0, "accuracy": 0.1}]
            for k in range(1, steps + 1):
                lines.append({"event": "step", "step": k, "wall_s": k * 1.0, "reward": 0.1 * k, "entropy": 1.0 / k,
                              "aqn_sigma": 0.0, "prompts_sha": f"{seed}-{k}"})  # fmt: skip
            lines += [{"event": "eval", "step": steps, "accuracy": 0.5}, {"event": "end", "status": "ok"}]
            (work / "runs" / f"{arm}-lr0.0005-s{seed}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_benchmark_report_marks_invalid_runs_and_keeps_the_gpu_provenance(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from benchmarks import learning as bench

    work = tmp_path / "runs-from-gpu"
    _write_runs(work, ARMS, [0, 1])
    source = tmp_path / "learning-h100.json"
    source.write_text(json.dumps({"benchmark": "learning", "gpu": "NVIDIA H100 80GB HBM3", "versions": {"vllm": "0.24.0"},
                                  "commit": "a" * 40, "command": "python benchmarks/learning.py --parallel 9", "rows": []}))
    out = tmp_path / "results"
    path = bench.main([
        "--output_dir", str(work), "--seeds", "0", "1", "--max_steps", "4", "--report_only", "--results_dir", str(out),
        "--envelope_from", str(source), "--invalid", "nvfp4_lora_aqn=engine served the wrong kernels",
    ])  # fmt: skip
    assert path == str(out / "learning-h100.json")
    env = json.loads((out / "learning-h100.json").read_text())
    assert {"benchmark", "gpu", "versions", "commit", "command", "rows"} <= set(env)
    assert env["gpu"] == "NVIDIA H100 80GB HBM3" and env["commit"] == "a" * 40 and "--report_only" in env["report"]["command"]
    status = {r["name"]: (r["status"], r.get("error")) for r in env["rows"]}
    assert status["nvfp4_lora_aqn-lr0.0005-s1"] == ("invalid", "engine served the wrong kernels")
    assert status["bf16_lora-lr0.0005-s0"] == ("ok", None)
    block = env["summary"]["0.0005"]
    assert block["arms"]["nvfp4_lora_aqn"]["seeds"] == [] and block["arms"]["nvfp4_lora"]["seeds"] == [0, 1]
    assert (out / "learning-h100.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        bench.main(["--output_dir", str(work), "--report_only", "--results_dir", str(out), "--invalid", "nope=x"])


@pytest.mark.slow
def test_compare_runs_on_a_users_dataset_file_with_chat_prompts(tmp_path):
    from test_examples import gsm8k_rows, tiny_checkpoint

    from qerl_trl.study.runner import build_datasets, run_comparison

    rows = gsm8k_rows(12)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    cfg = LearningConfig(
        model=str(tiny_checkpoint(tmp_path / "tiny")), dataset_name=str(tmp_path),  # a folder of train/test files
        train_split="train", eval_split="test", prompt_column="question",
        answer_column="answer", chat_prompts=True, reward="gsm8k_accuracy_reward", arms=["bf16_lora", "nvfp4_lora"],
        seeds=[0], use_vllm=False, max_steps=2, prompts_per_step=2, num_generations=2, eval_every=1, lora_r=8,
        lora_alpha=16, output_dir=str(tmp_path / "cmp"),
    )  # fmt: skip
    train, held = build_datasets(cfg, seed=0)
    assert len(train) == 8 and len(held) == 4
    assert train[0]["prompt"] == [{"role": "user", "content": rows[0]["question"]}] and train[0]["answer"] == rows[0]["answer"]
    runs = run_comparison(cfg)["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok"] and all(r["evals"]["step"] == [0, 1, 2] for r in runs)


def test_each_run_of_a_wave_gets_a_rendezvous_port_of_its_own(tmp_path, monkeypatch):
    """The runs of a wave start side by side on one GPU, each a world of one binding MASTER_PORT: one port for the
    wave failed its second run with EADDRINUSE (the GPU suite's learning part at a05a113)."""
    import subprocess

    from qerl_trl.study import runner
    from qerl_trl.study.spec import RunSpec

    ports = iter(range(41001, 41010))
    monkeypatch.setattr(runner, "free_port", lambda: next(ports))
    envs = []

    class Done:
        returncode = 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", lambda cmd, env, **kw: envs.append(env) or Done())
    (tmp_path / "runs").mkdir()
    runs = [RunSpec(arm, 0, 1e-5, "bf16", "nvfp4") for arm in ("bf16_lora", "qerl")]
    runner._run_wave(LearningConfig(output_dir=str(tmp_path)), tmp_path, runs, 0)
    assert [e["MASTER_PORT"] for e in envs] == ["41001", "41002"]
