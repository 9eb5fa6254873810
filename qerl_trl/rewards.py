"""Math rewards for GRPO/DAPO in TRL's reward-function signature: answer extraction and comparison.

Two answer conventions cover the paper's data: GSM8K's ``#### 42`` and LaTeX ``\\boxed{...}`` (BigMath, MATH,
DAPO-Math). Every reward takes ``completions`` (plain strings or conversational ``[{"role", "content"}]`` lists,
as TRL passes them) plus the dataset's answer column as a keyword, and returns one float per completion.

Comparison: when the ``math-verify`` package is installed (``pip install "qerl-trl[math]"``) boxed answers are
checked symbolically with it; otherwise (and always for plain numbers) answers are compared as exact numbers
(``1,000`` == ``1000.0`` == ``1e3``), then as normalized strings. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "answers_match",
    "boxed_accuracy_reward",
    "completion_text",
    "extract_boxed_answer",
    "extract_gsm8k_answer",
    "extract_last_number",
    "format_reward",
    "gsm8k_accuracy_reward",
    "is_math_verify_available",
    "normalize_number",
    "number_reward",
]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")


def is_math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def completion_text(completion: Any) -> str:
    """The text of one completion, whether TRL passed a string or a conversational message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion if not isinstance(m, dict) or m.get("role") != "user")
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def normalize_number(text: str) -> Fraction | None:
    """``"1,234.50"`` -> ``Fraction(2469, 2)``; ``None`` if ``text`` is not a plain number."""
    t = text.strip().strip("$").rstrip(".").replace(",", "").replace(" ", "")
    if not t:
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        try:
            return Fraction(float(t))
        except (ValueError, OverflowError):
            return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K's answer marker), without thousands separators."""
    found = _GSM8K_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_boxed_answer(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])  # "\boxed 5"
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the completion was cut off inside the box


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (the usual fallback when a model gives no answer marker)."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def _strip_latex(s: str) -> str:
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{([^}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "").replace("$", "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".").lower()


def _math_verify_equal(pred: str, gold: str) -> bool | None:
    """``True``/``False`` from math-verify, or ``None`` when it is missing or cannot parse the gold answer."""
    if not is_math_verify_available():
        return None
    from math_verify import parse, verify  # noqa: PLC0415  (optional dependency)

    def boxed(s: str) -> str:
        return s if "\\boxed" in s else "\\boxed{" + s + "}"

    gold_p = parse(boxed(gold))
    if not gold_p:
        return None
    return bool(verify(gold_p, parse(boxed(pred))))


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Whether an extracted answer equals the reference: numbers exactly, else math-verify, else normalized text."""
    if pred is None or gold is None:
        return False
    p, g = normalize_number(pred), normalize_number(gold)
    if p is not None and g is not None:
        return p == g
    verdict = _math_verify_equal(pred, gold)
    if verdict is not None:
        return verdict
    ps, gs = _strip_latex(pred), _strip_latex(gold)
    if ps == gs:
        return True
    p, g = normalize_number(_unparen(ps)), normalize_number(_unparen(gs))
    return p is not None and g is not None and p == g


def _unparen(s: str) -> str:
    """``(3)/(4)`` -> ``3/4`` so a simple LaTeX fraction compares as a number."""
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    return f"{m.group(1)}/{m.group(2)}" if m else s


def _gold_of(reference: Any) -> str | None:
    """A GSM8K answer ("... #### 42"), a boxed solution, or a bare answer -> the reference answer string."""
    ref = str(reference)
    return extract_gsm8k_answer(ref) or extract_boxed_answer(ref) or ref.strip()


def gsm8k_accuracy_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer equals GSM8K's ``#### N``, else 0.0.

    The completion's answer is its last ``#### N``, else its last ``\\boxed{}``, else its last number (so the
    reward does not depend on one prompt format). ``answer`` is GSM8K's answer column.
    """
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion_text(completion)
        pred = extract_gsm8k_answer(text) or extract_boxed_answer(text) or extract_last_number(text)
        out.append(1.0 if answers_match(pred, _gold_of(ref)) else 0.0)
    return out


def boxed_accuracy_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's last ``\\boxed{}`` equals the solution's answer (math-verify when installed).

    ``solution`` may be a full worked solution containing a boxed answer, or just the answer itself (as in
    BigMath's ``answer`` column). A completion without a box scores 0.0: DAPO/BigMath prompts ask for one.
    """
    out = []
    for completion, ref in zip(completions, solution, strict=True):
        pred = extract_boxed_answer(completion_text(completion))
        out.append(1.0 if answers_match(pred, _gold_of(ref)) else 0.0)
    return out


def number_reward(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the first number in the completion equals ``answer`` (short arithmetic tasks, e.g. the demo)."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        found = _NUMBER_RE.findall(completion_text(completion))
        out.append(1.0 if found and answers_match(found[0].replace(",", ""), str(ref)) else 0.0)
    return out


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """0.5 when the completion states a final answer (``#### N`` or ``\\boxed{...}``), else 0.0.

    Small shaping term used with an accuracy reward (as in the QeRL recipes' soft format reward); it never
    rewards a wrong answer more than a right one, since accuracy rewards are 1.0.
    """
    out = []
    for completion in completions:
        text = completion_text(completion)
        out.append(0.5 if extract_gsm8k_answer(text) is not None or extract_boxed_answer(text) else 0.0)
    return out
