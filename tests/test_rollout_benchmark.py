"""CPU checks of ``benchmarks/rollout.py`` (the engines themselves run on the GPU machine): the random adapter is a
valid PEFT LoRA on every linear of the model, speed-ups are against merged BF16 at the same size and batch, and the
32B BF16 arm is served from vLLM's dummy loader, and a call with ``--deadline`` ends with a row per arm."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import rollout  # noqa: E402


def test_random_adapter_loads_into_the_model_with_every_linear_targeted(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from conftest import tiny_model

    model = tiny_model("qwen2", dtype=torch.float32)
    path = rollout.write_random_adapter(str(tmp_path / "adapter"), model.config, r=8)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * model.config.num_hidden_layers
    peft_model = PeftModel.from_pretrained(model, path)
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert torch.equal(loaded[name.replace(".weight", ".default.weight")].float(), saved[name].float())
    assert saved[name].abs().max() > 0  # B non-zero: vLLM really applies the adapter


def test_speedups_are_against_merged_bf16_at_the_same_size_batch_and_run():
    rows = [
        dict(size="7b", arm="bf16_merged", batch=8, tokens_per_s=100.0, status="ok", run="r1"),
        dict(size="7b", arm="nvfp4", batch=8, tokens_per_s=150.0, status="ok", run="r1"),
        dict(size="7b", arm="nvfp4_vllm_lora", batch=8, tokens_per_s=120.0, status="ok", run="r1"),
        dict(size="7b", arm="nvfp4_vllm_lora", batch=64, tokens_per_s=500.0, status="ok", run="r1"),
        dict(size="32b", arm="bf16_merged", batch=8, status="not_run: disk", run="r1"),
        # another lease, then rows of no run, which compare with nothing
        dict(size="7b", arm="nvfp4_qerl_lora", batch=8, tokens_per_s=130.0, status="ok", run="r2"),
        dict(size="7b", arm="bf16_merged", batch=1, tokens_per_s=10.0, status="ok"),
        dict(size="7b", arm="nvfp4", batch=1, tokens_per_s=20.0, status="ok"),
    ]
    rollout.add_speedups(rows)
    assert [r["vs_bf16_merged"] for r in rows] == [1.0, 1.5, 1.2, None, None, None, 1.0, None]
    assert rows[2]["lora_overhead_vs_nvfp4"] == 0.25 and rows[3]["lora_overhead_vs_nvfp4"] is None
    assert rows[5]["lora_overhead_vs_nvfp4"] is None


def test_merge_replaces_rows_and_keeps_each_rows_commit(tmp_path):
    import json

    def result(path, commit, rows):
        path.write_text(json.dumps({"benchmark": "rollout", "gpu": "NVIDIA H100 80GB HBM3", "versions": {},
                                    "commit": commit, "command": f"python benchmarks/rollout.py # {commit}",
                                    "rows": rows}))
        return str(path)

    row = dict(size="7b", batch=8, status="ok")
    old = result(tmp_path / "rollout-h100.json", "aaa", [dict(row, arm="bf16_merged", tokens_per_s=100.0),
                                                         dict(row, size="14b", arm="nvfp4", tokens_per_s=50.0)])
    (tmp_path / "new").mkdir()
    new = result(tmp_path / "new" / "rollout-h100.json", "bbb", [dict(row, arm="bf16_merged", tokens_per_s=110.0, commit="bbb", run="r"),
                         dict(row, arm="nvfp4", tokens_per_s=220.0, commit="bbb", run="r")])
    path = rollout.merge([old, new], str(tmp_path / "out"))
    env = json.loads(open(path).read())
    assert path.endswith("rollout-h100.json") and env["commit"] == "aaa, bbb"
    got = {(r["size"], r["arm"]): r for r in env["rows"]}
    assert got[("7b", "bf16_merged")]["tokens_per_s"] == 110.0 and got[("14b", "nvfp4")]["commit"] == "aaa"
    assert got[("7b", "nvfp4")]["vs_bf16_merged"] == 2.0 and got[("14b", "nvfp4")]["vs_bf16_merged"] is None
    assert "# aaa" in env["command"] and "# bbb" in env["command"]


def test_merge_keeps_both_runs_of_a_size_split_over_two_calls(tmp_path):
    """A size's arms in two calls at one commit, each with its merged-BF16 baseline: both baselines stay, each arm's
    ratio is against its own call's. A later commit's baseline does not take them away while their runs have other
    rows: each run stays a whole comparison."""
    import json

    def result(name, commit, run, rows):
        path = tmp_path / name / "rollout-h100.json"
        path.parent.mkdir()
        rows = [dict(r, size="14b", batch=1, status="ok", commit=commit, run=run) for r in rows]
        path.write_text(json.dumps({"benchmark": "rollout", "gpu": "H100", "versions": {}, "commit": commit,
                                    "command": "c", "rows": rows}))
        return str(path)

    first = result("a", "ccc", "r1", [dict(arm="bf16_merged", tokens_per_s=100.0),
                                      dict(arm="nvfp4_qerl_lora", tokens_per_s=130.0)])
    second = result("b", "ccc", "r2", [dict(arm="bf16_merged", tokens_per_s=90.0),
                                       dict(arm="nvfp4_vllm_lora", tokens_per_s=99.0)])
    env = json.loads(open(rollout.merge([first, second], str(tmp_path / "out"))).read())
    got = {(r["arm"], r["run"]): r["vs_bf16_merged"] for r in env["rows"]}
    assert got == {("bf16_merged", "r1"): 1.0, ("nvfp4_qerl_lora", "r1"): 1.3, ("bf16_merged", "r2"): 1.0,
                   ("nvfp4_vllm_lora", "r2"): 1.1}
    later = result("c", "ddd", "r3", [dict(arm="bf16_merged", tokens_per_s=80.0)])
    env = json.loads(open(rollout.merge([first, second, later], str(tmp_path / "out2"))).read())
    got = {(r["arm"], r["run"]): r["vs_bf16_merged"] for r in env["rows"]}
    assert got == {("bf16_merged", "r1"): 1.0, ("nvfp4_qerl_lora", "r1"): 1.3, ("bf16_merged", "r2"): 1.0,
                   ("nvfp4_vllm_lora", "r2"): 1.1, ("bf16_merged", "r3"): 1.0}
    # a later run of every arm replaces the older ones, baselines with them; a timeout keeps the measured row
    last = result("d", "eee", "r4", [dict(arm="bf16_merged", tokens_per_s=70.0),
                                     dict(arm="nvfp4_qerl_lora", tokens_per_s=77.0),
                                     dict(arm="nvfp4_vllm_lora", tokens_per_s=0.0)])
    rows = json.loads(open(last).read())["rows"]
    rows[2]["status"] = "timeout after 60 s"
    open(last, "w").write(json.dumps({"benchmark": "rollout", "gpu": "H100", "versions": {}, "commit": "eee",
                                      "command": "c", "rows": rows}))
    env = json.loads(open(rollout.merge([first, second, last], str(tmp_path / "out3"))).read())
    assert sorted((r["arm"], r["run"]) for r in env["rows"]) == [
        ("bf16_merged", "r2"), ("bf16_merged", "r4"), ("nvfp4_qerl_lora", "r4"), ("nvfp4_vllm_lora", "r2"),
        ("nvfp4_vllm_lora", "r4")]


def test_32b_bf16_is_served_from_vllms_dummy_loader(tmp_path):
    """No 32B BF16 checkpoint fits the GPU machine's disk: the merged-BF16 arm gets a config-only directory (with the
    tokenizer) and load_format="dummy"; 7B and the NVFP4 arms read the checkpoints prepare_checkpoints writes."""
    from transformers import AutoConfig, AutoTokenizer

    model, kwargs, weights = rollout.engine_source(rollout.EngineSpec("32b", "bf16_merged", (1,)), str(tmp_path))
    assert kwargs == {"load_format": "dummy", "gpu_memory_utilization": rollout.DUMMY_BF16_GPU_MEMORY_UTILIZATION}
    assert "dummy" in weights and not any(f.endswith(".safetensors") for f in os.listdir(model))
    config = AutoConfig.from_pretrained(model)
    assert (config.hidden_size, config.num_hidden_layers, str(config.dtype)) == (5120, 64, "torch.bfloat16")
    assert len(AutoTokenizer.from_pretrained(model)("hello world")["input_ids"]) > 0
    for size, arm, want in (("7b", "bf16_merged", "7b-bf16"), ("32b", "nvfp4_qerl_lora", "32b-nvfp4")):
        model, kwargs, _ = rollout.engine_source(rollout.EngineSpec(size, arm, (1,)), str(tmp_path))
        assert model == os.path.join(str(tmp_path), want) and kwargs == {}


def test_kv_cache_capacity_is_read_where_vllm_keeps_it():
    from types import SimpleNamespace as NS

    llm = NS(llm_engine=NS(vllm_config=NS(cache_config=NS(num_gpu_blocks=100, block_size=16))))
    assert rollout.kv_cache_tokens(llm) == 1600
    assert rollout.kv_cache_tokens(NS()) is None


def test_engine_timeout_is_cut_to_the_deadline_and_refuses_a_late_start():
    assert rollout.engine_timeout(900.0, None, 500.0) == 900.0
    assert rollout.engine_timeout(240.0, 580.0, 100.0) == 240.0
    assert rollout.engine_timeout(240.0, 580.0, 400.0) == 580.0 - 400.0 - rollout.DEADLINE_MARGIN_S
    assert rollout.engine_timeout(240.0, 580.0, 580.0 - rollout.DEADLINE_MARGIN_S - 59.0) is None


def test_a_call_with_a_deadline_leaves_a_row_per_arm_with_the_engines_log(tmp_path, monkeypatch):
    """Three arms against a 400 s deadline: the first engine finishes (100 s), the second runs into its cut-down
    timeout (its rows keep the log's tail), the third cannot start in time and is recorded as not run."""
    import json

    from benchmarks import e2e_step

    clock = [0.0]
    monkeypatch.setattr(rollout.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(e2e_step, "prepare_checkpoints", lambda *a, **k: None)
    timeouts = []
    from benchmarks import _child

    def fake_run_child(cmd, timeout, log_path=None, env=None):
        spec = json.loads(cmd[cmd.index("--child") + 1])
        log = f"loading {spec['arm']}\nCapturing CUDA graphs 40%\n"
        timeouts.append(timeout)
        if spec["arm"] == "bf16_merged":
            clock[0] += 100.0
            rows = [dict(size=spec["size"], arm=spec["arm"], batch=b, status="ok", tokens_per_s=10.0)
                    for b in spec["batches"]]  # fmt: skip
            with open(cmd[cmd.index("--rows-out") + 1], "w") as f:
                json.dump(rows, f)
            return _child.ChildResult(0, False, timeout, log, 100.0)
        clock[0] += timeout
        return _child.ChildResult(None, True, timeout, log, timeout)

    monkeypatch.setattr(_child, "run_child", fake_run_child)
    path = rollout.main(["--sizes", "7b", "--arms", "bf16_merged", "nvfp4", "nvfp4_qerl_lora", "--batches", "1", "16",
                         "--timeout", "600", "--deadline", "400", "--work", str(tmp_path), "--out-dir",
                         str(tmp_path / "out")])  # fmt: skip
    rows = json.load(open(path))["rows"]
    by_arm = {r["arm"]: r for r in rows if r["batch"] == 16}
    assert len(rows) == 6 and {r["run"] for r in rows} == {rows[0]["run"]}
    assert by_arm["bf16_merged"]["status"] == "ok"
    assert timeouts == [400.0 - rollout.DEADLINE_MARGIN_S, 400.0 - 100.0 - rollout.DEADLINE_MARGIN_S]
    assert by_arm["nvfp4"]["status"] == "timeout after 285 s"
    assert "Capturing CUDA graphs 40%" in by_arm["nvfp4"]["log_tail"]
    assert by_arm["nvfp4_qerl_lora"]["status"].startswith("not_run: 15 s were left of --deadline 400 s")


def test_arms_name_their_fp4_kernel_and_the_lora_overhead_is_against_the_same_kernel():
    import pytest

    assert rollout.parse_arm("nvfp4_qerl_lora@humming") == ("nvfp4_qerl_lora", "humming")
    assert rollout.parse_arm("nvfp4") == ("nvfp4", "marlin") and rollout.parse_arm("bf16_merged") == ("bf16_merged", None)
    assert rollout.parse_arm("nvfp4_qerl_lora_expand@humming") == ("nvfp4_qerl_lora_expand", "humming")
    for bad in ("nvfp4@cutlass", "bf16_merged@humming", "fp8", "nvfp4_qerl_lora_expand", "nvfp4_qerl_lora_expand@marlin"):
        with pytest.raises(ValueError):
            rollout.parse_arm(bad)
    rows = [dict(size="7b", arm="bf16_merged", batch=64, tokens_per_s=100.0, status="ok", run="r"),
            dict(size="7b", arm="nvfp4", kernel="marlin", batch=64, tokens_per_s=100.0, status="ok", run="r"),
            dict(size="7b", arm="nvfp4", kernel="humming", batch=64, tokens_per_s=130.0, status="ok", run="r"),
            dict(size="7b", arm="nvfp4_qerl_lora", kernel="humming", batch=64, tokens_per_s=104.0, status="ok", run="r"),
            dict(size="7b", arm="nvfp4_qerl_lora", batch=64, tokens_per_s=80.0, status="ok", run="r")]  # Marlin, older
    rollout.add_speedups(rows)
    assert rows[3]["lora_overhead_vs_nvfp4"] == 0.25 and rows[4]["lora_overhead_vs_nvfp4"] == 0.25
    assert rows[2]["vs_bf16_merged"] == 1.3


def test_a_child_past_its_limit_is_killed_with_its_process_group_and_its_log_kept(tmp_path):
    """``benchmarks._child.run_child``, which runs every arm of rollout.py, e2e_step.py and multi_gpu.py: a child that
    outlives its limit is killed with the process it started (a vLLM engine would keep the GPU), and its output's
    tail and a status come back; a child that ends keeps its exit code."""
    import sys
    import time

    from benchmarks._child import run_child

    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('Capturing CUDA graphs 40%', flush=True); "
              "time.sleep(60)")
    t0 = time.monotonic()
    res = run_child([sys.executable, "-c", script], timeout=3, log_path=str(tmp_path / "child.log"))
    assert time.monotonic() - t0 < 30 and res.timed_out and res.returncode is None
    assert res.status == "timeout after 3 s" and "Capturing CUDA graphs 40%" in res.log
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    try:
        os.kill(grandchild, 0)
        with open(f"/proc/{grandchild}/stat") as f:
            alive = f.read().split()[2] != "Z"  # a zombie waiting for init is dead
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive, "the engine-like grandchild outlived the killed arm"
    oom = run_child([sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"], timeout=30)
    assert not oom.timed_out and oom.returncode == 3 and oom.status == "oom: failed: exit code 3"


def test_a_benchmark_stopped_by_sigterm_takes_its_running_child_with_it(tmp_path):
    """A device call's ``timeout`` sends SIGTERM to a benchmark script, whose arm runs in a child leading its own
    session (a vLLM engine): the device ends a finished call's processes but not another session's, so without
    this the engine would hold the GPU into the next call. ``run_child`` turns the SIGTERM into an interrupt, kills
    the child's group and the script exits."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"import sys; sys.path.insert(0, {repo!r}); from benchmarks._child import run_child; "
              f"run_child(['sh', '-c', 'echo $$ > {pid_file}; sleep 300'], timeout=120)")
    bench = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    time.sleep(1.0)  # run_child is waiting on its child by now (a signal while it starts one is not covered)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) != 0
    time.sleep(0.5)
    try:
        os.kill(child, 0)
        with open(f"/proc/{child}/stat") as f:
            alive = f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive, "the arm's child outlived the stopped benchmark"


def test_a_batch_is_timed_over_repeats_and_reported_as_the_median_call():
    """``--repeats``: every call of a batch is timed between device syncs; the row is the median call, with the
    fastest and slowest calls' tokens/s (issue #55: a ratio comes from 5 or more measured calls)."""
    import types

    from benchmarks import rollout

    events, walls = [], iter([0.4, 0.1, 0.3, 0.2, 0.5])

    def generate():
        events.append("generate")
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * 8)])] * 4

    tokens, timed = rollout.timed_generates(generate, 5, lambda: events.append("sync"))
    assert tokens == [32] * 5 and len(timed) == 5 and events == ["sync", "generate", "sync"] * 5
    row = rollout.repeat_summary([32] * 5, [next(walls) for _ in range(5)])
    assert row["repeats"] == 5 and row["wall_s"] == 0.3 and row["tokens_per_s"] == round(32 / 0.3, 1)
    assert row["tokens_per_s_min"] == round(32 / 0.5, 1) and row["tokens_per_s_max"] == 320.0
    assert row["wall_s_per_call"] == [0.4, 0.1, 0.3, 0.2, 0.5]


def test_the_moe_size_runs_merged_bf16_from_dummy_weights_and_refuses_whole_model_humming(tmp_path, capsys):
    """Qwen3-30B-A3B (issue #54): 61 GB in BF16, so the merged-BF16 arm is vLLM's dummy loader on the MoE config.
    vLLM 0.24's Humming MoE method cannot load NVFP4A16 experts (failed rows at 517d8d7), so the arms that serve the
    whole model with quantization='humming' are refused before anything is written; the LoRA arms' adapters cover
    the attention, as the trainer's do."""
    from transformers import AutoConfig

    model, kwargs, weights = rollout.engine_source(rollout.EngineSpec("30b-a3b", "bf16_merged", (1,)), str(tmp_path))
    assert kwargs["load_format"] == "dummy" and "dummy" in weights
    config = AutoConfig.from_pretrained(model)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 128, 8)
    for argv, said in ((["--sizes", "30b-a3b", "--arms", "bf16_merged", "nvfp4@humming"], "Humming MoE method"),
                       (["--sizes", "30b-a3b", "--arms", "nvfp4_vllm_lora@humming"], "nvfp4_qerl_lora@humming"),
                       (["--sizes", "70b", "--arms", "nvfp4"], "unknown --sizes")):
        with pytest.raises(SystemExit):
            rollout.main([*argv, "--work", str(tmp_path / "w")])
        assert said in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "w")
    assert rollout.lora_targets(config) == ("q_proj", "k_proj", "v_proj", "o_proj")
    small = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                 num_experts=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=2)  # fmt: skip
    lora = rollout.random_lora(small, 4)
    assert len(lora) == 2 * 4 and all(".self_attn." in k for k in lora)
    assert lora["model.layers.1.self_attn.o_proj"][1].shape == (64, 4)
    rollout.write_random_adapter(str(tmp_path / "adapter"), small, 4)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert sorted(json.load(f)["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert rollout.lora_targets(AutoConfig.for_model("qwen2")) == rollout.LORA_TARGETS


def test_expert_kernels_name_each_fused_moe_method_and_its_experts_class():
    import torch

    class MarlinExperts:
        pass

    class CompressedTensorsW4A4Nvfp4MoEMethod:
        experts_cls = MarlinExperts

    class HummingMoEMethod:
        pass

    def moe(method):
        layer = torch.nn.Module()
        layer.moe_config, layer.quant_method = object(), method
        return layer

    class FusedMoEModularMethod:  # vLLM's LoRA wraps the layer's method (vLLM 0.24)
        def __init__(self, old):
            self.old_quant_method = old

    def with_lora(method):  # FusedMoEWithLoRA: its quant_method is its base layer's, which it holds
        wrapper = moe(method)
        wrapper.base_layer = moe(method)
        return wrapper

    model = torch.nn.ModuleList([moe(CompressedTensorsW4A4Nvfp4MoEMethod()), moe(CompressedTensorsW4A4Nvfp4MoEMethod()),
                                 moe(HummingMoEMethod()), torch.nn.Linear(2, 2)])  # fmt: skip
    assert rollout.expert_kernels_of(model) == {"CompressedTensorsW4A4Nvfp4MoEMethod (MarlinExperts)": 2,
                                                "HummingMoEMethod": 1}  # fmt: skip
    lora = torch.nn.ModuleList([with_lora(FusedMoEModularMethod(CompressedTensorsW4A4Nvfp4MoEMethod()))
                                for _ in range(3)])  # fmt: skip
    # seen on an H100 at 67aeaf2: {'FusedMoEModularMethod': 16} for 8 layers
    assert rollout.expert_kernels_of(lora) == {
        "FusedMoEModularMethod(CompressedTensorsW4A4Nvfp4MoEMethod (MarlinExperts))": 3}
    assert rollout.expert_kernels_of(torch.nn.Linear(2, 2)) == {}
