"""AQNCallback: the trainer-facing contract, rollout vs rollout_and_policy, logging, resume, ranks, a real Trainer."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerState

from conftest import tiny_model
from qerl_trl.aqn import AQNSchedule, NormNoise, find_noise_targets, sample_noise, vllm_param_name
from test_aqn_targets import _lora

SCHED = AQNSchedule(1e-2, 1e-3, num_stages=3)  # max_steps=6: steps 0-1 clean, 2-3 σ=1e-2, 4-5 σ=1e-3


def state(step: int, max_steps: int = 6) -> TrainerState:
    return TrainerState(global_step=step, max_steps=max_steps)


def norms(model):
    return {t.name: t.module.weight for t in find_noise_targets(model)}


def test_exported_from_package():
    import qerl_trl
    from qerl_trl.aqn import AQNCallback

    assert qerl_trl.AQNCallback is AQNCallback and qerl_trl.AQNSchedule is AQNSchedule
    from transformers import TrainerCallback

    assert issubclass(AQNCallback, TrainerCallback)


def test_invalid_arguments():
    from qerl_trl import AQNCallback

    with pytest.raises(ValueError, match="apply_to"):
        AQNCallback(apply_to="policy")
    with pytest.raises(TypeError, match="seed"):
        AQNCallback(seed="1")
    with pytest.raises(TypeError, match="AQNSchedule"):
        AQNCallback(schedule=0.01)
    with pytest.raises(ValueError, match="max_steps"):
        AQNCallback().begin_rollout(tiny_model("llama"), state(0, max_steps=0))


def test_rollout_mode_returns_vllm_weights_and_keeps_hf_model_clean():
    from qerl_trl import AQNCallback

    model = _lora(tiny_model("llama"))
    clean = {n: w.detach().clone() for n, w in norms(model).items()}
    cb = AQNCallback(SCHED, seed=7)
    w = cb.begin_rollout(model, state(2))
    assert list(w) == [vllm_param_name(n) for n in clean]  # vLLM names: no "base_model.model." prefix
    assert all(k.startswith("model.layers.") for k in w)
    z = sample_noise(cb.noise_for(model).targets, 1e-2, seed=7, step=2)
    for (name, c), v in zip(clean.items(), w.values()):
        assert v.dtype == torch.float32 and torch.equal(v, c.float() + z[name])
    for n, p in norms(model).items():  # vLLM generation: the HF model is untouched
        assert p.dtype == torch.bfloat16 and torch.equal(p, clean[n])
    cb.end_rollout(model)
    assert cb.metrics(state(3)) == {"aqn/sigma": 1e-2, "aqn/stage": 1.0}

    # HF generation: noise applied in place for the rollout, removed after it.
    w = cb.begin_rollout(model, state(4), hf_generation=True)
    for (n, p), v in zip(norms(model).items(), w.values()):
        assert p.dtype == torch.float32 and torch.equal(p, v)
    cb.end_rollout(model)
    for n, p in norms(model).items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, clean[n])


def test_stage_zero_pushes_clean_weights():
    from qerl_trl import AQNCallback

    model = tiny_model("qwen2")
    cb = AQNCallback(SCHED, apply_to="rollout_and_policy")
    w = cb.begin_rollout(model, state(1), hf_generation=True)
    assert all(torch.equal(v, p.float()) for v, p in zip(w.values(), norms(model).values()))
    assert not cb.noise_for(model).is_applied
    assert cb.metrics(state(1)) == {"aqn/sigma": 0.0, "aqn/stage": 0.0}
    assert cb.clean_weights(model).keys() == w.keys()


def test_rollout_and_policy_lifecycle():
    from qerl_trl import AQNCallback

    model = tiny_model("llama")
    clean = {n: p.detach().clone() for n, p in norms(model).items()}
    cb = AQNCallback(SCHED, seed=3, apply_to="rollout_and_policy")
    args = control = None
    w = cb.begin_rollout(model, state(2))
    cb.end_rollout(model)
    noised = {n: p.detach().clone() for n, p in norms(model).items()}
    assert all(torch.equal(noised[n], v) for n, v in zip(noised, w.values()))  # kept for the loss forward
    cb.on_step_end(args, state(3), control)  # before save/eval: clean
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, clean[n]) for n, p in norms(model).items())
    cb.on_step_begin(args, state(3), control)  # next step trains on the same rollouts: same noise again
    assert all(torch.equal(p, noised[n]) for n, p in norms(model).items())
    w4 = cb.begin_rollout(model, state(4))  # new round: from clean, σ of stage 2
    z4 = sample_noise(cb.noise_for(model).targets, 1e-3, seed=3, step=4)
    assert all(torch.equal(p, clean[n].float() + z4[n]) for n, p in norms(model).items())
    assert all(torch.equal(v, clean[n].float() + z4[n]) for n, v in zip(clean, w4.values()))
    cb.on_train_end(args, state(6), control)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, clean[n]) for n, p in norms(model).items())


def test_resume_continues_schedule_and_noise():
    from qerl_trl import AQNCallback

    base = tiny_model("llama")
    sched = AQNSchedule()  # K=10
    uninterrupted = AQNCallback(sched, seed=1)
    m1 = copy.deepcopy(base)
    rounds = {s: uninterrupted.begin_rollout(m1, state(s, 100)) for s in (0, 10, 37, 38, 95)}
    metrics = uninterrupted.metrics(state(95, 100))
    assert metrics == {"aqn/sigma": 5e-4, "aqn/stage": 9.0}

    # A fresh process resumes at step 37 from a saved TrainerState: same σ, same stage, same noise.
    st = state(37, 100)
    resumed_state = TrainerState(**{k: getattr(st, k) for k in ("global_step", "max_steps")})
    resumed = AQNCallback(sched, seed=1)
    m2 = _lora(copy.deepcopy(base))
    got = resumed.begin_rollout(m2, resumed_state)
    assert resumed.metrics(resumed_state) == {"aqn/sigma": sched.sigma(37, 100), "aqn/stage": 3.0}
    assert got.keys() == rounds[37].keys() and all(torch.equal(got[k], rounds[37][k]) for k in got)
    assert not all(torch.equal(rounds[37][k], rounds[38][k]) for k in got)  # fresh noise every round


def test_same_noise_on_two_simulated_ranks():
    from qerl_trl import AQNCallback

    ranks = []
    for rank in range(2):
        torch.manual_seed(100 + rank)  # ranks' global RNGs differ; AQN must not use them
        model = tiny_model("qwen3")
        torch.rand(rank + 1)
        ranks.append(AQNCallback(SCHED, seed=5).begin_rollout(model, state(3)))
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


def test_on_log_adds_metrics_once():
    from qerl_trl import AQNCallback

    cb = AQNCallback(SCHED)
    st = state(4)
    logs = {"loss": 1.0}
    st.log_history.append({**logs, "step": 4})
    cb.on_log(None, st, None, logs=logs)
    assert logs["aqn/sigma"] == 1e-3 and logs["aqn/stage"] == 2.0 and st.log_history[-1]["aqn/stage"] == 2.0
    logs = {"loss": 1.0, "aqn/sigma": 0.5}  # the trainer merged metrics() itself: keep its values
    cb.on_log(None, st, None, logs=logs)
    assert logs["aqn/sigma"] == 0.5


def _run_trainer(tmp_path, apply_to, max_steps=6, resume=None, seed_model=0):
    """A real transformers Trainer loop that "generates" every 2 steps; records what the norms hold in each
    loss forward and at each checkpoint save."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from qerl_trl import AQNCallback

    model = _lora(tiny_model("llama", seed=seed_model))
    cb = AQNCallback(SCHED, seed=9, apply_to=apply_to)
    seen = {"loss": [], "save": [], "rollouts": {}}

    def norm_state():
        noise = cb._noise
        return None if noise is None or not noise.is_applied else noise.applied

    class ProbeSave(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            seen["save"].append((state.global_step, norm_state(),
                                 all(p.dtype == torch.bfloat16 for p in norms(model).values())))

    class RolloutTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            step = self.state.global_step
            if step % 2 == 0:  # "generate" every 2 optimizer steps, like steps_per_generation=2
                seen["rollouts"][step] = cb.begin_rollout(model, self.state)
                cb.end_rollout(model)
            seen["loss"].append((step, norm_state()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    data = [{"input_ids": torch.arange(i, i + 8) % 256, "labels": torch.arange(i, i + 8) % 256} for i in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-3,
        save_steps=3, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_only_model=False,
    )
    trainer = RolloutTrainer(model=model, args=args, train_dataset=data, callbacks=[cb, ProbeSave()])
    trainer.train(resume_from_checkpoint=resume)
    return seen, trainer


def test_trainer_loop_rollout_and_policy(tmp_path):
    seen, trainer = _run_trainer(tmp_path, "rollout_and_policy")
    # steps 0-1: stage 0 (no noise); 2-3 trained on round 2's noise; 4-5 on round 4's
    assert seen["loss"] == [(0, None), (1, None), (2, (1e-2, 9, 2)), (3, (1e-2, 9, 2)),
                            (4, (1e-3, 9, 4)), (5, (1e-3, 9, 4))]
    assert seen["save"] == [(3, None, True), (6, None, True)]  # checkpoints see clean bf16 norms
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [(h["step"], h["aqn/sigma"], h["aqn/stage"]) for h in logged] == [
        (1, 0.0, 0.0), (2, 0.0, 0.0), (3, 1e-2, 1.0), (4, 1e-2, 1.0), (5, 1e-3, 2.0), (6, 1e-3, 2.0)]


def test_trainer_loop_rollout_only_and_resume(tmp_path):
    seen, _ = _run_trainer(tmp_path / "full", "rollout")
    assert all(applied is None for _, applied in seen["loss"])  # the policy forward never sees the noise
    assert sorted(seen["rollouts"]) == [0, 2, 4]
    resumed, _ = _run_trainer(tmp_path / "full", "rollout", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert sorted(resumed["rollouts"]) == [4]
    a, b = seen["rollouts"][4], resumed["rollouts"][4]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_given_targets_are_the_ones_noised_without_a_new_trace(monkeypatch):
    """The trainer traces once and gives AQN the targets whose norms it keeps float32 in vLLM: the callback must not
    find others on the (PEFT-wrapped) model it is later handed."""
    from qerl_trl.aqn import noise as noise_module

    model = tiny_model("llama")
    targets = find_noise_targets(model)[:1]

    def no_trace(*a, **k):
        raise AssertionError("traced again")

    monkeypatch.setattr(noise_module, "find_noise_targets", no_trace)
    from qerl_trl.aqn import AQNCallback

    cb = AQNCallback(AQNSchedule(1e-2, 1e-2, 2), targets=targets)
    assert list(cb.begin_rollout(model, TrainerState(global_step=5, max_steps=10))) == [vllm_param_name(targets[0])]
