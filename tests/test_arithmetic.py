"""The offline arithmetic tasks: prompts, answers, distinct problems, disjoint held-out sets."""

from __future__ import annotations

import pytest

from qerl_trl.study.tasks import TASKS, ArithmeticTask
from qerl_trl.rewards import number_reward


def test_dataset_prompt_answer_and_reward_agree():
    task = TASKS["add_small"]
    ds = task.dataset(5, seed=1)
    prompt = ds[0]["prompt"]
    assert task.prefix == "2 + 3 = 5\n7 + 5 = 12\n4 + 9 = 13\n"
    assert prompt.startswith(task.prefix) and prompt.endswith(" =")
    a, b = (int(x) for x in prompt.removeprefix(task.prefix).removesuffix(" =").split(" + "))
    assert (a, b) == (ds[0]["a"], ds[0]["b"]) and ds[0]["answer"] == str(a + b)
    # what the model writes after "a + b =" in the few-shot format, then whatever it rambles on with
    assert number_reward([f" {a + b}\n3 +", f" {a + b + 1}\n{a + b}"], answer=[ds[0]["answer"]] * 2) == [1.0, 0.0]
    assert task.dataset(5, seed=1)["answer"] == ds["answer"]  # deterministic


def test_demo_task_draws_the_same_problems_as_before_the_move():
    # the demo's README figures were measured on these problems (qerl_trl.demo.addition_problems, seed 0)
    assert TASKS["add_small"].problems(3, seed=0) == [(13, "+", 14), (2, "+", 9), (17, "+", 16)]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_problems_distinct_valid_and_held_out_disjoint(name):
    task = TASKS[name]
    held = task.problems(32, seed=7)
    n_free = task.count_free(held)
    train = task.problems(min(n_free, 3000), seed=0, exclude=held)
    assert len(set(held)) == 32 and len(set(train)) == len(train)
    assert not set(train) & set(held) and not (set(train) | set(held)) & set(task.few_shot)
    for a, op, b in train + held:
        assert op in task.ops and task.low <= a <= task.high and task.low <= b <= task.high
        assert task.answer((a, op, b)) >= 0
    if n_free <= 3000:
        with pytest.raises(ValueError, match="distinct"):
            task.problems(n_free + 1, seed=0, exclude=held)


def test_count_free_is_exact_for_subtraction():
    task = ArithmeticTask("t", ("+", "-"), 1, 3, ((1, "+", 1), (3, "-", 1)))
    every = [(a, op, b) for op in "+-" for a in range(1, 4) for b in range(1, 4) if op == "+" or a >= b]
    assert task.count_free() == len(every) - 2 == 13
    assert sorted(task.problems(13, seed=3)) == sorted(set(every) - {(1, "+", 1), (3, "-", 1)})


def test_bad_task_is_a_clear_error():
    with pytest.raises(ValueError, match="ops must be"):
        ArithmeticTask("t", ("*",), 1, 9, ())
    with pytest.raises(ValueError, match="low <= high"):
        ArithmeticTask("t", ("+",), 9, 1, ())
