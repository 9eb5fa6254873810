"""AQNSchedule: stage boundaries, σ per stage (paper §3.3), argument validation."""

from __future__ import annotations

import math

import pytest

from qerl_trl.aqn import AQNSchedule


def test_default_schedule_at_stage_boundaries():
    s = AQNSchedule()  # 1e-2 -> 5e-4 over K=10 stages
    assert (s.sigma_start, s.sigma_end, s.num_stages) == (1e-2, 5e-4, 10)
    M = 100
    for step in range(0, 10):
        assert s.stage(step, M) == 0 and s.sigma(step, M) == 0.0
    assert s.stage(10, M) == 1 and s.sigma(10, M) == 1e-2
    assert s.sigma(19, M) == 1e-2
    ratio = (5e-4 / 1e-2) ** (1 / 8)
    for k in range(1, 10):
        expected = 1e-2 * ratio ** (k - 1)
        assert s.stage(10 * k, M) == k and s.stage(10 * k - 1, M) == k - 1
        assert math.isclose(s.sigma(10 * k, M), expected, rel_tol=1e-12)
        assert math.isclose(s.sigma(10 * k + 9, M), expected, rel_tol=1e-12)
    assert s.sigma(90, M) == 5e-4 and s.sigma(99, M) == 5e-4
    assert s.stage(M, M) == 9 and s.stage(10 * M, M) == 9  # past the end: stays in the last stage
    sig = [s.stage_sigma(k) for k in range(10)]
    assert sig[0] == 0.0 and all(a > b for a, b in zip(sig[1:], sig[2:]))  # strictly decaying


def test_uneven_steps_and_boundaries():
    s = AQNSchedule(1e-2, 1e-3, num_stages=3)
    assert [s.stage(i, 7) for i in range(7)] == [0, 0, 0, 1, 1, 2, 2]  # floor(3*i/7)
    assert [s.sigma(i, 7) for i in (2, 3, 5)] == [0.0, 1e-2, 1e-3]
    assert s.boundaries(7) == [0, 3, 5]
    assert AQNSchedule().boundaries(100) == list(range(0, 100, 10))


def test_two_stages_and_constant_sigma():
    s = AQNSchedule(3e-3, 1e-3, num_stages=2)
    assert [s.sigma(i, 10) for i in (0, 4, 5, 9)] == [0.0, 0.0, 3e-3, 3e-3]
    c = AQNSchedule(2e-3, 2e-3, num_stages=4)
    assert [c.stage_sigma(k) for k in range(4)] == [0.0, 2e-3, 2e-3, 2e-3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_start=0.0), "sigma_start"),
        (dict(sigma_start=-1e-2), "sigma_start"),
        (dict(sigma_end=float("nan")), "sigma_end"),
        (dict(sigma_start=1e-3, sigma_end=1e-2), "sigma_end .* must be <= sigma_start"),
        (dict(num_stages=1), "num_stages"),
        (dict(num_stages=2.5), "num_stages"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AQNSchedule(**kwargs)


def test_invalid_positions():
    s = AQNSchedule()
    with pytest.raises(ValueError, match="max_steps"):
        s.sigma(0, 0)
    with pytest.raises(ValueError, match="step"):
        s.stage(-1, 10)
    with pytest.raises(ValueError, match="stage"):
        s.stage_sigma(10)
