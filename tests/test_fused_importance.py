"""``fused_importance_sampling``: the importance-sampling ratio from the training forward gives TRL's ratio, loss,
LoRA gradients, metrics and rollout-guard measure, with one forward pass fewer; where rounds are off-policy it is
refused before any model loads."""

from __future__ import annotations

import random

import pytest
import torch
from trl import GRPOTrainer

from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
from qerl_trl.trainer.fused_importance import IS_MODES, importance_sampling_ratio
from qerl_trl.trainer.rollout_guard import RolloutPolicyError, RolloutPolicyGuard
from tests.test_trainer_grpo import config, dataset, make_tokenizer, tiny_checkpoint, token_sum_reward  # noqa: F401

TRL_LOGPS = GRPOTrainer._get_per_token_logps_and_entropies  # unwrapped, before any test patches it
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


class FakeEngine:
    """Stands in for TRL's vLLM generation: fixed completions of varied length, and log-probs near the trainer's
    with a few NaN (what vLLM returns for a token it could not score)."""

    pending_norms = None
    last_sync_seconds = 0.0

    def __init__(self, seed: int, offset: float = 0.0):
        self.seed, self.offset = seed, offset

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        rng = random.Random(self.seed)
        completions, logprobs = [], []
        for i, _ in enumerate(prompts):
            n = 6 if i % 3 else 3  # some completions end early: the mask matters
            completions.append([rng.randrange(10, 200) for _ in range(n)])
            logprobs.append([[None] if (i, t) == (1, 2) else [rng.uniform(-7.0, -4.0) + self.offset] for t in range(n)])
        return prompts, completions, logprobs, None


def as_vllm_trainer(trainer: QeRLGRPOTrainer, fused: bool, mode: str, engine: FakeEngine) -> QeRLGRPOTrainer:
    """The CPU trainer with TRL's vLLM path switched on around a fake engine (TRL's own tests build trainers bare)."""
    trainer.use_vllm = True
    trainer.vllm_generation = engine
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = 0.5 if mode.endswith("mask") else None
    trainer.vllm_importance_sampling_clip_max = 2.0 if mode.endswith("mask") else 3.0
    trainer._fused_is = fused
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train()
    if trainer._rollout_guard is None:  # built in __init__ only with use_vllm
        trainer._rollout_guard = RolloutPolicyGuard(2.0)
    trainer.model.train()
    return trainer


def one_round(trainer: QeRLGRPOTrainer, monkeypatch) -> dict:
    forwards = []
    original = TRL_LOGPS

    def counted(self, *args, **kwargs):
        forwards.append(torch.is_grad_enabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    trainer._metrics["train"].clear()
    batch = [{"prompt": f"w{i} w{i + 3} w{2 * i + 1}"} for i in range(4)]
    inputs = trainer._generate_and_score_completions(batch)
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {
        "loss": loss.detach(), "ratio": inputs["importance_sampling_ratio"].detach(), "grads": grads,
        "forwards": forwards, "metrics": {k: trainer._metrics["train"][k][-1] for k in METRICS},
        "old_logps": inputs.get("old_per_token_logps"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def cpu_trainer(tiny_checkpoint, tmp_path_factory):  # noqa: F811
    return QeRLGRPOTrainer(
        model=tiny_checkpoint, reward_funcs=token_sum_reward,
        args=config(tmp_path_factory.mktemp("fis"), aqn=False, vllm_max_logprob_gap=2.0), train_dataset=dataset(),
        processing_class=make_tokenizer(),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", IS_MODES)
def test_fused_ratio_loss_and_gradients_equal_trls_with_one_forward_fewer(cpu_trainer, mode, monkeypatch):
    trl = one_round(as_vllm_trainer(cpu_trainer, False, mode, FakeEngine(7)), monkeypatch)
    trl_guard = cpu_trainer._rollout_guard.last
    fused = one_round(as_vllm_trainer(cpu_trainer, True, mode, FakeEngine(7)), monkeypatch)

    assert trl["forwards"] == [False, True], "TRL: a no-grad forward over the round, then the training forward"
    assert fused["forwards"] == [True], "fused: the training forward only"
    assert trl["old_logps"] is not None and fused["old_logps"] is None
    torch.testing.assert_close(fused["ratio"], trl["ratio"], rtol=1e-5, atol=1e-6)
    assert (trl["ratio"] != 1).any() and (mode.endswith("truncate") or (trl["ratio"] == 0).any())
    torch.testing.assert_close(fused["loss"], trl["loss"], rtol=1e-5, atol=1e-7)
    assert trl["grads"].keys() == fused["grads"].keys() and trl["grads"]
    assert all("lora_" in n for n in trl["grads"])
    for name in trl["grads"]:
        torch.testing.assert_close(fused["grads"][name], trl["grads"][name], rtol=1e-4, atol=1e-7)
    assert fused["metrics"] == pytest.approx(trl["metrics"], rel=1e-5)

    cpu_trainer._judge_fused_round()  # the fused round is judged when the next one starts
    assert cpu_trainer._rollout_guard.last == pytest.approx(trl_guard, rel=1e-5)
    assert cpu_trainer.vllm_importance_sampling_correction, "TRL's flag is back after the fused round"


@pytest.mark.slow
def test_fused_rounds_off_the_trained_policy_still_stop_the_run(cpu_trainer, monkeypatch):
    as_vllm_trainer(cpu_trainer, True, "token_truncate", FakeEngine(3, offset=-20.0))
    cpu_trainer._rollout_guard.bad_rounds.clear()
    with pytest.raises(RolloutPolicyError, match="not coming from the policy being trained"):
        for _ in range(4):  # three bad rounds, each judged when the next starts
            one_round(cpu_trainer, monkeypatch)


@pytest.mark.slow
def test_the_last_fused_round_is_judged_when_training_ends(cpu_trainer, monkeypatch):
    """No next round starts after the last one: ``train()`` judges it (the GPU suite's server and DDP jobs counted
    one guard verdict fewer than rounds with the fused pass on)."""
    as_vllm_trainer(cpu_trainer, True, "token_truncate", FakeEngine(5))
    cpu_trainer._round_gap = None
    judged = []
    monkeypatch.setattr(cpu_trainer._rollout_guard, "update", lambda step, gap, nan, bad=None: judged.append(gap))
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: one_round(self, monkeypatch))
    cpu_trainer.train()
    assert len(judged) == 1 and judged[0] > 0
    assert cpu_trainer._round_gap is None


def test_ratio_masks_truncates_and_ignores_nan():
    trainer = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    sampling = torch.tensor([[-1.5, float("nan"), -3.0], [-1.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tok = importance_sampling_ratio(trainer, sampling, mask, "token_truncate", None, 3.0)
    torch.testing.assert_close(tok, torch.tensor([[1.6487, 1.0, 3.0], [0.3679, 1.0, 1.0]]), rtol=1e-4, atol=1e-4)
    masked = importance_sampling_ratio(trainer, sampling, mask, "token_mask", 0.5, 2.0)
    assert masked.tolist()[0][2] == 0.0 and masked.tolist()[1][0] == 0.0 and masked.tolist()[0][1] == 1.0
    seq = importance_sampling_ratio(trainer, sampling, mask, "sequence_truncate", None, 100.0)
    assert seq.shape == (2, 1)
    torch.testing.assert_close(seq, torch.exp(torch.tensor([[2.5], [-1.0]])))
    with pytest.raises(ValueError, match="token_truncate"):
        importance_sampling_ratio(trainer, sampling, mask, "bogus", None, 3.0)


@pytest.mark.parametrize(
    "settings, why",
    [
        (dict(use_vllm=False), "use_vllm=True"),
        (dict(vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction=True"),
        (dict(num_iterations=2), "not on-policy"),
        (dict(gradient_accumulation_steps=3, steps_per_generation=2), "not on-policy"),
    ],
)
def test_off_policy_or_uncorrected_rounds_are_refused_before_any_model_loads(tmp_path, settings, why):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, per_device_train_batch_size=4,
                num_generations=4, fused_importance_sampling=True)  # fmt: skip
    with pytest.raises(ValueError, match=f"fused_importance_sampling=True cannot run here: .*{why}"):
        QeRLGRPOConfig(**{**base, **settings})
    ok = QeRLGRPOConfig(**{**base, "gradient_accumulation_steps": 4, "steps_per_generation": 2})
    assert ok.fused_importance_sampling
    assert QeRLGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).fused_importance_sampling is None


def test_none_takes_the_fused_pass_where_the_rounds_allow_it_and_trls_forward_elsewhere(tmp_path):
    from qerl_trl.trainer.fused_importance import fused_importance_enabled

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, per_device_train_batch_size=4,
                num_generations=4)  # fmt: skip
    auto = dict(base, fused_importance_sampling=None)
    assert fused_importance_enabled(QeRLGRPOConfig(**auto))
    for settings in (dict(num_iterations=2), dict(use_vllm=False), dict(vllm_importance_sampling_correction=False),
                     dict(gradient_accumulation_steps=3, steps_per_generation=2)):  # fmt: skip
        args = QeRLGRPOConfig(**{**auto, **settings})  # not refused: TRL's forward runs instead
        assert not fused_importance_enabled(args), settings
    assert fused_importance_enabled(QeRLGRPOConfig(**base, fused_importance_sampling=True))
    assert fused_importance_enabled(QeRLGRPOConfig(**base))  # the default: None, where the rounds allow it
    assert not fused_importance_enabled(QeRLGRPOConfig(**base, fused_importance_sampling=False))
