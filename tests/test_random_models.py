"""benchmarks/random_models.py: Qwen2.5-shaped random checkpoints (tokenizer, bf16, NVFP4A16), on CPU, tiny shapes."""

from __future__ import annotations

import json
import os
import string
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import random_models as rm

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}
STD = 0.05  # not transformers' init std (0.02), so the std check sees ours


def tiny_config(size: str = "qwen2.5-7b", **kw):
    return rm.qwen25_config(size, **{**TINY, **kw})


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ configs
def test_unknown_size_raises_and_lists_known_sizes():
    with pytest.raises(ValueError, match="qwen2.5-7b") as e:
        rm.qwen25_config("qwen2.5-3000b")
    assert all(s in str(e.value) for s in rm.QWEN25_SHAPES)
    with pytest.raises(ValueError, match="unknown model size"):
        rm.write_nvfp4_checkpoint("/nonexistent/never-written", "llama-7b")


@pytest.mark.parametrize(
    "size, params",
    # parameter counts of the released checkpoints (Qwen2.5-*-Instruct model cards / safetensors metadata)
    [("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-14b", 14_770_033_664),
     ("qwen2.5-32b", 32_763_876_352)],
)
def test_shapes_give_the_released_parameter_counts(size, params):
    from transformers import AutoModelForCausalLM

    config = rm.qwen25_config(size)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.dtype == torch.bfloat16
    eos = config.vocab_size - 1
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (eos, eos, eos)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == params
    assert config.tie_word_embeddings == (size == "qwen2.5-1.5b")


def test_overrides_replace_fields():
    config = tiny_config(rms_norm_eps=1e-5)
    assert (config.hidden_size, config.vocab_size, config.rms_norm_eps) == (64, 512, 1e-5)
    assert config.eos_token_id == 511 and config.rope_parameters["rope_theta"] == 1e6


# ------------------------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    rm.write_tokenizer(path, 512)
    tiny_config().save_pretrained(path)  # AutoTokenizer then picks Qwen2Tokenizer, as TRL and vLLM will
    return path


def test_tokenizer_round_trip_through_autotokenizer_with_qwen2_config(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # the class whose rebuild from vocab+merges is the pitfall
    assert len(tok) == 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == _config(tok_dir)["eos_token_id"] == 511
    assert tok.bos_token_id is None  # nothing is prepended: N characters are N tokens
    text = "Hello, world! 42 times."
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok("hi" + tok.eos_token)["input_ids"] == [104, 105, 511]
    for n in (1, 7, 64):
        for prompt in rm.make_prompts(4, n, seed=n, tokenizer=tok):
            assert len(tok(prompt)["input_ids"]) == n
            assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == n
            assert tok.decode(tok(prompt)["input_ids"]) == prompt
    # every id a model with vocab_size 512 can sample decodes, one at a time and all together
    pieces = [tok.decode([i]) for i in range(512)]
    assert all(isinstance(p, str) for p in pieces) and sum(p == "" for p in pieces) == 0
    assert tok.decode([511], skip_special_tokens=True) == ""
    assert isinstance(tok.decode(list(range(512))), str)
    assert all(tok.decode([b]) == chr(b) for b in range(128))  # id b is byte b
    fillers = tok.convert_ids_to_tokens(list(range(256, 511)))
    assert len(set(fillers)) == 255 and all(len(f) == 2 for f in fillers)
    assert tok.convert_ids_to_tokens([256, 510]) == ["ĀĀ", "Āþ"]  # bytes (0, 0) and (0, 254)


def test_tokenizer_same_ids_without_config(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    rm.write_tokenizer(str(tmp_path), 512)
    plain = AutoTokenizer.from_pretrained(str(tmp_path))
    qwen = AutoTokenizer.from_pretrained(tok_dir)
    text = rm.make_prompts(1, 200, seed=3)[0] + " x\n\ty' é €"
    assert plain(text)["input_ids"] == qwen(text)["input_ids"] == list(text.encode())


def test_tokenizer_refuses_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="at least 257"):
        rm.write_tokenizer(str(tmp_path), 256)


def test_make_prompts_are_printable_distinct_and_checked():
    a = rm.make_prompts(8, 50, seed=1)
    assert a == rm.make_prompts(8, 50, seed=1) and a != rm.make_prompts(8, 50, seed=2)
    assert len(set(a)) == 8
    printable = set(string.printable) - set("\t\n\r\x0b\x0c")
    assert all(len(p) == 50 and set(p) <= printable and p == p.strip() for p in a)
    assert "<|" not in "".join(a)

    def bpe_like(text):  # a tokenizer with merges: fewer ids than characters
        return {"input_ids": list(range(len(text) // 2))}

    with pytest.raises(AssertionError, match="encodes to 25 tokens, not 50"):
        rm.make_prompts(1, 50, tokenizer=bpe_like)


# ------------------------------------------------------------------------------------------------ NVFP4 checkpoints
def _library_reference(config, out_dir: str, seed: int = 0) -> str:
    """What qerl_trl itself writes: the same bf16 Linear weights the writer draws, through NVFP4Config + save."""
    from transformers import AutoModelForCausalLM

    from qerl_trl import NVFP4Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings():
                module.weight.copy_(rm.random_bf16_tensor(name + ".weight", tuple(module.weight.shape), STD, seed))
    model.save_pretrained(out_dir + "-bf16")
    quantized = AutoModelForCausalLM.from_pretrained(
        out_dir + "-bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16
    )
    quantized.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["qwen2.5-7b", "qwen2.5-1.5b"], ids=["untied", "tied"])
def nvfp4_pair(request, tmp_path_factory):
    config = tiny_config(request.param)
    root = tmp_path_factory.mktemp("nvfp4-" + request.param)
    ours = rm.write_nvfp4_checkpoint(str(root / "ours"), config, weight_std=STD)
    ref = _library_reference(config, str(root / "ref"))
    return config, ours, ref


def test_nvfp4_matches_the_library_save(nvfp4_pair):
    config, ours, ref = nvfp4_pair
    a, b = _tensors(ours), _tensors(ref)
    assert sorted(a) == sorted(b)
    def layout(ts):
        return {k: (t.dtype, tuple(t.shape)) for k, t in ts.items()}

    assert layout(a) == layout(b)
    ca, cb = _config(ours), _config(ref)
    assert ca["quantization_config"] == cb["quantization_config"]
    assert ca["quantization_config"]["ignore"] == ["lm_head"]
    assert ("lm_head.weight" in a) == (not config.tie_word_embeddings)
    # the packed tensors are byte-identical to the library's quantization of the weights we drew
    quantized = [k for k in a if k.rsplit(".", 1)[-1].startswith("weight_")]
    assert len(quantized) == 3 * 7 * config.num_hidden_layers
    for k in quantized:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    with open(os.path.join(ours, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 511


def test_nvfp4_tensors_formats_and_shared_global_scales(nvfp4_pair):
    config, ours, _ = nvfp4_pair
    t = _tensors(ours)
    H, I, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * 16
    p = "model.layers.1."
    assert t[p + "self_attn.k_proj.weight_packed"].dtype == torch.uint8
    assert t[p + "self_attn.k_proj.weight_packed"].shape == (kv, H // 2)
    assert t[p + "mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[p + "mlp.down_proj.weight_scale"].shape == (H, I // 16)
    assert t[p + "mlp.up_proj.weight_global_scale"].dtype == torch.float32
    norm = t[p + "input_layernorm.weight"]
    assert norm.dtype == torch.bfloat16 and bool((norm == 1).all())
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert abs(t["model.embed_tokens.weight"].float().std().item() - STD) < 0.1 * STD
    for i in range(config.num_hidden_layers):
        gs = {n: t[f"model.layers.{i}.{n}.weight_global_scale"].item()
              for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert gs["self_attn.q_proj"] == gs["self_attn.k_proj"] == gs["self_attn.v_proj"]
        assert gs["mlp.gate_proj"] == gs["mlp.up_proj"]
        # ... and the four groups are distinct draws (global scales may coincide: they are bf16-rounded)
        packed = [t[f"model.layers.{i}.{n}.weight_packed"][:, :8].flatten()[:256]
                  for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
        assert len({tuple(x.tolist()) for x in packed}) == 4
    # random codes: every E2M1 code in use, both nibbles
    codes = t[p + "mlp.gate_proj.weight_packed"]
    assert set((codes & 0xF).unique().tolist()) == set(range(16)) == set((codes >> 4).unique().tolist())


def test_nvfp4_decodes_by_hand_to_the_drawn_weight(nvfp4_pair):
    """Independent of qerl_trl's format code: even column in the low nibble, fp4 * scale / global_scale."""
    _, ours, _ = nvfp4_pair
    t = _tensors(ours)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"):
        packed = t[name + ".weight_packed"]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        scale = t[name + ".weight_scale"].float().repeat_interleave(16, dim=1)
        w_hat = e2m1[codes] * scale / t[name + ".weight_global_scale"]
        drawn = rm.random_bf16_tensor(name + ".weight", tuple(w_hat.shape), STD).float()
        rel = ((w_hat - drawn).norm() / drawn.norm()).item()
        assert rel < 0.15, (name, rel)  # NVFP4 round-to-nearest of a Gaussian: ~10%; swapped nibbles: ~140%


def test_nvfp4_read_by_compressed_tensors_gives_the_same_logits(nvfp4_pair):
    """transformers' own compressed-tensors loader (the format vLLM serves) reads our checkpoint."""
    from transformers import AutoModelForCausalLM

    import qerl_trl

    pytest.importorskip("compressed_tensors")
    _, ours, _ = nvfp4_pair
    theirs = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.bfloat16)
    assert type(theirs.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    model = qerl_trl.load_nvfp4(ours, dtype=torch.bfloat16)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        a, b = model(ids).logits.float(), theirs(ids).logits.float()
    assert (a - b).abs().max().item() <= 1e-2 * a.abs().max().item()


def test_load_nvfp4_gives_nvfp4_linears_finite_logits_and_the_std(nvfp4_pair):
    import qerl_trl
    from qerl_trl import NVFP4Linear

    config, ours, _ = nvfp4_pair
    model, info = qerl_trl.load_nvfp4(ours, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    linears = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(linears) == 7 * config.num_hidden_layers
    assert not any(type(m) is torch.nn.Linear for n, m in model.named_modules() if n != "lm_head")
    for name, m in linears.items():
        std = m.dequantize(torch.float32).std().item()
        assert abs(std - STD) < 0.3 * STD, (name, std)
    ids = torch.tensor([list(rm.make_prompts(1, 12)[0].encode())])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 12, 512) and bool(torch.isfinite(logits).all()) and logits.float().std() > 0


def test_nvfp4_in_many_row_chunks_still_matches_the_library(tmp_path, monkeypatch):
    """Real sizes are generated in row chunks (two passes: group amax, then quantize); force that path here."""
    monkeypatch.setattr(rm, "_chunk_rows", lambda in_features, device: 24)  # not a divisor of 64 or 128
    config = tiny_config()
    ours = rm.write_nvfp4_checkpoint(str(tmp_path / "ours"), config, weight_std=STD)
    ref = _library_reference(config, str(tmp_path / "ref"))
    a, b = _tensors(ours), _tensors(ref)
    assert sorted(a) == sorted(b)
    for k in a:
        if k.rsplit(".", 1)[-1].startswith("weight_"):
            assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_nvfp4_sharded_index_and_cache(tmp_path):
    import qerl_trl

    path = str(tmp_path / "sharded")
    rm.write_nvfp4_checkpoint(path, tiny_config(), weight_std=STD, max_shard_bytes=30_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards
    tensors = _tensors(path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # a decoder layer never straddles two shards (q/k/v of one layer sit together)
    for i in range(2):
        assert len({v for k, v in index["weight_map"].items() if k.startswith(f"model.layers.{i}.")}) == 1
    assert not [d for d in os.listdir(tmp_path) if ".partial-" in d]
    model = qerl_trl.load_nvfp4(path, dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.up_proj.weight_packed.shape == (128, 32)
    # cached: a second call with another seed writes nothing
    mtime = os.path.getmtime(os.path.join(path, shards[0]))
    assert rm.write_nvfp4_checkpoint(path, tiny_config(), seed=7) == path
    assert os.path.getmtime(os.path.join(path, shards[0])) == mtime


def test_nvfp4_refuses_linears_that_cannot_be_nvfp4(tmp_path):
    with pytest.raises(ValueError, match="divisible by 16"):
        rm.write_nvfp4_checkpoint(str(tmp_path / "x"), tiny_config(intermediate_size=120))
    assert not os.path.exists(tmp_path / "x")


# ------------------------------------------------------------------------------------------------ bf16 checkpoints
def test_bf16_checkpoint_loads_and_is_cached(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path / "bf16")
    assert rm.write_bf16_checkpoint(path, tiny_config()) == path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.eos_token_id == 511 and getattr(model.config, "quantization_config", None) is None
    assert bool((model.model.layers[0].input_layernorm.weight == 1).all())
    w = model.model.layers[0].mlp.gate_proj.weight
    assert w.shape == (128, 64) and 0.01 < w.float().std().item() < 0.03  # transformers' init, std 0.02
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512 and tok.eos_token_id == 511
    with torch.no_grad():
        logits = model(torch.tensor([tok(rm.make_prompts(1, 9, tokenizer=tok)[0])["input_ids"]])).logits
    assert logits.shape == (1, 9, 512) and bool(torch.isfinite(logits).all())
    before = {n: p.clone() for n, p in model.state_dict().items()}
    assert rm.write_bf16_checkpoint(path, tiny_config(), seed=5) == path  # cached, not rewritten
    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(before[n], again[n]) for n in before)


def test_bf16_model_is_built_on_the_device_and_failures_leave_nothing(tmp_path, monkeypatch):
    """The model is initialised under ``torch.device(device)`` (a 7B on the GPU, not in host memory); a failure
    removes the partial directory, so a later call does not mistake it for a cached checkpoint."""
    import transformers

    seen = []

    class Stop(Exception):
        pass

    def from_config(config, **kw):
        seen.append((torch.empty(0).device, kw.get("dtype")))
        raise Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    with pytest.raises(Stop):
        rm.write_bf16_checkpoint(str(tmp_path / "m"), tiny_config(), device="meta")
    assert seen == [(torch.device("meta"), torch.bfloat16)]
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------ mixture of experts
MOE_TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 512}


def test_qwen3_30b_a3b_has_the_released_parameter_count_and_an_18_gb_nvfp4_checkpoint():
    from transformers import AutoModelForCausalLM

    config = rm.model_config("qwen3-30b-a3b")
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.num_experts == 128
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624  # Qwen3-30B-A3B's safetensors metadata
    layout = rm._Layout(config)
    gib = sum(layout.nbytes(u) for u in layout.units) / 2**30
    assert 16.5 < gib < 18.0, gib  # NVFP4 experts and attention, bf16 embeddings, router and lm_head
    assert layout.ignore == ["lm_head", "re:.*mlp.gate$"]
    with pytest.raises(ValueError, match="unknown model size 'qwen3-235b'.*qwen3-30b-a3b"):
        rm.model_config("qwen3-235b")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    config = rm.qwen3_moe_config("qwen3-30b-a3b", **MOE_TINY)
    path = rm.write_nvfp4_checkpoint(str(tmp_path_factory.mktemp("moe") / "ckpt"), config, weight_std=STD)
    return config, path


def test_moe_experts_are_written_per_expert_as_llm_compressor_writes_them(moe_checkpoint):
    """vLLM's Qwen3-MoE loader reads experts as ``mlp.experts.<e>.{gate,up,down}_proj``; gate and up share a global
    scale (vLLM serves them as one matrix); the router stays bf16 and is ignored by llm-compressor's pattern."""
    from qerl_trl.quantizer.checkpoint import compressed_tensors_config

    config, path = moe_checkpoint
    t = _tensors(path)
    assert all(x.ndim <= 2 for x in t.values()), "no fused 3-D expert tensor"
    H, W, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    per_layer = 4 * 3 + E * 3 * 3 + 1 + 4  # attention, experts, router, norms (input, post-attention, q, k)
    assert len(t) == per_layer * config.num_hidden_layers + 3  # embeddings, final norm, lm_head
    qc = _config(path)["quantization_config"]
    assert qc == compressed_tensors_config(["lm_head", "re:.*mlp.gate$"])
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp."
        router = t[p + "gate.weight"]
        assert router.dtype == torch.bfloat16 and router.shape == (E, H)
        draws = set()
        for e in range(E):
            x = f"{p}experts.{e}."
            for proj, shape in (("gate_proj", (W, H)), ("up_proj", (W, H)), ("down_proj", (H, W))):
                assert t[x + proj + ".weight_packed"].dtype == torch.uint8
                assert t[x + proj + ".weight_packed"].shape == (shape[0], shape[1] // 2)
                assert t[x + proj + ".weight_scale"].dtype == torch.float8_e4m3fn
                assert t[x + proj + ".weight_scale"].shape == (shape[0], shape[1] // 16)
                assert t[x + proj + ".weight_global_scale"].shape == (1,)
            assert torch.equal(t[x + "gate_proj.weight_global_scale"], t[x + "up_proj.weight_global_scale"])
            draws.add(tuple(t[x + "gate_proj.weight_packed"].flatten()[:64].tolist()))
        assert len(draws) == E, "each expert is its own draw"
        a = f"model.layers.{layer}.self_attn."
        assert t[a + "q_proj.weight_global_scale"] == t[a + "k_proj.weight_global_scale"]
        assert bool((t[a + "q_norm.weight"] == 1).all())


def test_moe_expert_bytes_are_the_librarys_quantization_of_the_drawn_weights(moe_checkpoint):
    from qerl_trl.quantizer.conversion import quantize_group

    config, path = moe_checkpoint
    t = _tensors(path)
    H, W = config.hidden_size, config.moe_intermediate_size
    for layer, e in ((0, 0), (1, 3)):
        x = f"model.layers.{layer}.mlp.experts.{e}."
        for group in ((("gate_proj", (W, H)), ("up_proj", (W, H))), (("down_proj", (H, W)),)):
            drawn = {x + proj: rm.random_bf16_tensor(x + proj + ".weight", shape, STD) for proj, shape in group}
            for name, q in quantize_group(drawn).items():
                for attr, want in q._asdict().items():
                    got = t[f"{name}.{attr}"]
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, attr)


@pytest.mark.vllm_on_cpu
def test_vllm_maps_every_moe_checkpoint_tensor_and_serves_the_experts_as_nvfp4a16(moe_checkpoint):
    """vLLM 0.24's own code: its Qwen3-MoE expert mapping places every expert tensor in the fused-MoE layer's
    NVFP4 parameters (gate -> w1, up -> w3, down -> w2), its compressed-tensors config ignores the router and not the
    experts, and reads the weights as NVFP4 with 16-bit activations (``CompressedTensorsW4A4Nvfp4MoEMethod``
    with ``use_a16``). Serving it on a GPU is rollout.py's ``--sizes 30b-a3b``."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    config, path = moe_checkpoint
    t = _tensors(path)
    mapping = RoutedExperts.make_expert_params_mapping(torch.nn.Module(), "gate_proj", "down_proj", "up_proj",
                                                       config.num_experts)  # fmt: skip
    shard_of = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    params = set()
    experts = [n for n in t if ".mlp.experts." in n]
    assert len(experts) == config.num_hidden_layers * config.num_experts * 9
    for name in experts:
        hits = [(name.replace(weight, param), e, shard) for param, weight, e, shard in mapping if weight in name]
        assert len(hits) == 1, (name, hits)
        mapped, e, shard = hits[0]
        expert, proj = name.split(".mlp.experts.")[1].split(".")[:2]
        assert int(expert) == e and shard_of[proj] == shard, name
        params.add(mapped.rsplit(".", 1)[1])
    # the parameters CompressedTensorsW4A4Nvfp4MoEMethod.create_weights registers for the checkpoint's tensors
    assert params == {f"w{i}_weight{s}" for i in (13, 2) for s in ("_packed", "_scale", "_global_scale")}
    ct = CompressedTensorsConfig.from_config(_config(path)["quantization_config"])
    assert should_ignore_layer("model.layers.1.mlp.gate", ignore=ct.ignore)
    assert not should_ignore_layer("model.layers.1.mlp.experts", ignore=ct.ignore)
    (scheme,) = ct.target_scheme_map.values()
    assert ct._is_nvfp4_format(scheme["weights"]) and scheme["input_activations"] is None
