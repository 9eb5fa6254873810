"""Server mode on CPU (issue #39): the ``qerl-trl vllm-serve`` command asks vLLM for what the trainer needs, the round
file carries the LoRA and the norms, and the trainer's check refuses a server that cannot serve its policy, naming
the fix. A stand-in HTTP server answers vLLM 0.24's endpoints with what its workers would report; the real server
runs in ``tests/test_server_mode_gpu.py``."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from qerl_trl.trainer.vllm_serving.server_command import (
    POLICY_LORA_NAME,
    ServerRequirements,
    vllm_serve_command,
)
from qerl_trl.trainer.vllm_serving.server_sync import ServerSetupError, ServerSync
from qerl_trl.vllm_plugin.server_spec import SYNC_PROTOCOL, read_round, round_tensors, write_round
from test_examples import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(bf16_dir, nvfp4_dir)`` of a tiny Qwen2 (2 layers)."""
    from qerl_trl.quantizer import quantize_checkpoint

    root = tmp_path_factory.mktemp("server")
    bf16 = tiny_checkpoint(root / "bf16")
    nvfp4 = quantize_checkpoint(str(bf16), root / "nvfp4")
    return bf16, str(nvfp4)


@pytest.fixture(scope="module")
def policy(checkpoints):
    """The trainer's side: the NVFP4 model with a rank-8 LoRA on every linear, B made non-zero."""
    from peft import LoraConfig, get_peft_model

    from qerl_trl.quantizer import load_nvfp4

    model = get_peft_model(load_nvfp4(checkpoints[1], dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))  # fmt: skip
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return model


def _overrides(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--hf-overrides") + 1])


def test_the_serve_command_asks_vllm_for_what_the_trainer_needs(checkpoints, policy):
    from qerl_trl.aqn import find_noise_targets, vllm_param_name
    from qerl_trl.trainer.vllm_serving import peft_lora_modules

    argv, env, req = vllm_serve_command(checkpoints[1], lora_r=8, fp4_kernel="marlin", port=8123)
    # the requirements from the config alone equal what the trainer finds on its loaded model
    assert req.fp32_norms == tuple(sorted(vllm_param_name(t) for t in find_noise_targets(policy)))
    assert len(req.fp32_norms) == 4  # 2 layers x (input, post-attention) norms
    assert req.lora_targets == tuple(sorted({n.rsplit(".", 1)[-1] for n in peft_lora_modules(policy)[0]}))
    assert argv[1:5] == ["-m", "qerl_trl.vllm_plugin.serve_entry", "serve", checkpoints[1]]
    assert argv[argv.index("--quantization") + 1] == "qerl_nvfp4_lora" and "--port" in argv and "8123" in argv
    spec = _overrides(argv)["quantization_config"]["qerl_lora"]
    assert spec["rank"] == 8 and spec["target_modules"] == list(req.lora_targets) and spec["fp4_kernel"] == "marlin"
    assert _overrides(argv)["qerl_fp32_norms"] == list(req.fp32_norms)
    assert argv[argv.index("--worker-extension-cls") + 1] == "qerl_trl.vllm_plugin.server_worker.QeRLServerWorker"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert os.path.isdir(os.path.join(env["PYTHONPATH"].split(os.pathsep)[0], "qerl_trl"))

    argv, env, req = vllm_serve_command(checkpoints[1], lora_backend="vllm", lora_r=24, aqn=False,
                                        lora_target_modules=["q_proj", "v_proj"], fp4_kernel="marlin")  # fmt: skip
    assert req == ServerRequirements("vllm", 24, ("q_proj", "v_proj"), ())
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "32"  # 24 padded to vLLM's 32
    assert "--quantization" not in argv and "--hf-overrides" not in argv  # compressed-tensors, bf16 norms
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_a_16_bit_checkpoint_is_refused_with_the_quantize_command(checkpoints):
    with pytest.raises(ValueError, match=r"not an NVFP4A16 checkpoint.*qerl-trl quantize .* NVFP4_DIR"):
        vllm_serve_command(str(checkpoints[0]))


def test_the_cli_prints_the_command(checkpoints, capsys):
    from qerl_trl.cli import main

    assert main(["vllm-serve", checkpoints[1], "--lora-r", "8", "--fp4-kernel", "marlin", "--print-only",
                 "--max-num-seqs", "64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("VLLM_SERVER_DEV_MODE=1 ") and "serve_entry serve" in out and out.rstrip().endswith(
        "--max-num-seqs 64")  # an option vllm-serve does not know goes to `vllm serve`


def test_the_round_file_carries_the_lora_and_the_norms(tmp_path):
    lora = {"model.layers.0.self_attn.q_proj": (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(16, 4))}
    norms = {"model.layers.0.input_layernorm.weight": torch.randn(8)}
    tensors = round_tensors(lora, norms)
    write_round(str(tmp_path / "r.safetensors"), tensors, scaling=2.0, round_id="7-abc")
    got_lora, scaling, got_norms, round_id = read_round(str(tmp_path / "r.safetensors"))
    assert scaling == 2.0 and round_id == "7-abc" and list(os.listdir(tmp_path)) == ["r.safetensors"]
    a, b = got_lora["model.layers.0.self_attn.q_proj"]
    assert torch.equal(a, lora["model.layers.0.self_attn.q_proj"][0]) and torch.equal(b, lora[
        "model.layers.0.self_attn.q_proj"][1])  # fmt: skip
    assert torch.equal(got_norms["model.layers.0.input_layernorm.weight"], norms["model.layers.0.input_layernorm.weight"])
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"protocol": "0"})
    with pytest.raises(ValueError, match="same qerl-trl on the trainer and the server"):
        read_round(str(tmp_path / "old.safetensors"))


def test_a_round_lands_in_place_and_a_stray_lora_is_refused():
    from qerl_trl.vllm_plugin.server_worker import apply_round, base_checksum

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    norm = model[1].weight
    before = base_checksum(model, skip={"1.weight"})
    assert apply_round(model, {}, 1.0, {"1.weight": torch.full((4,), 3.0)}, in_layer_lora=False) == {
        "lora_layers": 0, "norms": 1}  # fmt: skip
    assert model[1].weight is norm and torch.equal(norm, torch.full((4,), 3.0))
    assert base_checksum(model, skip={"1.weight"}) == before  # the norms are not the base
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    assert base_checksum(model, skip={"1.weight"}) != before
    with pytest.raises(ValueError, match="vLLM adapter"):
        apply_round(model, {"0": (torch.zeros(1, 4), torch.zeros(4, 1))}, 1.0, {}, in_layer_lora=False)


# ----------------------------------------------------------------------------------- a stand-in vLLM server


class StandIn:
    """vLLM 0.24's endpoints as QeRL's server mode uses them, answered the way its workers would."""

    def __init__(self, described: list[dict], dev_mode: bool = True, extension: bool = True, stale: bool = False):
        self.described, self.dev_mode, self.extension, self.stale = described, dev_mode, extension, stale
        self.calls: list[tuple[str, dict]] = []
        self.adapters: dict[str, str] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    cards = [{"id": "base", "root": "base"}]
                    cards += [{"id": k, "root": v} for k, v in outer.adapters.items()]
                    return self._reply(200, {"data": cards})
                return self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.calls.append((self.path, body))
                if self.path == "/collective_rpc" and outer.dev_mode:
                    return self._rpc(body)
                if self.path == "/v1/load_lora_adapter":
                    files = sorted(os.listdir(body["lora_path"]))  # what vLLM reads at once
                    assert files == ["adapter_config.json", "adapter_model.safetensors"], files
                    if body["lora_name"] in outer.adapters and not body.get("load_inplace"):  # as vLLM 0.24 answers
                        return self._reply(400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has "
                                                           "already been loaded."}})  # fmt: skip
                    outer.adapters[body["lora_name"]] = body["lora_path"]
                    return self._reply(200, "Success")
                if self.path == "/v1/unload_lora_adapter":
                    del outer.adapters[body["lora_name"]]
                    return self._reply(200, "Success")
                return self._reply(404, {"detail": "Not Found"})

            def _rpc(self, body):
                method, args = body["method"], body["args"]
                if not outer.extension:
                    return self._reply(500, {"error": f"AttributeError: 'Worker' object has no attribute '{method}'"})
                if method == "qerl_describe":
                    return self._reply(200, {"results": [{**d, "can_read_probe": d.get("can_read_probe", True)
                                                          and os.path.isfile(args[0])} for d in outer.described]})
                if method == "qerl_load_round":
                    lora, _, norms, round_id = read_round(args[0])
                    return self._reply(200, {"results": [{"lora_layers": len(lora), "norms": len(norms),
                                                          "round": "0-old" if outer.stale else round_id}]
                                             * len(outer.described)})  # fmt: skip
                return self._reply(500, {"error": f"no method {method}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


REQ = ServerRequirements("qerl", 8, ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"),
                         ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"))


def _described(**changes) -> dict:
    d = {"protocol": SYNC_PROTOCOL, "in_layer_lora": {"rank": 8, "target_modules": list(REQ.lora_targets),
                                                      "fp4_kernel": "marlin"},
         "vllm_lora": None, "runtime_lora_updating": False, "fp32_norms": list(REQ.fp32_norms), "tp_rank": 0}  # fmt: skip
    return {**d, **changes}


@pytest.fixture
def stand_in():
    servers = []

    def make(*described, **kw):
        servers.append(StandIn(list(described), **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_a_server_that_serves_the_policy_passes_and_each_round_lands_and_is_read(stand_in, tmp_path, policy):
    from qerl_trl.trainer.vllm_serving import peft_lora_modules

    server = stand_in(_described(), _described(tp_rank=1))
    req = ServerRequirements("qerl", 8, REQ.lora_targets, REQ.fp32_norms)
    sync = ServerSync(server.url, req, str(tmp_path), "ckpt")
    sync.check()
    norms = {n: torch.randn(64) for n in REQ.fp32_norms}
    last = sync.sync(policy, norms)
    assert last["read_ok"] and last["lora_layers"] == [len(peft_lora_modules(policy)[0])] * 2
    assert last["norms"] == [2, 2] and os.listdir(tmp_path) == []  # the round file is removed after the load


def test_a_server_that_read_another_round_file_stops_the_sync(stand_in, tmp_path, policy):
    sync = ServerSync(stand_in(_described(), stale=True).url, ServerRequirements("qerl", 8, REQ.lora_targets, ()),
                      str(tmp_path), "c")  # fmt: skip
    with pytest.raises(RuntimeError, match="read another round file"):
        sync.sync(policy, None)


def test_the_vllm_backend_loads_each_round_as_the_servers_adapter(stand_in, tmp_path, policy):
    server = stand_in(_described(in_layer_lora=None, vllm_lora={"max_lora_rank": 8, "max_loras": 1},
                                 runtime_lora_updating=True))  # fmt: skip
    sync = ServerSync(server.url, ServerRequirements("vllm", 8, REQ.lora_targets, REQ.fp32_norms), str(tmp_path), "c")
    sync.check()
    first = sync.sync(policy, {n: torch.ones(64) for n in REQ.fp32_norms})
    assert first["adapter_root_ok"] and first["read_ok"] and first["norms"] == [2]
    first_name = sync.served_name
    assert first_name.startswith(f"{POLICY_LORA_NAME}-") and first_name.endswith("-1")
    assert list(server.adapters) == [first_name]
    assert sync.sync(policy, None)["adapter_root_ok"]
    # a new name each round, the previous one unloaded: load_inplace=True would make vLLM re-read the files on every
    # request, and its prefix cache is keyed on the name
    assert sync.served_name == first_name[:-1] + "2" and list(server.adapters) == [sync.served_name]
    loads = [b for p, b in server.calls if p == "/v1/load_lora_adapter"]
    assert [b["load_inplace"] for b in loads] == [False, False]
    # vLLM reads the files again when the adapter comes back into its cache: the served round's directory stays (the
    # server died at its next request when it was removed right after the load), the one before is removed
    assert os.listdir(tmp_path) == [os.path.basename(server.adapters[sync.served_name])]
    sync.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("described,expected", [
    (_described(in_layer_lora={"rank": 16, "target_modules": list(REQ.lora_targets), "fp4_kernel": "marlin"}),
     "its in-layer LoRA has rank 16, the trainer's has 8"),
    (_described(in_layer_lora={"rank": 8, "target_modules": ["q_proj"], "fp4_kernel": "marlin"}),
     "its in-layer LoRA targets ['q_proj']"),
    (_described(in_layer_lora=None), "does not serve QeRL's in-layer LoRA"),
    (_described(fp32_norms=[]), "2 of AQN's 2 norm weights are not float32"),
    (_described(can_read_probe=False), "cannot read files in vllm_lora_sync_dir"),
    (_described(protocol=SYNC_PROTOCOL + 1), "install the same qerl-trl version on both"),
])  # fmt: skip
def test_a_server_that_cannot_serve_the_policy_is_refused_with_what_to_change(stand_in, tmp_path, described, expected):
    server = stand_in(described)
    with pytest.raises(ServerSetupError) as e:
        ServerSync(server.url, REQ, str(tmp_path), "/ckpt").check()
    assert expected in str(e.value)
    assert "qerl-trl vllm-serve /ckpt --lora-backend qerl --lora-r 8 --lora-target-modules down_proj" in str(e.value)


def test_the_vllm_backend_needs_enable_lora_and_runtime_loading(stand_in, tmp_path):
    req = ServerRequirements("vllm", 64, REQ.lora_targets, ())
    with pytest.raises(ServerSetupError, match=r"(?s)needs --enable-lora.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.*--no-aqn"):
        ServerSync(stand_in(_described()).url, req, str(tmp_path), "c").check()
    low = _described(vllm_lora={"max_lora_rank": 32, "max_loras": 1}, runtime_lora_updating=True)
    with pytest.raises(ServerSetupError, match="max_lora_rank is 32, below the LoRA rank 64"):
        ServerSync(stand_in(low).url, req, str(tmp_path), "c").check()


def test_a_plain_vllm_server_is_refused_naming_dev_mode_or_the_worker_extension(stand_in, tmp_path):
    with pytest.raises(ServerSetupError, match="VLLM_SERVER_DEV_MODE=1"):
        ServerSync(stand_in(_described(), dev_mode=False).url, REQ, str(tmp_path), "c").check()
    with pytest.raises(ServerSetupError, match="no QeRL worker extension"):
        ServerSync(stand_in(_described(), extension=False).url, REQ, str(tmp_path), "c").check()
    assert os.listdir(tmp_path) == []  # the probe file is removed either way


# ------------------------------------------------------------------- inside the engine (vLLM 0.24's Python code)


@pytest.mark.vllm_on_cpu
def test_the_engine_casts_the_norms_its_config_lists_and_its_workers_describe_them(monkeypatch, tmp_path):
    """The hook the plugin installs in every vLLM process casts the norms ``hf_overrides`` listed, after the weights
    load; the worker extension reports them, vLLM's LoRA settings and whether it reads the trainer's directory.
    Runs where vLLM's Python code is installed (CI's vLLM-on-CPU phase); no kernel runs."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")

    from vllm.model_executor.model_loader import base_loader

    from qerl_trl.vllm_plugin import fp32_norms
    from qerl_trl.vllm_plugin.server_worker import QeRLServerWorker

    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(8, bias=False, dtype=torch.bfloat16)
    model.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", lambda self, vllm_config, model_config: model)
    monkeypatch.setattr(fp32_norms, "_HOOKED", False)
    fp32_norms.install_fp32_norm_hook()
    model_config = SimpleNamespace(hf_config=SimpleNamespace(qerl_fp32_norms=["norm.weight"]))
    assert base_loader.BaseModelLoader.load_model(None, None, model_config) is model
    assert model.norm.weight.dtype == torch.float32 and model.proj.weight.dtype == torch.bfloat16

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    class Worker(QeRLServerWorker):  # what vLLM mixes the extension into: the worker's config and model
        vllm_config = SimpleNamespace(model_config=model_config, quant_config=None,
                                      lora_config=SimpleNamespace(max_lora_rank=32, max_loras=1))  # fmt: skip
        rank = 0

        def get_model(self):
            return model

    probe = tmp_path / "probe"
    probe.write_text("")
    d = Worker().qerl_describe(str(probe))
    assert d["fp32_norms"] == ["norm.weight"] and d["in_layer_lora"] is None and d["can_read_probe"]
    assert d["vllm_lora"] == {"max_lora_rank": 32, "max_loras": 1} and d["runtime_lora_updating"] is True
    assert not Worker().qerl_describe(str(tmp_path / "missing"))["can_read_probe"]


def test_a_later_trainer_on_the_same_server_loads_its_adapters_and_drops_the_orphans(stand_in, tmp_path, policy):
    """A run resumed (or restarted) against a running server is a new trainer process whose rounds count from 1
    again: its adapters must not collide with the names the ended run left registered (vLLM 0.24 refuses a name it
    holds), and a registration whose directory is gone is unloaded (vLLM would die reading it)."""
    server = stand_in(_described(in_layer_lora=None, vllm_lora={"max_lora_rank": 8, "max_loras": 1},
                                 runtime_lora_updating=True))  # fmt: skip
    req = ServerRequirements("vllm", 8, REQ.lora_targets, ())
    ended = ServerSync(server.url, req, str(tmp_path), "c")
    ended.check()
    ended.sync(policy, None)
    ended.close()  # its directory gone, as remove_stale() leaves it once the process has exited
    later = ServerSync(server.url, req, str(tmp_path), "c")
    later.check()
    assert later.sync(policy, None)["adapter_root_ok"] and list(server.adapters) == [later.served_name]
    assert later.served_name != ended.served_name


def test_round_files_of_trainers_that_are_gone_are_removed_at_the_next_check(stand_in, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    (tmp_path / f"qerl-lora-{dead.pid}-3-abc").mkdir()
    (tmp_path / f"qerl-round-{dead.pid}.safetensors").write_bytes(b"")
    (tmp_path / f"qerl-lora-{os.getpid()}-1-xyz").mkdir()  # a live trainer's
    (tmp_path / "user-file").write_text("")
    ServerSync(stand_in(_described()).url, REQ, str(tmp_path), "c").check()
    assert sorted(os.listdir(tmp_path)) == [f"qerl-lora-{os.getpid()}-1-xyz", "user-file"]
