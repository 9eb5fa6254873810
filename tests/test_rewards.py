"""Answer extraction and the math rewards (TRL reward-function signature)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from qerl_trl import rewards as R


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She pays 3 * 4 = 12.\n#### 12", "12"),
        ("#### 1,234", "1234"),
        ("first #### 5 then #### -7.5", "-7.5"),
        ("#### $18", "18"),
        ("no marker 42", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert R.extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{3}} and later \boxed{\frac{2}{3}}", r"\frac{2}{3}"),
        (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{12", None),  # cut off inside the box
        ("nothing", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert R.extract_boxed_answer(text) == expected


def test_normalize_number_and_match():
    assert R.normalize_number("1,000") == Fraction(1000)
    assert R.normalize_number("2.50") == Fraction(5, 2)
    assert R.normalize_number("abc") is None
    assert R.answers_match("1000.0", "1,000")
    assert R.answers_match("0.5", "1/2")
    assert not R.answers_match("12", "13")
    assert not R.answers_match(None, "1")
    assert R.answers_match(r"\frac{1}{2}", r"\dfrac{1}{2}")
    assert R.answers_match(r"\text{(B)}", "(b)")
    assert not R.answers_match(r"\frac{1}{3}", r"\frac{1}{2}")


def test_gsm8k_reward_plain_and_conversational():
    answers = ["Tom has 3+4=7 apples.\n#### 7"] * 4
    completions = [
        "3 + 4 = 7\n#### 7",  # marker
        [{"role": "assistant", "content": r"The answer is \boxed{7}"}],  # boxed, chat format
        "I think it is 8",  # wrong last number
        "7 apples, no wait, 6",  # last number wins -> wrong
    ]
    assert R.gsm8k_accuracy_reward(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0]


def test_boxed_reward_needs_box():
    sols = [r"Worked... so $\boxed{\frac{3}{4}}$", "0.75", "0.75"]
    comps = [r"\boxed{0.75}", r"\boxed{\frac{3}{4}}", "0.75"]
    assert R.boxed_accuracy_reward(comps, solution=sols) == [1.0, 1.0, 0.0]


def test_number_reward_first_number():
    assert R.number_reward(["71", " 71 because", "70, no 71", "none"], answer=[71, "71", 71, 71]) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]


def test_format_reward():
    assert R.format_reward(["#### 3", r"\boxed{x}", "3"]) == [0.5, 0.5, 0.0]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        R.gsm8k_accuracy_reward(["#### 1"], answer=["#### 1", "#### 2"])


def test_bad_completion_type():
    with pytest.raises(TypeError, match="completion must be"):
        R.completion_text(3)
