"""Arithmetic problems generated offline for GRPO: few-shot text prompts, exact numeric answers, held-out splits.

Small models need a task whose answer is checkable exactly and whose difficulty leaves room to learn. Why the
prompt is a few-shot text prompt: measured on SmolLM2-135M-Instruct, the chat prompt "What is a + b?" gets 0
right greedy or sampled (the model restates the question), while "2 + 3 = 5\\n7 + 5 = 12\\n...\\na + b =" gets a
few right. GRPO needs that: a group whose completions all score the same has zero advantage.

Measured on the bf16 SmolLM2-135M-Instruct (48 problems, 8 samples each at temperature 1, 6 new tokens):

| task | greedy | sampled | groups with mixed rewards |
|---|---|---|---|
| ``add_small`` (a + b, 1..20; the demo's) | 0.31 | 0.26 | 27/48 |
| ``add_2digit`` (a + b, 10..99) | 0.19 | 0.09 | 21/48 |
| ``add_sub_2digit`` (a ± b, 10..99, a ≥ b) | 0.15 | 0.04 | 10/48 |

Problems are distinct, never one of the few-shot examples, and a held-out set is kept out of training by
passing it as ``exclude``. Nothing here imports torch; :meth:`ArithmeticTask.dataset` imports ``datasets``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["TASKS", "ArithmeticTask", "Problem"]

#: ``(a, op, b)``
Problem = tuple[int, str, int]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems ``a op b`` with ``low <= a, b <= high`` and ``op`` in ``ops``, shown after ``few_shot`` worked ones.

    For subtraction ``a >= b``, so every answer is a non-negative integer.
    """

    name: str
    ops: tuple[str, ...]
    low: int
    high: int
    few_shot: tuple[Problem, ...]

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if op not in _OPS]
        if bad or not self.ops:
            raise ValueError(f"ArithmeticTask {self.name!r}: ops must be a non-empty subset of {sorted(_OPS)}, got {self.ops}")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"ArithmeticTask {self.name!r}: need 0 <= low <= high, got {self.low}..{self.high}")

    @staticmethod
    def answer(problem: Problem) -> int:
        a, op, b = problem
        return _OPS[op](a, b)

    @property
    def prefix(self) -> str:
        """The worked examples, one ``a op b = c`` per line, that open every prompt."""
        return "".join(f"{a} {op} {b} = {self.answer((a, op, b))}\n" for a, op, b in self.few_shot)

    def prompt(self, problem: Problem) -> str:
        a, op, b = problem
        return f"{self.prefix}{a} {op} {b} ="

    def _all(self) -> int:
        n = self.high - self.low + 1
        per_op = {"+": n * n, "-": n * (n + 1) // 2}
        return sum(per_op[op] for op in self.ops)

    def _valid(self, p: Problem) -> bool:
        a, op, b = p
        return op in self.ops and self.low <= a <= self.high and self.low <= b <= self.high and (op != "-" or a >= b)

    def count_free(self, exclude: tuple[Problem, ...] | list[Problem] = ()) -> int:
        """How many distinct problems are neither few-shot examples nor in ``exclude``."""
        banned = {p for p in (*self.few_shot, *exclude) if self._valid(p)}
        return self._all() - len(banned)

    def problems(self, n: int, seed: int, exclude: tuple[Problem, ...] | list[Problem] = ()) -> list[Problem]:
        """``n`` distinct problems drawn with ``random.Random(seed)``, none in ``exclude`` or the few-shot ones."""
        free = self.count_free(exclude)
        if n > free:
            raise ValueError(
                f"asked for {n} distinct {self.name} problems; only {free} are available (numbers {self.low}..{self.high}, "
                f"ops {' '.join(self.ops)}, {len(exclude)} excluded)"
            )
        rng = random.Random(seed)
        seen = set(self.few_shot) | set(exclude)
        out: list[Problem] = []
        while len(out) < n:
            op = self.ops[0] if len(self.ops) == 1 else rng.choice(self.ops)
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            if op == "-" and a < b:
                a, b = b, a
            if (a, op, b) not in seen:
                seen.add((a, op, b))
                out.append((a, op, b))
        return out

    def rows(self, problems: list[Problem]) -> list[dict]:
        """``{"prompt", "answer", "a", "op", "b"}`` per problem: a standard (text) prompt dataset for TRL."""
        return [
            {"prompt": self.prompt(p), "answer": str(self.answer(p)), "a": p[0], "op": p[1], "b": p[2]}
            for p in problems
        ]

    def to_dataset(self, problems: list[Problem]):
        """``problems`` as a ``datasets.Dataset`` with :meth:`rows`' columns."""
        from datasets import Dataset

        return Dataset.from_list(self.rows(problems))

    def dataset(self, n: int, seed: int, exclude: tuple[Problem, ...] | list[Problem] = ()):
        """:meth:`problems` as a ``datasets.Dataset`` (:meth:`to_dataset`)."""
        return self.to_dataset(self.problems(n, seed, exclude))


TASKS: dict[str, ArithmeticTask] = {
    t.name: t
    for t in (
        ArithmeticTask("add_small", ("+",), 1, 20, ((2, "+", 3), (7, "+", 5), (4, "+", 9))),
        ArithmeticTask("add_2digit", ("+",), 10, 99, ((47, "+", 38), (25, "+", 61), (56, "+", 67))),
        ArithmeticTask(
            "add_sub_2digit", ("+", "-"), 10, 99, ((47, "+", 38), (73, "-", 29), (56, "+", 67), (62, "-", 35))
        ),
    )
}
