"""``qerl_trl.trainer.moe_routing``: the trainer's and vLLM's expert choices for the same tokens (issue #54 item 5).

On the CPU: the agreement measure on routings built to agree, to differ at a tie and to differ far from one; the
trainer's routing read from a tiny Qwen3-MoE's routers (as its own router computes it); vLLM's read from an engine's
output (a stand-in ``LLM`` that returns what vLLM 0.24's ``enable_return_routed_experts`` returns); the option's
refusals. The real engine's side is the GPU suite's ``moe`` part.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from benchmarks import random_models as rm
from qerl_trl import QeRLGRPOConfig
from qerl_trl.trainer.moe_routing import check_routing, routers_of, routing_agreement, trainer_routing, vllm_routing
from tests.test_nvfp4_experts import MOE_TINY, tiny_moe


def _topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.topk(k, dim=-1).indices


def test_identical_routings_agree_everywhere():
    logits = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    idx = _topk(logits, 2)
    got = routing_agreement(idx, logits, idx.flip(-1))  # the order of the k choices does not matter
    assert got == {"tokens": 5, "layers": 3, "top_k": 2, "same_experts": 1.0, "same_slots": 1.0, "worst_layer": 1.0,
                   "disagreements": 0, "max_tie_gap": 0.0}  # fmt: skip


def test_a_choice_broken_at_a_tie_has_a_small_gap_and_one_far_from_a_tie_a_large_one():
    logits = torch.tensor([[[4.0, 3.0, 1.0000, 0.9999, -2.0, -3.0]], [[4.0, 3.0, 1.0, 0.0, -2.0, -3.0]]])
    trainer = _topk(logits, 3)  # experts {0, 1, 2} for both tokens
    tie = torch.tensor([[[0, 1, 3]], [[0, 1, 2]]])  # token 0: vLLM took 3 for 2, a tie in the trainer's logits
    got = routing_agreement(trainer, logits, tie)
    assert got["disagreements"] == 1 and got["same_experts"] == 0.5 and got["worst_layer"] == 0.5
    assert got["same_slots"] == round(5 / 6, 5) and 0 < got["max_tie_gap"] < 1e-3
    far = torch.tensor([[[0, 1, 2]], [[0, 1, 5]]])  # token 1: vLLM took 5 (logit -3) for 2 (logit 1)
    got = routing_agreement(trainer, logits, far)
    assert got["disagreements"] == 1 and got["max_tie_gap"] == pytest.approx(4.0 / logits[1, 0].std().item(), 1e-4)


def test_routings_that_cannot_be_compared_are_refused():
    logits = torch.randn(4, 2, 8)
    idx = _topk(logits, 2)
    with pytest.raises(ValueError, match="different shapes"):
        routing_agreement(idx, logits, idx[:3])
    with pytest.raises(ValueError, match="the model has 8"):
        routing_agreement(idx, logits, torch.full_like(idx, 9))


def test_the_trainers_routing_is_what_its_routers_choose():
    model = tiny_moe(seed=1).eval()
    routers = routers_of(model)
    assert [n for n, _ in routers] == [f"model.layers.{i}.mlp.gate" for i in range(MOE_TINY["num_hidden_layers"])]
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    indices, logits = trainer_routing(model, ids)
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    assert indices.shape == (7, len(routers), k) and logits.shape == (7, len(routers), experts)
    assert torch.equal(indices.sort(-1).values, _topk(logits, k).sort(-1).values)
    assert not any(m._forward_hooks for _, m in routers)  # the hooks are gone
    hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states[0][0]  # layer 0's input
    want = routers[0][1].weight.float() @ model.model.layers[0].post_attention_layernorm(
        model.model.layers[0].self_attn(model.model.layers[0].input_layernorm(hidden)[None],
                                        position_embeddings=model.model.rotary_emb(hidden[None], torch.arange(7)[None]),
                                        attention_mask=None)[0][0] + hidden).float().T  # fmt: skip
    assert torch.allclose(logits[:, 0], want.T, atol=1e-4)


def test_a_dense_model_has_no_routing_to_check():
    from transformers import AutoModelForCausalLM, Qwen2Config

    dense = AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(ValueError, match="no MoE router"):
        trainer_routing(dense, torch.tensor([1, 2, 3]))


class FakeEngine:
    """An ``LLM`` that answers a one-token request with ``routed``, as vLLM 0.24 does with routing capture on (one
    row per prompt token and one for the sampled one)."""

    def __init__(self, routed):
        self.routed, self.calls, self.resets = routed, [], 0

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append((prompts, params, lora_request))
        out = types.SimpleNamespace(routed_experts=self.routed, token_ids=[0])
        return [types.SimpleNamespace(outputs=[out])]


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.SamplingParams`` where vLLM is not installed (CPU CI's main environment)."""
    if "vllm" not in sys.modules:
        try:
            import vllm  # noqa: F401
        except ImportError:
            monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))


def test_vllms_routing_is_read_from_the_output_of_a_fresh_prefill(fake_vllm):
    routed = np.arange(4 * 2 * 3).reshape(4, 2, 3) % 8
    engine = FakeEngine(routed)
    got = vllm_routing(engine, [5, 6, 7], lora_request="adapter")
    assert torch.equal(got, torch.as_tensor(routed[:3]).long())
    assert engine.resets == 1  # cached blocks would carry routing from before the last sync
    (prompts, params, request), = engine.calls
    assert prompts == [{"prompt_token_ids": [5, 6, 7]}] and request == "adapter"


def test_an_engine_without_routing_capture_says_which_option_turns_it_on(fake_vllm):
    with pytest.raises(ValueError, match="vllm_return_routed_experts=True"):
        vllm_routing(FakeEngine(None), [1, 2])
    with pytest.raises(ValueError, match="expected"):
        vllm_routing(FakeEngine(np.zeros((1, 2, 3))), [1, 2])


@pytest.mark.parametrize("adapters", [False, True])
def test_check_routing_compares_the_trainers_policy_with_its_engine(fake_vllm, adapters):
    from qerl_trl.trainer.vllm_serving.serving_llm import LoRAServingLLM

    model = tiny_moe(seed=2).train()
    ids = [3, 9, 4, 1, 7]
    own, _ = trainer_routing(model, torch.tensor(ids))
    engine = FakeEngine(np.concatenate([own.numpy(), own[-1:].numpy()]))
    proxy = LoRAServingLLM(engine, adapters=adapters)
    proxy.lora_request = "round-adapter" if adapters else None
    trainer = types.SimpleNamespace(model=model, vllm_generation=types.SimpleNamespace(llm=proxy))
    got = check_routing(trainer, ids)
    assert got["same_experts"] == 1.0 and got["disagreements"] == 0 and got["tokens"] == len(ids)
    assert engine.calls[0][2] == ("round-adapter" if adapters else None)  # the round's adapter under "vllm"
    assert model.training  # left as it was


def test_the_option_is_refused_where_no_moe_engine_runs(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", vllm_return_routed_experts=True)
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        QeRLGRPOConfig(**base, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="use_vllm=True"):
        QeRLGRPOConfig(**base)


def test_the_option_is_refused_for_a_model_without_routed_experts_before_it_loads(tmp_path):
    from transformers import Qwen2Config

    from qerl_trl.trainer.policy import check_vllm_layout

    args = QeRLGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                          use_vllm=True, vllm_mode="colocate", vllm_return_routed_experts=True)  # fmt: skip
    with pytest.raises(ValueError, match="no routed experts"):
        check_vllm_layout(Qwen2Config(num_hidden_layers=1), args)
    check_vllm_layout(rm.qwen3_moe_config("qwen3-30b-a3b", num_hidden_layers=1), args)  # a MoE passes
