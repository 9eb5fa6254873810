"""``qerl-trl train`` works from a plain wheel install, not only from a source checkout.

The wheel is built from a copy of the package (so the checkout gets no build files) and installed with
``--no-deps`` into a fresh venv that reads its dependencies (torch, TRL, ...) from this test's environment
through a ``.pth`` line: the venv's own site-packages comes first on ``sys.path``, and ``.pth`` files of the added
directory are not processed, so this checkout's editable install stays out and ``qerl_trl`` is the wheel's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "qerl_trl", src / "qerl_trl", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # the build backend from this venv when it has one (a uv-seeded venv on Python >= 3.12 has no setuptools);
    # otherwise pip fetches it into an isolated build environment
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-w", str(tmp / "dist"), str(src)], check=True)
    (wheel,) = (tmp / "dist").glob("qerl_trl-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(site) / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env)


def test_train_runs_from_the_installed_wheel(wheel_venv, tmp_path):
    where = _run(wheel_venv, "python", "-c", "import qerl_trl.scripts, qerl_trl; print(qerl_trl.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(wheel_venv), where.stdout  # the wheel's, not this checkout's

    help_ = _run(wheel_venv, "qerl-trl", "train", "--help", cwd=tmp_path)
    assert help_.returncode == 0 and "--dry-run" in help_.stdout, help_.stderr

    recipe = ROOT / "examples" / "recipes" / "qwen2.5-7b_gsm8k.yaml"
    dry = _run(wheel_venv, "qerl-trl", "train", "--config", str(recipe), "--dry-run", "--learning_rate", "2e-5",
               "--use_cpu", "true", "--bf16", "false", cwd=tmp_path)  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "would run qerl_trl.scripts.grpo_gsm8k" in dry.stdout
    assert '"model_name_or_path": "Qwen/Qwen2.5-7B-Instruct"' in dry.stdout
    assert '"learning_rate": 2e-05' in dry.stdout and '"aqn": true' in dry.stdout
    assert not (tmp_path / "outputs").exists()  # nothing was trained or written
