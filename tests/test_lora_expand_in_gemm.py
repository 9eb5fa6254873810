"""``vllm_lora_expand_in_gemm``: the LoRA's B as extra input columns of a Humming linear's NVFP4 weight
(``qerl_trl.vllm_plugin.humming_tail``), on CPU: B's quantization against each row's second scale, the widened
checkpoint tensors, the tail written over the last rows of a row-separable layout, and the option's plumbing.
Humming's own transform and GEMM run in the GPU suite (``tests/test_single_lora_vllm.py``, ``+expand`` cases)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from torch import nn

from qerl_trl.nvfp4.format import e2m1_lut, pack_fp4, quantize_rows, round_to_e2m1, unpack_fp4
from qerl_trl.vllm_plugin.humming_tail import (
    expand_in_gemm_problem,
    lora_tail_meta,
    tail_width,
    widen_for_lora_tail,
    write_lora_tail,
)


def _dequant_rows(packed: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    codes = unpack_fp4(packed)
    n, k = codes.shape
    vals = e2m1_lut()[codes.long()].reshape(n, k // 16, 16)
    return (vals * scales.float().unsqueeze(-1) * row_scale.float().reshape(n, 1, 1)).reshape(n, k)


def test_quantize_rows_rounds_each_block_against_its_rows_second_scale():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 48, generator=g) * 0.01
    b[2] = 0  # a zero row (the block-diagonal B's off-diagonal blocks)
    row_scale = torch.tensor([1e-4, 2e-4, 3e-4, 5e-5, 1e-4, 8e-5])
    packed, scales, saturated = quantize_rows(b, row_scale)
    assert packed.shape == (6, 24) and packed.dtype == torch.uint8
    assert scales.shape == (6, 3) and scales.dtype == torch.float8_e4m3fn
    assert not bool(saturated)
    got = _dequant_rows(packed, scales, row_scale)
    assert torch.equal(got[2], torch.zeros(48))
    blocks = b.reshape(6, 3, 16)
    # round to nearest on E2M1's grid: at most half the largest step (2 of 6) of each block's scale, plus the FP8
    # rounding of the scale itself (3 mantissa bits)
    step = blocks.abs().amax(-1, keepdim=True) / 6
    err = (got.reshape(6, 3, 16) - blocks).abs()
    assert bool((err <= step * 1.0 + 1e-12).all()), float((err / (step + 1e-12)).max())
    assert float((got - b).norm() / b.norm()) < 0.12


def test_quantize_rows_flags_a_block_past_fp8s_range():
    b = torch.full((2, 16), 1.0)
    packed, scales, saturated = quantize_rows(b, torch.tensor([1e-4, 1.0]))  # 1/6/1e-4 > 448: row 0 clips
    assert bool(saturated)
    assert float(scales.float()[0, 0]) == 448.0
    assert torch.allclose(_dequant_rows(packed, scales, torch.tensor([1e-4, 1.0]))[1], b[1], rtol=0.05)  # in range


def test_tail_width_and_which_layers_can_take_it():
    assert [tail_width(r) for r in (4, 8, 16, 32, 96, 100)] == [16, 16, 16, 32, 96, 112]
    assert expand_in_gemm_problem("humming", 3584) is None
    assert "not Humming" in expand_in_gemm_problem("marlin: MarlinNvFp4", 3584)
    assert "not a multiple of 128" in expand_in_gemm_problem("humming", 3584 + 64)


def _ct_layer(sizes: list[int], k: int, global_scales: list[float], seed: int = 0) -> nn.Module:
    """A linear's compressed-tensors NVFP4 tensors as vLLM 0.24's Humming method holds them after loading."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    layer = nn.Module()
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    layer.weight_packed = nn.Parameter(pack_fp4(codes), requires_grad=False)
    scales = (torch.rand(n, k // 16, generator=g) * 100 + 1).to(torch.float8_e4m3fn)
    layer.weight_scale = nn.Parameter(scales, requires_grad=False)
    layer.weight_global_scale = nn.Parameter(torch.tensor(global_scales), requires_grad=False)
    layer.output_partition_sizes = sizes
    layer.input_size_per_partition = k
    layer.param_dtype = torch.bfloat16
    return layer


@pytest.mark.parametrize("gs", [[2688.0, 2688.0], [2688.0, 1344.5]])
def test_widening_appends_zero_columns_and_records_each_rows_second_scale(gs):
    layer = _ct_layer([32, 32], 256, gs)
    before_w, before_s = layer.weight_packed.data.clone(), layer.weight_scale.data.clone()
    param = layer.weight_scale
    assert widen_for_lora_tail(layer, 16) == 256
    assert layer.weight_scale is param  # the same parameter, new data
    assert layer.weight_packed.shape == (64, 136) and layer.weight_scale.shape == (64, 17)
    assert layer.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight_packed.data[:, :128], before_w)
    assert torch.equal(layer.weight_scale.data[:, :16].view(torch.uint8), before_s.view(torch.uint8))
    assert not layer.weight_packed.data[:, 128:].any() and not layer.weight_scale.data[:, 16:].view(torch.uint8).any()
    rows = layer.qerl_tail_row_scale
    if gs[0] == gs[1]:  # Humming's TENSOR second scale: one float32 value
        assert layer.qerl_tail_scale_2.shape == (1,) and layer.qerl_tail_scale_2.dtype == torch.float32
        assert torch.equal(rows, torch.full((64,), 1 / 2688.0))
    else:  # CHANNEL: one per row, in the layer's dtype, as Humming rounds it
        assert layer.qerl_tail_scale_2.shape == (64,) and layer.qerl_tail_scale_2.dtype == torch.bfloat16
        want = torch.cat([torch.full((32,), 1 / 2688.0), torch.full((32,), 1 / 1344.5)]).to(torch.bfloat16).float()
        assert torch.equal(rows, want)


@dataclasses.dataclass
class _Meta:
    shape_k: int
    pad_shape_k: int = 0
    has_bias: bool = False


def _to_rows(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in for Humming's transform with its property that matters here: K runs along the rows (each 16
    inputs one row of scales, each 2 one row of the weight), N along the columns."""
    return packed.t().contiguous(), scales.t().contiguous()


@pytest.fixture
def stand_in_transform(monkeypatch):
    calls = []

    def transform_humming_tensors(meta, tensors):
        weight = tensors["weight"].view(torch.uint8)
        assert weight.shape[1] * 2 == meta.shape_k - meta.pad_shape_k
        if meta.has_bias:  # Humming 0.1.19's schema check (validate_tensors)
            assert "bias" in tensors, "bias is required by humming"
        calls.append(meta)
        w, s = _to_rows(weight, tensors["weight_scale"])
        return {"weight": w, "weight_scale": s, "weight_scale_2": tensors["weight_scale_2"]}

    humming = types.ModuleType("humming")
    transform = types.ModuleType("humming.transform")
    transform.transform_humming_tensors = transform_humming_tensors
    humming.transform = transform
    monkeypatch.setitem(sys.modules, "humming", humming)
    monkeypatch.setitem(sys.modules, "humming.transform", transform)
    return calls


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_sync_writes_b_over_the_tail_rows_and_nothing_else(stand_in_transform, bias):
    """After widening and "Humming's" transform (K along the rows), a sync writes B's NVFP4 tail over the last rows
    of the weight and scales: the base's rows keep their bytes, and the tail dequantizes to B (its pad columns 0).
    A layer with a bias (Qwen2.5's q/k/v) transforms its tail without one: the bias is the base GEMM's."""
    layer = _ct_layer([32, 32], 256, [2688.0, 1344.5])
    r_total = 8  # S*r = 2 * 4: padded to one NVFP4 block
    widen_for_lora_tail(layer, tail_width(r_total))
    w, s = _to_rows(layer.weight_packed.data, layer.weight_scale.data)  # what Humming's processing leaves
    layer.weight = nn.Parameter(w, requires_grad=False)
    layer.weight_scale = nn.Parameter(s, requires_grad=False)
    layer.humming_metas = {"": _Meta(shape_k=256 + 16, has_bias=bias)}
    layer.qerl_tail_meta = lora_tail_meta(layer)
    assert layer.qerl_tail_meta == _Meta(shape_k=16, has_bias=False)
    base_w, base_s = w[:128].clone(), s[:16].clone()

    b = torch.zeros(64, r_total, dtype=torch.bfloat16)
    b[:32, :4] = torch.randn(32, 4, generator=torch.Generator().manual_seed(3)) * 1e-3  # gate's block
    b[32:, 4:] = torch.randn(32, 4, generator=torch.Generator().manual_seed(4)) * 1e-3  # up's block
    layer.qerl_lora_b = b
    assert not bool(write_lora_tail(layer))
    assert len(stand_in_transform) == 1
    assert torch.equal(layer.weight.data[:128], base_w)
    assert torch.equal(layer.weight_scale.data[:16].view(torch.uint8), base_s.view(torch.uint8))
    tail_packed = layer.weight.data[128:].t()
    tail_scales = layer.weight_scale.data[16:].t()
    got = _dequant_rows(tail_packed.contiguous(), tail_scales.contiguous(), layer.qerl_tail_row_scale)
    assert torch.equal(got[:, r_total:], torch.zeros(64, 16 - r_total))
    assert torch.equal(got[:32, 4:8], torch.zeros(32, 4)) and torch.equal(got[32:, :4], torch.zeros(32, 4))
    assert float((got[:, :r_total] - b.float()).norm() / b.float().norm()) < 0.12


def test_the_option_reaches_the_engine_spec_on_humming_and_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    from qerl_trl import QeRLGRPOConfig
    from qerl_trl.trainer.vllm_serving import InLayerLoRABackend, VLLMServingSpec, in_layer_lora
    from qerl_trl.vllm_plugin import LORA_KEY, lora_quantization_overrides

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert QeRLGRPOConfig(**common).vllm_lora_expand_in_gemm is False
    assert QeRLGRPOConfig(**common, vllm_lora_expand_in_gemm=True).vllm_lora_expand_in_gemm is True
    for bad in (dict(vllm_lora_backend="vllm"), dict(vllm_fp4_kernel="marlin"),
                dict(use_vllm=True, vllm_mode="server")):  # fmt: skip
        with pytest.raises(ValueError, match="vllm_lora_expand_in_gemm=True puts the LoRA's B inside Humming"):
            QeRLGRPOConfig(**common, vllm_lora_expand_in_gemm=True, **bad)

    ct = {"quantization_config": {"quant_method": "compressed-tensors"}}
    plain = lora_quantization_overrides(ct, 8, ["q_proj"], "humming")["quantization_config"][LORA_KEY]
    on = lora_quantization_overrides(ct, 8, ["q_proj"], "humming", expand_in_gemm=True)["quantization_config"]
    assert "expand_in_gemm" not in plain and on[LORA_KEY] == {**plain, "expand_in_gemm": True}

    asked = []
    monkeypatch.setattr(in_layer_lora, "single_lora_engine_kwargs",
                        lambda ckpt, model, kernel, **kw: asked.append((kernel, kw["expand_in_gemm"])))  # fmt: skip
    for kernel, want in [("humming", True), ("marlin", False)]:
        spec = VLLMServingSpec(checkpoint=str(tmp_path), tokenizer=str(tmp_path), max_lora_rank=8, fp4_kernel=kernel,
                               expand_in_gemm=True)  # fmt: skip
        InLayerLoRABackend(spec).engine_kwargs(None)
        assert asked[-1] == (kernel, want)


def test_values_on_the_grid_come_back_exactly():
    """A block whose values lie on E2M1's grid times its scale is stored without error (codes as round_to_e2m1)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 1.0])
    row_scale = torch.tensor([0.25])
    packed, scales, _ = quantize_rows((grid * 0.25).reshape(1, 16), row_scale)  # block scale 1.0
    assert float(scales.float()) == 1.0
    assert torch.equal(unpack_fp4(packed)[0], round_to_e2m1(grid))
    assert torch.equal(_dequant_rows(packed, scales, row_scale)[0], grid * 0.25)


def test_the_trainer_says_how_many_linears_took_it_and_warns_when_none_did(tmp_path, caplog):
    """After the engine starts, the in-layer backend logs which LoRA'd linears run the expand inside Humming's GEMM
    (a warning when none does: on Marlin the option changes nothing); nothing is asked of an engine without it."""
    from qerl_trl.trainer.vllm_serving import InLayerLoRABackend, VLLMServingSpec

    class Engine:
        def __init__(self, layers):
            self.model, self.calls = nn.Module(), 0
            for i, why in enumerate(layers):
                layer = nn.Module()
                layer.qerl_expand_in_gemm, layer.qerl_expand_in_gemm_why = why is None, why
                self.model.add_module(f"l{i}", layer)

        def apply_model(self, fn):
            self.calls += 1
            return [fn(self.model)]

    def backend(kernel, on=True):
        return InLayerLoRABackend(VLLMServingSpec(checkpoint=str(tmp_path), tokenizer=str(tmp_path), max_lora_rank=8,
                                                  fp4_kernel=kernel, expand_in_gemm=on))  # fmt: skip

    with caplog.at_level("INFO"):
        backend("humming").attach(Engine([None, None, "its FP4 GEMM is 'marlin: x', not Humming"]))
    assert "2 of 3 LoRA'd linears run the LoRA's expand inside Humming's GEMM" in caplog.text
    assert "not Humming" in caplog.text and "WARNING" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        backend("humming").attach(Engine(["its input width on this rank (96) is not a multiple of 128"]))
    assert any(r.levelname == "WARNING" and "0 of 1" in r.message for r in caplog.records)
    for kernel, on in (("marlin", True), ("humming", False)):
        engine = Engine([None])
        backend(kernel, on).attach(engine)
        assert engine.calls == 0
