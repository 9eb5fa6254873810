"""Data parallelism on CPU (gloo, 2 ranks, transformers generation): what must agree across ranks does, a resumed
run continues exactly where it stopped, and the NVFP4 checkpoint vLLM would serve is written once, not raced.

The job is ``tests/ddp_job.py``; ``tests/test_multi_gpu.py`` runs the same job on 2 GPUs with vLLM colocate.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks._child import ChildResult, accelerate_launch, run_child

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("ddp_job.py")


def run_job(out: Path, *args: str, nproc: int = 2, timeout: float = 600, cpu: bool = True,
            launcher: tuple[str, ...] = ()) -> ChildResult:  # fmt: skip
    """Run the job with ``accelerate launch`` and the examples' DDP config (plus ``launcher`` options), as users
    launch the GRPO example, on ``nproc`` ranks (CPU ones, gloo, unless ``cpu=False``). Its output goes to
    ``out/launch.log``: a file, so a run cut off by its call's time limit keeps it."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = accelerate_launch(str(JOB), ["--out", str(out), *args], nproc, launcher)
    res = run_child(cmd, timeout, log_path=str(out / "launch.log"), env=env)
    if res.timed_out:
        pytest.fail(f"the {nproc}-rank job did not finish in {timeout} s:\n{res.log[-6000:]}")
    return res


def launch(out: Path, *args: str, nproc: int = 2, timeout: float = 600, cpu: bool = True) -> dict[int, list[dict]]:
    """:func:`run_job`, which must succeed; return each rank's records."""
    res = run_job(out, *args, nproc=nproc, timeout=timeout, cpu=cpu)
    assert res.returncode == 0, res.log
    return {r: [json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(nproc)}


def refused_under_fsdp(out: Path, model: str, cpu: bool) -> None:
    """``accelerate launch --use_fsdp``: the job stops at the config, with the message naming DDP, before any weight
    loads (no rank writes a record)."""
    res = run_job(out, "--model", model, nproc=2, timeout=300, cpu=cpu, launcher=("--use_fsdp",))
    assert res.returncode != 0, res.log
    assert "QeRLGRPOTrainer does not train under FSDP" in res.log, res.log
    assert "accelerate launch --multi_gpu" in res.log, res.log
    assert not list(out.glob("rank*.jsonl"))


def by_event(records: list[dict], event: str) -> list[dict]:
    return [r for r in records if r["event"] == event]


def test_two_ranks_agree_on_aqn_and_lora_and_a_resumed_run_continues_exactly(tmp_path):
    from test_examples import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "tiny")
    first = launch(tmp_path / "run", "--model", str(model), "--max_steps", "4", "--save_steps", "2")
    aqn = {r: by_event(recs, "aqn") for r, recs in first.items()}
    lora = {r: by_event(recs, "lora") for r, recs in first.items()}
    assert aqn[0] == aqn[1], "AQN noise differs between ranks"
    assert [(a["step"], a["sigma"]) for a in aqn[0]] == [(0, 0.0), (1, 0.0), (2, 1e-2), (3, 1e-2)]
    assert aqn[0][0]["sha"] == aqn[0][1]["sha"] != aqn[0][2]["sha"] != aqn[0][3]["sha"]  # fresh noise each round
    assert lora[0] == lora[1], "the LoRA differs between ranks after an optimizer step"
    assert len({x["sha"] for x in lora[0]}) == 4  # it trained
    assert (tmp_path / "run" / "trainer" / "checkpoint-2").is_dir()

    resumed = launch(tmp_path / "resumed", "--model", str(model), "--max_steps", "4", "--save_steps", "2",
                     "--resume", str(tmp_path / "run" / "trainer" / "checkpoint-2"))  # fmt: skip
    for r in (0, 1):
        assert by_event(resumed[r], "aqn") == aqn[r][2:]  # the schedule and the noise continue from step 2
        assert by_event(resumed[r], "lora") == lora[r][2:]  # and so does training, bit for bit
        assert by_event(resumed[r], "done") == [{"event": "done", "global_step": 4, "max_steps": 4}]


def test_vllm_checkpoint_cache_is_written_once_when_two_ranks_start_on_an_empty_cache(tmp_path):
    from test_examples import tiny_checkpoint

    model = tiny_checkpoint(tmp_path / "tiny")
    cache = tmp_path / "cache"
    recs = launch(tmp_path / "run", "--model", str(model), "--cache_only", "--cache_dir", str(cache))
    rows = [recs[r][0] for r in (0, 1)]
    assert rows[0]["path"] == rows[1]["path"] and sorted(r["written"] for r in rows) == [False, True]
    assert [p.name for p in cache.iterdir()] == [Path(rows[0]["path"]).name]  # no temporary dir left behind
    assert (Path(rows[0]["path"]) / "config.json").is_file()


def test_fsdp_is_refused_under_accelerate_launch_before_any_weight_loads(tmp_path):
    from test_examples import tiny_checkpoint

    refused_under_fsdp(tmp_path / "fsdp", str(tiny_checkpoint(tmp_path / "tiny")), cpu=True)


def test_job_options_go_over_the_jobs_config_and_a_bad_one_stops_it_before_loading(tmp_path):
    """QERL_JOB_CONFIG (``scripts/gpu_suite.py``'s way to run the multi-GPU and server jobs with an option on): its
    fields go over the job's own; text that is not an object of config fields stops the job with what to give."""
    import subprocess
    import sys

    sys.path.insert(0, str(JOB.parent))
    from ddp_job import job_overrides

    from qerl_trl import QeRLGRPOConfig

    assert job_overrides(None, QeRLGRPOConfig) == {} == job_overrides("", QeRLGRPOConfig)
    assert job_overrides('{"fused_importance_sampling": true, "vllm_lora_expand_in_gemm": true}', QeRLGRPOConfig) == {
        "fused_importance_sampling": True, "vllm_lora_expand_in_gemm": True}
    for text, says in [("{fused: 1}", "is not JSON"), ("[1]", "must be a JSON object"),
                       ('{"fused_is": true}', "names no QeRLGRPOConfig field: fused_is")]:  # fmt: skip
        with pytest.raises(SystemExit, match=says):
            job_overrides(text, QeRLGRPOConfig)
    # the job reads it: an unknown field stops it at the config, before any model is read (this one does not exist)
    res = subprocess.run([sys.executable, str(JOB), "--model", str(tmp_path / "absent"), "--out", str(tmp_path)],
                         env={**os.environ, "QERL_JOB_CONFIG": '{"fused_is": true}', "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode != 0 and "names no QeRLGRPOConfig field: fused_is" in res.stderr, res.stderr[-3000:]
    assert not list(tmp_path.glob("rank*.jsonl"))
