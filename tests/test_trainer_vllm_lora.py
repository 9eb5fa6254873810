"""CPU tests of the pure parts of qerl_trl.trainer.vllm_serving (vLLM itself is exercised on the GPU machine)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from qerl_trl.trainer import vllm_serving as vl
from tests.conftest import tiny_model


def test_require_vllm_messages():
    with pytest.raises(ImportError, match=r'pip install "qerl-trl\[vllm\]"'):
        vl.require_vllm("0.23.1")
    assert vl.require_vllm("0.24.0+cu129") == "0.24.0+cu129"
    assert vl.require_vllm("0.30.2") == "0.30.2"


def test_require_vllm_missing_here():
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"not installed.*pip install \"qerl-trl\[vllm\]\""):
            vl.require_vllm()
    else:
        assert vl.require_vllm()


@pytest.mark.parametrize(
    "rank,expected", [(1, 1), (2, 8), (8, 8), (24, 32), (32, 32), (33, 64), (300, 320), (512, 512)]
)
def test_max_lora_rank_rounds_up(rank, expected, caplog):
    with caplog.at_level("WARNING"):
        assert vl.vllm_max_lora_rank(rank) == expected
    assert ("padded" in caplog.text) == (rank != expected)


def test_max_lora_rank_errors():
    with pytest.raises(ValueError, match="largest rank vLLM can serve"):
        vl.vllm_max_lora_rank(513)
    with pytest.raises(ValueError, match="not a rank vLLM accepts"):
        vl.vllm_max_lora_rank(16, requested=48)
    with pytest.raises(ValueError, match="smaller than the LoRA rank"):
        vl.vllm_max_lora_rank(64, requested=32)
    assert vl.vllm_max_lora_rank(16, requested=64) == 64


def test_check_lora_config_accepts_plain_lora():
    assert vl.check_lora_config_for_vllm(LoraConfig(r=16, target_modules="all-linear")) == 16
    assert vl.check_lora_config_for_vllm(LoraConfig(r=8, use_rslora=True, target_modules=["q_proj"])) == 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(bias="all"), "bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (dict(alpha_pattern={"q_proj": 3}), "alpha_pattern"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    ],
)
def test_check_lora_config_rejects(kwargs, match):
    base = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vl.check_lora_config_for_vllm(LoraConfig(**base))


def _peft_tiny(r=8):
    model = tiny_model("qwen2", dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, cfg), cfg


def test_peft_to_vllm_tensor_names_and_shapes(tmp_path):
    model, cfg = _peft_tiny(r=8)
    tensors = vl.peft_to_vllm_lora_tensors(model)
    # 2 layers x 7 projections x (A, B)
    assert len(tensors) == 2 * 7 * 2
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert name in tensors and tensors[name].shape == (8, 64)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 8)
    assert not any(".default." in k for k in tensors)
    q_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    torch.testing.assert_close(tensors[name], q_a.detach())

    vl.write_adapter_dir(str(tmp_path), tensors, cfg)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(saved) == set(tensors)
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    torch.testing.assert_close(saved[name].float(), q_a.detach().to(torch.bfloat16).float())
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 16 and conf["bias"] == "none" and not conf["use_dora"]
    projs = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    targets = conf["target_modules"]  # PEFT resolves "all-linear" to the module names
    assert isinstance(targets, list) and {t.rsplit(".", 1)[-1] for t in targets} == set(projs)


def test_peft_to_vllm_rejects_non_lora_tensors():
    model = tiny_model("qwen2", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="not a LoRA A/B weight"):
        vl.peft_to_vllm_lora_tensors(model)


def test_cast_norms_to_fp32_keeps_values_and_names():
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    names = ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    before = {n: model.get_parameter(n).detach().clone() for n in names}
    changed = vl.cast_norms_to_fp32(model, names)
    assert changed == names
    for n in names:
        p = model.get_parameter(n)
        assert p.dtype == torch.float32 and isinstance(p, torch.nn.Parameter)
        assert torch.equal(p.detach(), before[n].float())
    assert model.get_parameter("model.norm.weight").dtype == torch.bfloat16  # untouched
    assert vl.cast_norms_to_fp32(model, names) == []  # idempotent
    with pytest.raises(ValueError, match="not found in vLLM's model"):
        vl.cast_norms_to_fp32(model, ["model.layers.9.input_layernorm.weight"])


class _FakeLLM:
    """Stands in for vllm.LLM, which cannot be installed on the CPU CI machine."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False, lora_request=None):
        self.calls.append(("generate", lora_request))
        return ["out"]

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset", None))


def test_lora_serving_llm_injects_adapter_and_maps_sleep():
    fake = _FakeLLM()
    llm = vl.LoRAServingLLM(fake)
    with pytest.raises(RuntimeError, match="No LoRA adapter"):
        llm.generate(["p"], sampling_params=None)
    llm.lora_request = "REQ"
    assert llm.generate(["p"], sampling_params=None, use_tqdm=False) == ["out"]
    llm.sleep(level=2)
    llm.reset_prefix_cache()
    assert fake.calls == [("generate", "REQ"), ("sleep", 1), ("reset", None)]


def test_swap_trl_vllm_generation_restores():
    from trl.trainer import grpo_trainer

    original = grpo_trainer.VLLMGeneration

    def factory(**kw):
        return "built"

    with vl.swap_trl_vllm_generation(factory):
        assert grpo_trainer.VLLMGeneration is factory
    assert grpo_trainer.VLLMGeneration is original
    with pytest.raises(KeyError):
        with vl.swap_trl_vllm_generation(factory):
            raise KeyError("boom")
    assert grpo_trainer.VLLMGeneration is original



def test_compile_cache_marker_separates_fp32_norm_engines():
    # vLLM hashes additional_config into its torch.compile cache key: fp32-norm engines get a key of their own that
    # depends on the set of norms, not their order; bf16-norm engines get a fixed one
    from qerl_trl.trainer import vllm_serving as vl

    assert vl.compile_cache_marker([]) == {"qerl_fp32_norms": "none"}
    a = vl.compile_cache_marker(["model.norm.weight", "model.layers.0.input_layernorm.weight"])
    assert a == vl.compile_cache_marker(["model.layers.0.input_layernorm.weight", "model.norm.weight"])
    assert set(a) == {"qerl_fp32_norms"} and a != vl.compile_cache_marker(["model.norm.weight"])
    json.dumps(a)  # vLLM hashes it as JSON


def test_compile_cache_marker_separates_single_lora_specs():
    # hf_overrides (where the single-LoRA engine learns its rank and targets) is left out of vLLM's compile key
    base = vl.compile_cache_marker([])
    r32 = vl.compile_cache_marker([], {"quantization_config": {"qerl_lora": {"rank": 32, "target_modules": ["q_proj"]}}})
    r16 = vl.compile_cache_marker([], {"quantization_config": {"qerl_lora": {"rank": 16, "target_modules": ["q_proj"]}}})
    assert len({json.dumps(m, sort_keys=True) for m in (base, r32, r16)}) == 3
    assert r32["qerl_fp32_norms"] == base["qerl_fp32_norms"] == "none"


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_lora_modules_give_vllm_names_and_the_scaling_the_engine_folds_in(use_rslora):
    from qerl_trl.vllm_plugin.lora_shards import column_parallel_plan, fill_lora_buffers

    model = get_peft_model(
        tiny_model(dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=use_rslora, lora_dropout=0.0),
    )
    with torch.no_grad():  # a non-zero B, so the LoRA moves the output
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    mods, scaling = vl.peft_lora_modules(model)
    assert len(mods) == 2 * 7 and "model.layers.1.mlp.down_proj" in mods  # vLLM's module names
    assert scaling == (16 / 8**0.5 if use_rslora else 16 / 8)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    a, b = mods["model.layers.0.self_attn.q_proj"]
    assert a.data_ptr() == q.lora_A["default"].weight.data_ptr()  # PEFT's tensors, not copies
    # what the engine's layer computes after the push, base + x A^T (sB)^T, is what PEFT's module computes
    plan = column_parallel_plan(["q_proj"], [q.out_features], 64, 8, [0])
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    buf_a, buf_b = torch.zeros(ra, ca), torch.zeros(rb, cb)
    fill_lora_buffers(plan, buf_a, buf_b, {"q_proj": (a, b)}, scaling)
    x = torch.randn(3, 64)
    torch.testing.assert_close(q.base_layer(x) + x @ buf_a.T @ buf_b.T, q(x), rtol=1e-5, atol=1e-5)


def test_what_the_single_lora_engine_cannot_serve_names_the_other_backend():
    from qerl_trl.vllm_plugin import lora_quantization_overrides

    model = get_peft_model(tiny_model(dtype=torch.float32), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] = 5.0  # two scalings
    with pytest.raises(ValueError, match=r"one LoRA scaling.*vllm_lora_backend='vllm'"):
        vl.peft_lora_modules(model)
    with pytest.raises(ValueError, match=r"compressed-tensors NVFP4A16.*vllm_lora_backend='vllm'"):
        lora_quantization_overrides({"quantization_config": {"quant_method": "bitsandbytes"}}, 8, ["q_proj"])


def test_lora_serving_llm_without_adapters_passes_generate_through():
    fake = _FakeLLM()
    llm = vl.LoRAServingLLM(fake, adapters=False)  # lora_backend="qerl": the LoRA lives in the engine's layers
    assert llm.generate(["p"], sampling_params=None) == ["out"]
    assert fake.calls == [("generate", None)]


def test_single_lora_overrides_need_a_compressed_tensors_checkpoint():
    from qerl_trl.vllm_plugin import LORA_KEY, lora_quantization_overrides
    from qerl_trl.vllm_plugin.quant_spec import LORA_OPS_VERSION

    ct = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}
    out = lora_quantization_overrides(ct, 24, ["v_proj", "q_proj", "q_proj"])
    assert out["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert out["quantization_config"][LORA_KEY] == {"rank": 24, "target_modules": ["q_proj", "v_proj"], "fp4_kernel": "marlin",
                                                   "ops": LORA_OPS_VERSION}
    assert LORA_KEY not in ct["quantization_config"]  # the checkpoint's own config is left alone
    with pytest.raises(ValueError, match="compressed-tensors NVFP4A16"):
        lora_quantization_overrides({"quantization_config": {"quant_method": "bitsandbytes"}}, 8, ["q_proj"])
    with pytest.raises(ValueError, match="targets no module"):
        lora_quantization_overrides(ct, 8, [])


def test_the_default_backend_is_the_in_layer_lora():
    """Issue #25 decided the default on the measured step (README, "Why "qerl" is the default"): a config that names
    no backend builds the engine on our quantization method, with no adapter slots."""
    from qerl_trl import QeRLGRPOConfig

    args = QeRLGRPOConfig(output_dir="/tmp/x", bf16=False, use_cpu=True, report_to="none")
    spec = vl.VLLMServingSpec(checkpoint="c", tokenizer="c", max_lora_rank=8)
    assert args.vllm_lora_backend == spec.lora_backend == "qerl"
    backend = vl.LORA_BACKENDS[args.vllm_lora_backend](spec)
    assert isinstance(backend, vl.InLayerLoRABackend) and not backend.uses_lora_request


def test_config_rejects_an_unknown_lora_backend():
    from qerl_trl import QeRLGRPOConfig

    with pytest.raises(ValueError, match="vllm_lora_backend must be 'vllm'"):
        QeRLGRPOConfig(output_dir="/tmp/x", bf16=False, use_cpu=True, vllm_lora_backend="punica", report_to="none")


def test_vllm_plugin_entry_point_never_breaks_an_engine_start(monkeypatch, caplog):
    # vLLM runs every installed general plugin unguarded at engine start: a failure must be logged, not raised,
    # unless the trainer (which needs the method) asks for it
    import builtins

    import qerl_trl.vllm_plugin as plugin

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vLLM here")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "qerl_trl.vllm_plugin.single_lora", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with caplog.at_level("ERROR"):
        plugin.register()
    assert "could not register" in caplog.text
    with pytest.raises(ImportError, match="no vLLM here"):
        plugin.register(strict=True)


def _no_gather_calls():
    import contextlib

    seen = []

    @contextlib.contextmanager
    def gather(params):
        seen.append(len(params))
        yield

    return gather, seen


def _fake_lora_request_module(monkeypatch):
    import types

    class LoRARequest:
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_int_id, self.lora_path = lora_int_id, lora_path

    fake_vllm = types.ModuleType("vllm.lora.request")
    fake_vllm.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora.request", fake_vllm)


def test_adapter_backend_pushes_one_adapter_per_sync_and_clears_it(tmp_path, monkeypatch):
    """vllm_lora_backend="vllm": engine arguments, a LoRARequest per sync (the older one removed), and clear."""
    import types

    _fake_lora_request_module(monkeypatch)
    loaded = []

    class Engine:
        def add_lora(self, request):  # vLLM reads the files now; they are deleted right after
            loaded.append(sorted(p.name for p in __import__("pathlib").Path(request.lora_path).iterdir()))

        def remove_lora(self, lora_id):
            loaded.append(("removed", lora_id))

    model, _ = _peft_tiny(r=8)
    spec = vl.VLLMServingSpec(checkpoint="ckpt", tokenizer="ckpt", max_lora_rank=8, lora_sync_dir=str(tmp_path),
                              lora_sync_in_place=False)  # every round through files
    backend = vl.LORA_BACKENDS["vllm"](spec)
    assert isinstance(backend, vl.AdapterLoRABackend) and backend.uses_lora_request
    assert backend.engine_kwargs(model) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 2}
    backend.attach(types.SimpleNamespace(llm_engine=Engine()))
    gather, seen = _no_gather_calls()
    first = backend.sync(model, gather)
    second = backend.sync(model, gather)
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and seen == [2 * 7 * 2] * 2
    files = ["adapter_config.json", "adapter_model.safetensors"]
    assert loaded == [files, ("removed", 1), files] and list(tmp_path.iterdir()) == []
    assert backend.clear() == 1 and loaded[-1] == ("removed", 2) and backend.clear() == 0


def test_in_layer_backend_pushes_into_the_layers_and_clear_zeroes_them(monkeypatch):
    """vllm_lora_backend="qerl": the LoRA copied in place while gathered; clear pushes nothing and resets the cache."""
    import types

    pushes = []
    fake_single = types.ModuleType("qerl_trl.vllm_plugin.single_lora")
    fake_single.push_lora_in_place = lambda model, adapters, scaling: pushes.append((sorted(adapters), scaling)) or len(adapters)
    monkeypatch.setitem(sys.modules, "qerl_trl.vllm_plugin.single_lora", fake_single)
    calls = []

    class LLM:
        def apply_model(self, fn):
            return [fn("engine model")]

        def reset_prefix_cache(self):
            calls.append("reset")

    model, _ = _peft_tiny(r=8)
    backend = vl.LORA_BACKENDS["qerl"](vl.VLLMServingSpec(checkpoint="ckpt", tokenizer="ckpt", max_lora_rank=8))
    assert isinstance(backend, vl.InLayerLoRABackend) and not backend.uses_lora_request
    backend.attach(LLM())
    gather, seen = _no_gather_calls()
    assert backend.sync(model, gather) is None and seen == [2 * 7 * 2]
    (names, scaling), = pushes
    assert len(names) == 2 * 7 and "model.layers.0.self_attn.q_proj" in names and scaling == 2.0
    assert backend.clear() == 0 and pushes[-1] == ([], 1.0) and calls == ["reset"]


def test_lora_ops_key_is_a_hash_of_the_op_sources(tmp_path):
    """Issue #55 item 6: the compile-cache key of the in-layer LoRA changes whenever any file of its ops changes."""
    import shutil
    from pathlib import Path

    from qerl_trl.vllm_plugin import quant_spec

    here = Path(quant_spec.__file__).parent
    assert quant_spec.LORA_OPS_VERSION == quant_spec.lora_ops_digest()
    for name in quant_spec.LORA_OPS_SOURCES:
        shutil.copy(here / name, tmp_path / name)
    assert quant_spec.lora_ops_digest(root=tmp_path) == quant_spec.LORA_OPS_VERSION
    for name in quant_spec.LORA_OPS_SOURCES:
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"\n# changed\n")
        assert quant_spec.lora_ops_digest(root=tmp_path) != quant_spec.LORA_OPS_VERSION, name
        (tmp_path / name).write_bytes(original)


def test_lora_ops_sources_cover_what_the_method_imports():
    """Every plugin module the in-layer method reaches through its package imports is hashed into the key (the
    spec module itself holds no op)."""
    import ast
    from pathlib import Path

    from qerl_trl.vllm_plugin import quant_spec

    here = Path(quant_spec.__file__).parent
    seen, todo = set(), ["single_lora.py"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((here / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module.split(".")[0] + ".py")
    assert seen - {"quant_spec.py"} <= set(quant_spec.LORA_OPS_SOURCES)


def test_peft_to_vllm_tensors_are_peft_saved_adapter():
    """The tensors read from the LoRA layers are exactly PEFT's saved adapter: names, shapes and values."""
    from peft.utils import get_peft_model_state_dict

    model, _ = _peft_tiny(r=8)
    ours = vl.peft_to_vllm_lora_tensors(model)
    peft_state = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert list(ours) == list(peft_state)
    for name, t in peft_state.items():
        assert ours[name].data_ptr() == t.data_ptr()  # the parameters themselves, no copy


def test_adapter_sync_does_no_work_that_grows_with_steps_or_model(tmp_path, monkeypatch):
    """Issue #55: the "vllm" backend's sync once took 4.1 s a step (0.30 s before). Each sync must read only the
    LoRA (never the whole model's state_dict, nor the base model's config), write the same bytes every round, and
    leave one adapter loaded: nothing in it may grow with the number of steps or with the base model."""
    import types

    _fake_lora_request_module(monkeypatch)
    calls, sizes, loaded = [], [], set()

    class Engine:
        def add_lora(self, request):
            calls.append("add")
            loaded.add(request.lora_int_id)
            sizes.append(sum(p.stat().st_size for p in __import__("pathlib").Path(request.lora_path).iterdir()))

        def remove_lora(self, lora_id):
            calls.append("remove")
            loaded.discard(lora_id)

    model, _ = _peft_tiny(r=8)

    def whole_model_read(*a, **k):
        raise AssertionError("the sync read the whole model's state_dict")

    monkeypatch.setattr(torch.nn.Module, "state_dict", whole_model_read)
    monkeypatch.setattr(type(model.config), "from_pretrained", whole_model_read)
    spec = vl.VLLMServingSpec(checkpoint="ckpt", tokenizer="ckpt", max_lora_rank=8, lora_sync_dir=str(tmp_path),
                              lora_sync_in_place=False)  # every round through files
    backend = vl.AdapterLoRABackend(spec)
    backend.attach(types.SimpleNamespace(llm_engine=Engine()))
    gather, _ = _no_gather_calls()
    for _ in range(6):
        backend.sync(model, gather)
        assert set(backend.last_phases) == {"read", "write", "load"}
    assert calls == ["add"] + ["remove", "add"] * 5
    assert loaded == {6} and len(set(sizes)) == 1 and list(tmp_path.iterdir()) == []
    lora_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if "lora_" in n)  # bf16 on disk
    assert lora_bytes < sizes[0] < lora_bytes + 64 * 1024  # the LoRA and its header, nothing of the base


def test_in_place_sync_loads_once_through_files_then_refreshes_that_adapter(tmp_path, monkeypatch):
    """vllm_lora_sync_in_place: the first round (and the first after a clear) through files and add_lora; every
    other round one refresh of the same adapter id on the engine's worker, with the round's tensors (copies: vLLM
    scales B in place) and the adapter's config; the LoRARequest stays the same."""
    import types

    from qerl_trl.trainer.vllm_serving.adapter_refresh import refresh_adapter_in_place

    _fake_lora_request_module(monkeypatch)
    calls = []

    class Engine:
        def add_lora(self, request):
            calls.append(("add", request.lora_int_id))

        def remove_lora(self, lora_id):
            calls.append(("remove", lora_id))

        def collective_rpc(self, method, args=()):
            lora_id, tensors, cfg = args
            calls.append(("refresh", lora_id, method is refresh_adapter_in_place, len(tensors), cfg["r"]))
            refreshed.append(tensors)
            return [len(tensors) // 2]

    refreshed = []
    model, _ = _peft_tiny(r=8)
    spec = vl.VLLMServingSpec(checkpoint="c", tokenizer="c", max_lora_rank=8, lora_sync_dir=str(tmp_path),
                              lora_backend="vllm", lora_sync_in_place=True)  # fmt: skip
    backend = vl.AdapterLoRABackend(spec)
    backend.attach(types.SimpleNamespace(llm_engine=Engine()))
    gather, _ = _no_gather_calls()
    requests = [backend.sync(model, gather) for _ in range(3)]
    assert requests[0] is requests[1] is requests[2] and requests[0].lora_int_id == 1
    assert calls == [("add", 1), ("refresh", 1, True, 28, 8), ("refresh", 1, True, 28, 8)]
    assert set(backend.last_phases) == {"read", "load"} and list(tmp_path.iterdir()) == []
    lora_b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    sent = refreshed[-1]["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(sent, lora_b) and sent.data_ptr() != lora_b.data_ptr()  # a copy: vLLM scales it in place
    assert backend.clear() == 1 and calls[-1] == ("remove", 1)
    assert backend.sync(model, gather) is not requests[0] and calls[-1] == ("add", 1)  # through files again


def test_in_place_sync_is_on_by_default_and_can_be_turned_off(tmp_path):
    """On by default (the whole GPU suite ran with it on; docs/testing.md), and the spec carries the user's choice."""
    from qerl_trl import QeRLGRPOConfig

    assert QeRLGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).vllm_lora_sync_in_place is True
    off = QeRLGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, vllm_lora_sync_in_place=False)
    assert off.vllm_lora_sync_in_place is False
    assert vl.VLLMServingSpec(checkpoint="c", tokenizer="c", max_lora_rank=8).lora_sync_in_place is True


@pytest.mark.vllm_on_cpu
def test_refresh_in_place_builds_the_adapter_with_vllms_own_classes(monkeypatch):
    """vLLM 0.24's LoRAModel and PEFTHelper (on the CPU) build the refreshed adapter from PEFT's names; the manager
    drops the old one, adds and activates the new one under the same id. The names of vLLM's internals used here
    are checked to exist, so a vLLM that renames them fails this test, not a user's training run."""
    import inspect
    import types

    pytest.importorskip("vllm")
    from vllm.lora import lora_model, model_manager, worker_manager

    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)  # no CUDA here to pin with (on the GPU the tensors are there)

    from qerl_trl.trainer.vllm_serving.adapter_lora import adapter_config_dict
    from qerl_trl.trainer.vllm_serving.adapter_refresh import refresh_adapter_in_place

    for name in ("remove_adapter", "add_adapter", "activate_adapter", "list_adapters"):
        assert callable(getattr(model_manager.LRUCacheLoRAModelManager, name))
    init = inspect.getsource(worker_manager.WorkerLoRAManager.__init__)
    for attr in ("max_position_embeddings", "vocab_size", "lora_config", "device", "_adapter_manager"):
        assert f"self.{attr}" in init, attr

    peft_model, cfg = _peft_tiny(r=8)
    tensors = vl.peft_to_vllm_lora_tensors(peft_model, copy=True)
    calls = []

    class Manager:
        model = torch.nn.Module()

        def list_adapters(self):
            return {3: "old"}

        def remove_adapter(self, i):
            calls.append(("remove", i))

        def add_adapter(self, lora):
            calls.append(("add", lora.id, lora.rank, sorted(lora.loras)[:2]))
            added.append(lora)

        def activate_adapter(self, i):
            calls.append(("activate", i))

    added = []
    lora_config = types.SimpleNamespace(lora_dtype=torch.float32, max_lora_rank=8, max_loras=1,
                                        fully_sharded_loras=False)  # fmt: skip
    loras = types.SimpleNamespace(_adapter_manager=Manager(), max_position_embeddings=128, vocab_size=256,
                                  device=torch.device("cpu"), lora_config=lora_config)  # fmt: skip
    worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(lora_manager=loras)))
    n = refresh_adapter_in_place(worker, 3, tensors, adapter_config_dict(cfg))
    assert n == 14 and calls[0] == ("remove", 3) and calls[-1] == ("activate", 3)
    assert calls[1][:3] == ("add", 3, 8)
    q = added[0].loras["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(q.lora_a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    with pytest.raises(RuntimeError, match="no adapter 4"):
        refresh_adapter_in_place(worker, 4, tensors, adapter_config_dict(cfg))

