"""vLLM's own linear layers (QKV, merged gate/up, row-parallel o/down) with the single-LoRA method, on every rank of
a tensor-parallel group: after ``push_lora_in_place`` each layer's output is the trainer's ``x W^T + s x A^T B^T``.

The base weights go through vLLM's weight loaders; the inner linear method is a plain matmul so the LoRA layout and
sharding are checked apart from the NVFP4 kernel (the colocate GPU tests run the whole path on NVFP4).
Marked ``vllm``: it needs vLLM. On a GPU machine it runs on CUDA with NCCL (TP=2 needs two GPUs); with
``QERL_VLLM_ON_CPU=1`` and a vLLM install that imports on CPU, it runs on CPU with gloo.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_on_cpu]

# Marlin needs every partition's output a multiple of 64 and input a multiple of 128 (at TP 1 and 2)
HIDDEN, HEADS, KV_HEADS, HEAD, INTER, RANK, SCALING = 256, 8, 2, 32, 512, 4, 2.0
PREFIX = "model.layers.0"


def _device_setup() -> str:
    if os.environ.get("QERL_VLLM_ON_CPU") == "1":
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()  # a CUDA build of vLLM on a machine without a GPU
        return "cpu"
    return "cuda"


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (HEADS * HEAD, HIDDEN), "k_proj": (KV_HEADS * HEAD, HIDDEN), "v_proj": (KV_HEADS * HEAD, HIDDEN),
              "o_proj": (HIDDEN, HEADS * HEAD), "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
              "down_proj": (HIDDEN, INTER)}  # fmt: skip
    out = {}
    for name, (o, i) in shapes.items():
        out[name] = torch.randn(o, i, generator=g, dtype=torch.float32) / i**0.5
        out[name + ".A"] = torch.randn(RANK, i, generator=g, dtype=torch.float32) / i**0.5
        out[name + ".B"] = torch.randn(o, RANK, generator=g, dtype=torch.float32) / RANK**0.5
    return out


def _rank_job(tp_rank: int, tp_size: int, port: int, targets: list[str], mode: str, results) -> None:
    device = _device_setup()
    from torch import nn
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import (
        LinearMethodBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    from qerl_trl.vllm_plugin.single_lora import SingleLoRALinearMethod, push_lora_in_place

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    class PlainMethod(LinearMethodBase):
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra):  # fmt: skip
            from vllm.model_executor.parameter import ModelWeightParameter

            w = ModelWeightParameter(data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                                      dtype=params_dtype), input_dim=1, output_dim=0,
                                     weight_loader=extra["weight_loader"])  # fmt: skip
            layer.register_parameter("weight", w)

        def apply(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.weight, bias)

    class LoRAOnPlain(QuantizationConfig):
        def get_name(self):
            return "qerl-test"

        def get_supported_act_dtypes(self):
            return [torch.float32]

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            last = prefix.rsplit(".", 1)[-1]
            names = packed.get(last, [last])
            if any(n in targets for n in names):
                return SingleLoRALinearMethod(PlainMethod(), names, RANK)
            return PlainMethod()

    fp4_kernel = "marlin"
    expand = mode.endswith("+expand")  # vllm_lora_expand_in_gemm: B inside Humming's GEMM
    mode = mode.removesuffix("+expand")
    if mode.endswith("+humming"):  # Humming where the shape fits (o, gate_up, down), Marlin for qkv (k/v: 64 rows)
        fp4_kernel = "humming"
        mode = mode.removesuffix("+humming")
        if device == "cpu":
            _stand_in_humming(expand=expand)
    dtype = torch.float32 if mode == "plain" else torch.bfloat16
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision("highest")  # plain mode compares fp32 to 1e-5: no TF32 on a GPU
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=tp_rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo" if device == "cpu" else "nccl")  # fmt: skip
        initialize_model_parallel(tp_size)
        if device == "cuda":
            torch.cuda.set_device(tp_rank)

        def serve(ahead: bool, expand: bool = False):
            """Build the four layers (with ``ahead``: Humming's kernels compiled ahead; ``expand``: the LoRA's B
            inside Humming's GEMM), load, push, compare."""
            torch.set_default_device(device)
            if mode == "plain":
                q = LoRAOnPlain()
            else:  # the registered quantization config on a compressed-tensors NVFP4A16 config (what the engine builds)
                from qerl_trl.quantizer.checkpoint import compressed_tensors_config
                from qerl_trl.vllm_plugin import lora_quantization_overrides
                from qerl_trl.vllm_plugin.single_lora import QeRLNVFP4LoRAConfig

                if device == "cpu":
                    _dequantizing_nvfp4_kernel()
                ct = {"quantization_config": compressed_tensors_config([])}
                q = QeRLNVFP4LoRAConfig.from_config(
                    lora_quantization_overrides(ct, RANK, targets, fp4_kernel, humming_ahead=ahead,
                                                expand_in_gemm=expand)["quantization_config"])  # fmt: skip
                q.packed_modules_mapping = packed
            qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=q,
                                    prefix=f"{PREFIX}.self_attn.qkv_proj")  # fmt: skip
            o = RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, quant_config=q, prefix=f"{PREFIX}.self_attn.o_proj")
            # with expand, gate_up has a bias: a biased Humming layer's tail is transformed without it (Qwen2.5's
            # q/k/v on Humming failed their first sync at b557732; here q/k/v run on Marlin)
            gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=expand, quant_config=q,
                                                 prefix=f"{PREFIX}.mlp.gate_up_proj")  # fmt: skip
            down = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=q, prefix=f"{PREFIX}.mlp.down_proj")
            torch.set_default_device("cpu")

            full = _full_weights()
            if expand:  # B well inside its base weight's range, as in training (else its NVFP4 clips); A larger, so
                for name in ALL:  # the LoRA still moves the outputs by 10% of their largest entry (a check that bites)
                    full[name + ".A"] = full[name + ".A"] * 16
                    full[name + ".B"] = full[name + ".B"] / 64
            if mode == "plain":
                for shard, name in zip("qkv", ["q_proj", "k_proj", "v_proj"]):
                    qkv.weight.weight_loader(qkv.weight, full[name], shard)
                for shard, name in enumerate(["gate_proj", "up_proj"]):
                    gate_up.weight.weight_loader(gate_up.weight, full[name], shard)
                o.weight.weight_loader(o.weight, full["o_proj"])
                down.weight.weight_loader(down.weight, full["down_proj"])
            else:
                _load_nvfp4(full, qkv, zip("qkv", ["q_proj", "k_proj", "v_proj"]))
                _load_nvfp4(full, gate_up, enumerate(["gate_proj", "up_proj"]))
                if expand:
                    for shard, name in enumerate(["gate_proj", "up_proj"]):
                        bias = torch.randn(INTER, generator=torch.Generator().manual_seed(5 + shard)).to(dtype)
                        gate_up.bias.weight_loader(gate_up.bias, bias, shard)
                        full[name + ".bias"] = bias.float()
                _load_nvfp4(full, o, [(None, "o_proj")])
                _load_nvfp4(full, down, [(None, "down_proj")])
            for layer in (qkv, o, gate_up, down):
                layer.quant_method.process_weights_after_loading(layer)
            if fp4_kernel == "humming":
                from qerl_trl.vllm_plugin.single_lora import fp4_kernels_of

                got = fp4_kernels_of(nn.ModuleDict({"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}))
                want = "humming+expand" if expand else "humming"  # the LoRA's expand inside Humming's GEMM
                assert got["o"] == got["gate_up"] == got["down"] == want, got
                assert got["qkv"].startswith("marlin: ") and "not a multiple of 128" in got["qkv"], got
                if ahead:
                    _check_humming_ahead(q, {"o": o, "gate_up": gate_up, "down": down}, qkv)

            tree = nn.Module()
            tree.model = nn.Module()
            tree.model.layers = nn.ModuleList([nn.Module()])
            tree.model.layers[0].self_attn = nn.ModuleDict({"qkv_proj": qkv, "o_proj": o})
            tree.model.layers[0].mlp = nn.ModuleDict({"gate_up_proj": gate_up, "down_proj": down})
            adapters = {}
            for name in targets:
                group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                adapters[f"{PREFIX}.{group}.{name}"] = (full[name + ".A"], full[name + ".B"])
            filled = push_lora_in_place(tree, adapters, SCALING)

            x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype).float()
            xo = torch.randn(5, HEADS * HEAD, generator=torch.Generator().manual_seed(2)).to(dtype).float()
            xd = torch.randn(5, INTER, generator=torch.Generator().manual_seed(3)).to(dtype).float()
            dev = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731

            tail_b = _expand_tail_b(qkv, o, gate_up, down, full) if expand else {}

            def ref(name, inp):
                y = inp @ full[name].T + full.get(name + ".bias", 0.0)
                if name in targets:  # with expand: B as the Humming layers hold it, NVFP4 against each row's scale
                    b = tail_b.get(name, SCALING * full[name + ".B"])
                    y = y + (inp @ full[name + ".A"].T) @ b.T
                return y

            def rel(got, want):  # max error relative to the largest reference entry
                return (got - want).abs().max() / want.abs().max()

            errs = {}
            out = qkv(dev(x))[0].float().cpu()
            local_q, local_kv = HEADS * HEAD // tp_size, max(1, KV_HEADS // tp_size) * HEAD
            kv_shard = tp_rank // max(1, tp_size // KV_HEADS)
            got_q, got_k, got_v = out.split([local_q, local_kv, local_kv], dim=1)
            errs["q_proj"] = rel(got_q, ref("q_proj", x)[:, tp_rank * local_q : (tp_rank + 1) * local_q])
            errs["k_proj"] = rel(got_k, ref("k_proj", x)[:, kv_shard * local_kv : (kv_shard + 1) * local_kv])
            errs["v_proj"] = rel(got_v, ref("v_proj", x)[:, kv_shard * local_kv : (kv_shard + 1) * local_kv])
            local_i = INTER // tp_size
            got_g, got_u = gate_up(dev(x))[0].float().cpu().split([local_i, local_i], dim=1)
            errs["gate_proj"] = rel(got_g, ref("gate_proj", x)[:, tp_rank * local_i : (tp_rank + 1) * local_i])
            errs["up_proj"] = rel(got_u, ref("up_proj", x)[:, tp_rank * local_i : (tp_rank + 1) * local_i])
            lo = HEADS * HEAD // tp_size
            errs["o_proj"] = rel(o(dev(xo[:, tp_rank * lo : (tp_rank + 1) * lo]))[0].float().cpu(), ref("o_proj", xo))
            down_in = dev(xd[:, tp_rank * local_i : (tp_rank + 1) * local_i])
            errs["down_proj"] = rel(down(down_in)[0].float().cpu(), ref("down_proj", xd))
            # pushing nothing zeroes every LoRA slot: the layers serve the bare base again (clear_lora does this)
            assert push_lora_in_place(tree, {}, SCALING) == filled
            bare = qkv(dev(x))[0].float().cpu()[:, :local_q]
            errs["bare_base"] = rel(bare, (x @ full["q_proj"].T)[:, tp_rank * local_q : (tp_rank + 1) * local_q])
            push_lora_in_place(tree, adapters, SCALING)
            bare_q = (x @ full["q_proj"].T)[:, tp_rank * local_q : (tp_rank + 1) * local_q]
            lora_moves = float((qkv(dev(x))[0].float().cpu()[:, :local_q] - bare_q).abs().max())
            return errs, filled, lora_moves

        if expand:
            errs, filled, lora_moves = serve(False, expand=True)
            results.put((tp_rank, {k: float(v) for k, v in errs.items()}, filled, lora_moves))
            return
        errs, filled, lora_moves = serve(False)
        if fp4_kernel == "humming":  # the same layers again with vllm_humming_compile_ahead, in this process
            if device == "cpu":
                _stand_in_humming(ahead=True)
            more, filled_ahead, moves_ahead = serve(True)
            assert filled_ahead == filled
            errs.update({f"{k}+ahead": v for k, v in more.items()})
            lora_moves = min(lora_moves, moves_ahead)
    results.put((tp_rank, {k: float(v) for k, v in errs.items()}, filled, lora_moves))


def _expand_tail_b(qkv, o, gate_up, down, full: dict) -> dict[str, torch.Tensor]:
    """Each LoRA'd module's B (scaling folded in) as this rank's expand-in-GEMM layers hold it: their
    ``qerl_lora_b`` quantized against each row's second scale and dequantized, at the module's rows that this rank
    serves (the rest zero: the comparison takes only this rank's rows). qkv is on Marlin: the two-launch pair."""
    from qerl_trl.nvfp4.format import e2m1_lut, quantize_rows, unpack_fp4
    from qerl_trl.vllm_plugin.humming_tail import tail_width

    assert not qkv.qerl_expand_in_gemm and "not Humming" in qkv.qerl_expand_in_gemm_why
    out = {}
    for layer, names in ((o, ["o_proj"]), (gate_up, ["gate_proj", "up_proj"]), (down, ["down_proj"])):
        assert layer.qerl_expand_in_gemm, layer.qerl_expand_in_gemm_why
        b = layer.qerl_lora_b.float()
        b = torch.nn.functional.pad(b, (0, tail_width(b.shape[1]) - b.shape[1]))
        packed, scales, saturated = quantize_rows(b, layer.qerl_tail_row_scale)
        assert not bool(saturated)
        n, k = b.shape
        vals = e2m1_lut(b.device)[unpack_fp4(packed).long()].reshape(n, k // 16, 16)
        bq = (vals * scales.float().unsqueeze(-1) * layer.qerl_tail_row_scale.reshape(n, 1, 1)).reshape(n, k).cpu()
        for j, slot in enumerate(layer.qerl_lora_plan.slots):
            mine = torch.zeros_like(full[names[j] + ".B"])
            held = bq[slot.out_start : slot.out_start + slot.out_rows, j * RANK : (j + 1) * RANK]
            mine[slot.src_out_start : slot.src_out_start + slot.out_rows] = held
            out[names[j]] = mine
    return out


def _check_humming_ahead(config, humming_layers: dict, marlin_layer) -> None:
    """Every Humming layer runs the engine's table (up to its token budget, the last interval open-ended), and the
    background thread compiled each distinct layer's kernels once, without a failure; the Marlin layer has none."""
    import json

    from vllm.config import get_current_vllm_config

    from qerl_trl.vllm_plugin.humming_ahead import ANY_ROWS

    scheduler = get_current_vllm_config().scheduler_config
    budget = scheduler.max_num_batched_tokens
    ahead = config.humming_ahead
    assert ahead is not None and ahead.max_rows == budget, (ahead, budget)
    assert ahead.decode_rows == min(scheduler.max_num_seqs, budget), (ahead.decode_rows, scheduler.max_num_seqs)
    for name, layer in humming_layers.items():
        method = layer.quant_method.inner  # SingleLoRALinearMethod over FP4KernelByShape
        assert method.ahead is ahead and method.tuning_config is not None, name
        table = json.loads(method.tuning_config)
        assert table[-1][1] == ANY_ROWS and all(lo < budget for lo, _, _ in table), (name, table)
    assert marlin_layer.quant_method.inner.tuning_config is None
    ahead.kernels.wait()
    assert not ahead.kernels.failed, ahead.kernels.failed
    assert len(ahead.kernels.done) == 3, ahead.kernels.done  # o, gate_up and down: three shapes


def _load_nvfp4(full: dict, layer, shards) -> None:
    """Quantize the layer's full weights (one global scale per packed layer, as our checkpoints do), load them through
    vLLM's weight loaders, and keep the dequantized weights in ``full`` as the reference."""
    from qerl_trl.nvfp4.format import compute_global_scale, dequantize, quantize

    shards = list(shards)
    gs = compute_global_scale(*(full[name] for _, name in shards))
    for shard, name in shards:
        qw = quantize(full[name], gs, name=name)
        full[name] = dequantize(qw.weight_packed, qw.weight_scale, qw.weight_global_scale, torch.float32)
        for attr in ("weight_packed", "weight_scale", "weight_global_scale"):
            param = getattr(layer, attr)
            args = (param, getattr(qw, attr)) if shard is None else (param, getattr(qw, attr), shard)
            param.weight_loader(*args)


def _dequantizing_nvfp4_kernel() -> None:
    """On CPU (no Marlin): vLLM's compressed-tensors NVFP4A16 scheme with a kernel that dequantizes and matmuls."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4 as ct

    from qerl_trl.nvfp4.format import dequantize

    class DequantKernel:
        def input_quant_key(self):
            return None  # weight-only: the input stays bf16

        def process_weights_after_loading(self, layer):
            pass

        def apply_weights(self, layer, x, bias=None):
            # vLLM has inverted the checkpoint's global scale into a multiplier by now
            w = dequantize(layer.weight, layer.weight_scale, 1.0 / layer.weight_global_scale.reshape(1), torch.float32)
            y = (x.float() @ w.T).to(x.dtype)
            return y if bias is None else y + bias

    ct.init_nvfp4_linear_kernel = lambda use_a16=False: DequantKernel()


def _stand_in_humming(ahead: bool = False, expand: bool = False) -> None:
    """On CPU (no Humming kernels): the compressed-tensors scheme's own weights and dequantizing forward, under the
    class name of vLLM's Humming method, so the per-shape dispatch, its weight loader and the LoRA on top run.
    ``ahead``: Humming's layer config, tuning table, compile and forward stand-ins for :mod:`.humming_ahead` (a
    table reaching 8192 rows; the forward checks that it gets the layer's cut table). ``expand``: the processed
    weight and scales held with K along the rows, as Humming's transform holds them, a layer meta with its (widened)
    width, and ``humming.transform`` doing that transform, so :mod:`.humming_tail` writes B's tail as on a GPU."""
    import dataclasses
    import json
    import sys
    import types

    from torch import nn
    from vllm.model_executor.layers.linear import LinearMethodBase

    from qerl_trl.nvfp4.format import dequantize

    from qerl_trl.vllm_plugin import humming_ahead
    from qerl_trl.vllm_plugin.single_lora import QeRLNVFP4LoRAConfig

    class Meta:
        def __init__(self, shape):
            self.shape = shape

        def to_str(self):
            return json.dumps({"shape": self.shape})

    def table(layer_config, compute_config, device):
        assert compute_config == '{"gemm_type": "dense"}', compute_config
        return [[0, 8, {"block": 8}], [8, 1024, {"block": 64}], [1024, 4096, {"block": 128}],
                [4096, 1 << 30, {"block": 256}]]  # fmt: skip

    def forward(layer, x, compute_config, tuning_config):
        method = layer.quant_method.inner
        assert tuning_config == method.tuning_config is not None
        return method.chosen.apply(layer, x)

    class HummingLinearMethod(LinearMethodBase):
        def __init__(self, scheme):
            self.scheme = scheme  # taken before the dispatcher drops layer.scheme

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra):  # fmt: skip
            self.scheme.create_weights(layer=layer, input_size=input_size, output_size=output_size,
                                       input_size_per_partition=input_size_per_partition, params_dtype=params_dtype,
                                       output_partition_sizes=output_partition_sizes,
                                       weight_loader=extra["weight_loader"])  # fmt: skip

        def process_weights_after_loading(self, layer):
            self.scheme.process_weights_after_loading(layer)
            self.compute_config = '{"gemm_type": "dense"}'
            if not expand:
                layer.humming_metas = {"": Meta([layer.output_size_per_partition, layer.input_size_per_partition])}
                return
            layer.humming_metas = {"": RowsMeta(shape_k=layer.input_size_per_partition,
                                                has_bias=getattr(layer, "bias", None) is not None)}  # fmt: skip
            for name in ("weight", "weight_scale"):
                setattr(layer, name, nn.Parameter(getattr(layer, name).data.t().contiguous(), requires_grad=False))

        def apply(self, layer, x, bias=None):
            if not expand:
                return self.scheme.apply_weights(layer, x, bias=bias)
            w = dequantize(layer.weight.data.t().contiguous(), layer.weight_scale.data.t().contiguous(),
                           1.0 / layer.weight_global_scale.reshape(1), torch.float32)  # fmt: skip
            y = (x.float() @ w.T).to(x.dtype)
            return y if bias is None else y + bias

    @dataclasses.dataclass
    class RowsMeta:
        shape_k: int
        pad_shape_k: int = 0
        has_bias: bool = False

    def transform_humming_tensors(meta, tensors):
        assert tensors["weight"].shape[1] * 8 == meta.shape_k - meta.pad_shape_k  # int32: 8 codes each
        assert "bias" in tensors or not meta.has_bias, "bias is required by humming"  # Humming's schema check
        return {"weight": tensors["weight"].view(torch.uint8).t().contiguous(),
                "weight_scale": tensors["weight_scale"].t().contiguous()}  # fmt: skip

    if expand:
        transform = types.ModuleType("humming.transform")
        transform.transform_humming_tensors = transform_humming_tensors
        sys.modules.setdefault("humming", types.ModuleType("humming")).transform = transform
        sys.modules["humming.transform"] = transform

    QeRLNVFP4LoRAConfig.humming_method = lambda self, layer, prefix: HummingLinearMethod(layer.scheme)
    if ahead:
        humming_ahead._humming_table = table
        humming_ahead._humming_prepare = lambda *key: json.loads(key[2])  # "compiles" the cut table it is given
        humming_ahead.HummingAhead.apply = staticmethod(forward)


def _run(tp_size: int, targets: list[str], mode: str = "plain") -> list:
    pytest.importorskip("vllm")
    if os.environ.get("QERL_VLLM_ON_CPU") != "1" and torch.cuda.device_count() < tp_size:
        pytest.skip(f"needs {tp_size} GPU(s) (or QERL_VLLM_ON_CPU=1 with a vLLM that imports on CPU)")
    from benchmarks._child import free_port

    # CUDA needs a fresh process per rank; on the CPU (CI) a fork shares the parent's imported torch and vLLM, where
    # each spawned rank spent seconds of CI's 2 cores importing them again (15 ranks over this file's cases)
    on_cpu = os.environ.get("QERL_VLLM_ON_CPU") == "1" and not torch.cuda.is_initialized()
    ctx = torch.multiprocessing.get_context("fork" if on_cpu else "spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_job, args=(r, tp_size, port, targets, mode, results)) for r in range(tp_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return sorted(results.get(timeout=10) for _ in procs)


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_shard_layout_serves_the_trainers_lora(tp_size):
    for tp_rank, errs, filled, moves in _run(tp_size, ALL):
        assert filled == 4, (tp_rank, filled)  # qkv, o, gate_up, down
        assert max(errs.values()) < 1e-5, (tp_rank, errs)
        assert moves > 1e-2, "the LoRA changed nothing: the check would pass without it"


def test_untargeted_linears_keep_the_plain_method_and_partly_targeted_packs_get_zeros():
    (_, errs, filled, _), = _run(1, ["q_proj", "v_proj", "down_proj"])
    assert filled == 2  # qkv (k without LoRA) and down; o and gate_up carry no LoRA buffers at all
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("tp_size,mode", [(1, "nvfp4"), (2, "nvfp4"), (1, "nvfp4+humming"),
                                          (1, "nvfp4+humming+expand"), (2, "nvfp4+humming+expand")])  # fmt: skip
def test_the_registered_config_serves_the_lora_on_compressed_tensors_nvfp4a16(tp_size, mode):
    """QeRLNVFP4LoRAConfig on vLLM's compressed-tensors NVFP4A16 scheme (Marlin on a GPU; on CPU a dequantizing
    stand-in for Marlin): FP4 base + LoRA within bf16 rounding of the dequantized reference, through the LoRA
    kernel pair (on a GPU, the shrink on its side stream). ``+humming``:
    ``fp4_kernel="humming"``, Humming's real kernels on a GPU (a stand-in on CPU) on every layer but qkv, whose
    64-row k/v shards Humming cannot take (Marlin); then the same with ``humming_ahead`` (Humming's kernels compiled
    ahead, on the engine's table), in the same process. ``+expand``: ``vllm_lora_expand_in_gemm``, B inside
    Humming's GEMM as NVFP4 input columns on o, gate_up and down (qkv, on Marlin, keeps the pair); the reference
    takes B as those layers quantize it."""
    for tp_rank, errs, filled, moves in _run(tp_size, ALL, mode=mode):
        assert filled == 4, (tp_rank, filled)
        assert max(errs.values()) < 2e-2, (tp_rank, errs)  # bf16 activations, LoRA buffers and outputs
        assert moves > (0.5 / 4 if mode.endswith("+expand") else 0.5), moves  # +expand: A * 16, B / 64


def test_vllm_resolves_the_quantization_method_and_its_lora_spec(tmp_path):
    """What ``LLM(quantization="qerl_nvfp4_lora", hf_overrides=...)`` resolves, on a real NVFP4A16 checkpoint of
    ours: vLLM's override hook picks our method, and our config carries the LoRA's rank and targets."""
    pytest.importorskip("vllm")
    _device_setup()
    import json

    from test_examples import tiny_checkpoint
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    from qerl_trl.quantizer import quantize_checkpoint
    from qerl_trl.vllm_plugin import LORA_KEY, QUANT_NAME, lora_quantization_overrides, register
    from qerl_trl.vllm_plugin.single_lora import QeRLNVFP4LoRAConfig

    from peft import LoraConfig, get_peft_model

    from qerl_trl.quantizer.checkpoint import load_nvfp4
    from qerl_trl.trainer.vllm_serving import engine_norm_overrides, single_lora_engine_kwargs
    from qerl_trl.vllm_plugin.fp32_norms import FP32_NORMS_KEY

    register()
    ckpt = tmp_path / "nvfp4"
    quantize_checkpoint(str(tiny_checkpoint(tmp_path / "bf16")), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    # the engine arguments the trainer builds from its PEFT policy on this checkpoint
    policy = get_peft_model(load_nvfp4(str(ckpt)), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "gate_proj"]))
    kwargs = single_lora_engine_kwargs(str(ckpt), policy)
    assert kwargs["hf_overrides"] == lora_quantization_overrides(config, 16, ["q_proj", "gate_proj"])
    mc = ModelConfig(model=str(ckpt), dtype="bfloat16", **kwargs)
    assert mc.quantization == QUANT_NAME
    qc = get_quant_config(mc, LoadConfig())
    assert isinstance(qc, QeRLNVFP4LoRAConfig) and qc.get_name() == QUANT_NAME
    assert qc.lora_rank == 16 and qc.lora_targets == {"q_proj", "gate_proj"}
    qc.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert qc.lora_names("model.layers.0.self_attn.qkv_proj") == ["q_proj", "k_proj", "v_proj"]
    assert qc.lora_names("model.layers.0.self_attn.o_proj") == []
    assert qc.lora_names("model.layers.0.mlp.gate_up_proj") == ["gate_proj", "up_proj"]

    # with AQN, the trainer adds its float32 norms to the same overrides: vLLM's HF config carries both, and the load
    # hook (the one a `qerl-trl vllm-serve` engine uses) reads the norms from there
    norms = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    overrides = engine_norm_overrides(reversed(norms), kwargs["hf_overrides"])
    assert overrides == {**kwargs["hf_overrides"], FP32_NORMS_KEY: norms}
    assert FP32_NORMS_KEY not in kwargs["hf_overrides"]  # the backend's own arguments are left as they were
    mc = ModelConfig(model=str(ckpt), dtype="bfloat16", quantization=kwargs["quantization"], hf_overrides=overrides)
    assert mc.quantization == QUANT_NAME and getattr(mc.hf_config, FP32_NORMS_KEY) == norms
    assert engine_norm_overrides([], None) is None and engine_norm_overrides([], {"a": 1}) == {"a": 1}

    # without the override, the same checkpoint stays plain compressed-tensors (today's vLLM-LoRA path)
    assert ModelConfig(model=str(ckpt), dtype="bfloat16").quantization == "compressed-tensors"
    with pytest.raises(ValueError, match=LORA_KEY):
        QeRLNVFP4LoRAConfig.from_config(config["quantization_config"])
