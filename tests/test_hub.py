"""Hub push of the NVFP4 base and the LoRA adapter, checked offline at the HTTP layer.

huggingface_hub's own HTTP client gets a mock transport (``set_client_factory``): every request our code makes
goes through the real ``HfApi`` (repo creation, preupload, commit) and is answered here, and the commit payload
is decoded to check the exact file set and file contents the Hub would receive. Nothing of ours is stubbed.
"""

from __future__ import annotations

import base64
import importlib
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

hub_http = pytest.importorskip("huggingface_hub.utils._http")


class FakeHub:
    """Answers the Hub endpoints a commit uses; records created repos and committed files."""

    def __init__(self):
        import huggingface_hub

        self.httpmod = importlib.import_module(type(huggingface_hub.get_session()).__module__.split(".")[0])
        self.repos: dict[str, dict] = {}
        self.commits: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self.validated: list[str] = []

    def __call__(self, request):
        R = self.httpmod.Response
        path = request.url.path
        self.requests.append((request.method, path))
        assert request.headers.get("authorization") == "Bearer hf_test_token", "token not sent"
        if path == "/api/repos/create":
            body = json.loads(request.content)
            name = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            self.repos[name] = body
            return R(200, json={"url": f"https://huggingface.co/{name}", "name": name})
        if path == "/api/validate-yaml":  # the Hub checks README metadata before a commit
            import yaml

            content = json.loads(request.content)["content"]
            self.validated.append(content)
            meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else None
            if not isinstance(meta, dict):
                return R(400, json={"errors": [{"message": "no YAML metadata"}]})
            return R(200, json={"warnings": []})
        if "/preupload/" in path:
            files = json.loads(request.content)["files"]
            return R(200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        if "/commit/" in path:
            repo = path.split("/api/models/")[1].split("/commit/")[0]
            files = {}
            for line in request.content.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            self.commits[repo] = files
            return R(200, json={"commitUrl": f"https://huggingface.co/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
        return R(404, json={"error": f"not mocked: {request.method} {path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    hub = FakeHub()
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.set_client_factory(
        lambda: hub.httpmod.Client(
            transport=hub.httpmod.MockTransport(hub),
            event_hooks={"request": [hub_http.hf_request_event_hook]},
            follow_redirects=True,
        )
    )
    yield hub
    huggingface_hub.set_client_factory(hub_http.default_client_factory)


def _write_tokenizer(folder: Path):
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (folder / "special_tokens_map.json").write_text("{}")


@pytest.fixture
def nvfp4_dir(tmp_path):
    """A small NVFP4A16 compressed-tensors checkpoint (packed tensors from qerl_trl.nvfp4) plus stray files."""
    from safetensors.torch import save_file

    from qerl_trl.nvfp4 import quantize

    model = tiny_model("qwen2")
    tensors, n = {}, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            q = quantize(mod.weight.data)
            tensors[f"{name}.weight_packed"] = q.weight_packed
            tensors[f"{name}.weight_scale"] = q.weight_scale
            tensors[f"{name}.weight_global_scale"] = q.weight_global_scale.reshape(1)
            n += 1
        elif isinstance(mod, (torch.nn.Embedding, torch.nn.Linear)):
            tensors[f"{name}.weight"] = mod.weight.data.contiguous()
    folder = tmp_path / "nvfp4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["_name_or_path"] = "Org/Tiny-Instruct"
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
        "ignore": ["lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text("{}")
    _write_tokenizer(folder)
    (folder / "optimizer.pt").write_bytes(b"x")  # must not be uploaded
    (folder / "checkpoint-5").mkdir()
    return folder, n


@pytest.fixture
def adapter_dir(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    folder = tmp_path / "out"
    model.save_pretrained(str(folder))
    _write_tokenizer(folder)
    log = [
        {"step": 1, "loss": 0.5, "reward": 0.25, "aqn/sigma": 0.0},
        {"step": 2, "loss": 0.4, "reward": 0.75, "aqn/sigma": 0.01, "entropy": 1.5},
    ]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": log, "global_step": 2}))
    (folder / "training_args.bin").write_bytes(b"pickle")  # must not be uploaded
    return folder


def test_push_base_file_set_and_card(fake_hub, nvfp4_dir):
    from huggingface_hub import ModelCard

    from qerl_trl.hub import push_base

    folder, n_quant = nvfp4_dir
    url = push_base(folder, "me/tiny-nvfp4", private=True)
    assert url.startswith("https://huggingface.co/me/tiny-nvfp4/commit/")
    body = fake_hub.repos["me/tiny-nvfp4"]
    assert body.get("private") is True or body.get("visibility") == "private", body
    files = fake_hub.commits["me/tiny-nvfp4"]
    assert set(files) == {
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert fake_hub.validated == [files["README.md"].decode()]
    card = ModelCard(files["README.md"].decode())
    meta = card.data.to_dict()
    assert meta["base_model"] == "Org/Tiny-Instruct"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "apache-2.0"
    assert {"qerl", "nvfp4", "trl", "grpo"} <= set(meta["tags"])
    assert "vllm serve me/tiny-nvfp4 --quantization compressed-tensors" in card.text
    assert f"{n_quant} Linear layers" in card.text
    assert "{{" not in card.text


def test_push_base_rejects_16bit_checkpoint(fake_hub, tmp_path):
    from qerl_trl.hub import push_base

    model = tiny_model("qwen2")
    model.save_pretrained(str(tmp_path / "bf16"))
    with pytest.raises(ValueError, match="qerl-trl quantize"):
        push_base(tmp_path / "bf16", "me/x")
    assert fake_hub.commits == {}


def test_push_adapter_file_set_and_card(fake_hub, adapter_dir):
    from huggingface_hub import ModelCard

    from qerl_trl.hub import push_adapter

    recipe = {"learning_rate": 1e-5, "loss_type": "dapo", "num_generations": 8}
    aqn = {"enabled": True, "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10}
    push_adapter(
        adapter_dir,
        "me/tiny-qerl-lora",
        base_repo_id="me/tiny-nvfp4",
        recipe=recipe,
        aqn=aqn,
        rewards=["gsm8k_accuracy_reward", "format_reward"],
    )
    files = fake_hub.commits["me/tiny-qerl-lora"]
    assert set(files) == {
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "qerl_recipe.yaml",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert files["adapter_model.safetensors"] == (adapter_dir / "adapter_model.safetensors").read_bytes()
    acfg = json.loads(files["adapter_config.json"])
    assert acfg["base_model_name_or_path"] == "me/tiny-nvfp4" and acfg["r"] == 8
    import yaml

    assert yaml.safe_load(files["qerl_recipe.yaml"]) == recipe

    card = ModelCard(files["README.md"].decode())
    meta = card.data.to_dict()
    assert meta["base_model"] == "me/tiny-nvfp4"
    assert meta["base_model_relation"] == "adapter"
    assert meta["library_name"] == "peft"
    assert {"qerl", "nvfp4", "trl", "grpo", "lora"} <= set(meta["tags"])
    text = card.text
    assert "--enable-lora" in text and "--lora-modules tiny-qerl-lora=me/tiny-qerl-lora" in text
    assert "--max-lora-rank 8" in text
    assert 'PeftModel.from_pretrained(base, "me/tiny-qerl-lora")' in text
    assert "DAPO" in text  # algorithm from loss_type
    assert "σ from 0.01 to 0.0001 over 10 stages" in text
    assert "`gsm8k_accuracy_reward`" in text and "`format_reward`" in text
    assert "| `reward` | 0.75 |" in text and "| `entropy` | 1.5 |" in text  # last logged values
    assert "learning_rate: 1.0e-05" in text
    assert "{{" not in text


def test_push_adapter_needs_adapter_files(fake_hub, tmp_path):
    from qerl_trl.hub import push_adapter

    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        push_adapter(tmp_path, "me/x", base_repo_id="me/b")


def test_top_level_model_cards_are_the_packaged_templates():
    root = Path(__file__).resolve().parents[1]
    for name in ("nvfp4_base.md", "lora_adapter.md"):
        top, pkg = root / "model_cards" / name, root / "qerl_trl" / "model_cards" / name
        assert top.is_file() and top.read_text() == pkg.read_text()
