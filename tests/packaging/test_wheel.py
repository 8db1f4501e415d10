"""The built wheel is complete: installed alone into a fresh venv (no source tree on the path), it plans
the embedded default config, prints the schema and the Grafana dashboard. The wheel once shipped without its
configs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_plans_the_default_and_prints_the_schema(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", ".gpu"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("pdserve-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"),
                    str(wheel)], check=True, timeout=300)
    # Dependencies come from this environment's site-packages through PYTHONPATH, whose .pth files (the
    # editable install's finder) are not processed: pdserve itself can only come from the wheel.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "PDSERVE_HOME": str(tmp_path / "home")}
    def run(*args):
        return subprocess.run([str(venv / "bin" / "python"), "-m", "pdserve", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import pdserve; print(pdserve.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert str(venv) in where.stdout, where.stdout + where.stderr
    plan = run("plan", "--json")
    assert plan.returncode in (0, 1), plan.stderr          # 1: a machine check may fail; the plan is printed
    processes = json.loads(plan.stdout)["processes"]
    assert [p["name"] for p in processes] == ["prefill-0", "decode-0", "router"]
    schema = run("schema")
    assert schema.returncode == 0 and "prefill" in json.loads(schema.stdout)["properties"]
    board = run("dashboard")          # the Grafana dashboard is package data too
    assert board.returncode == 0, board.stderr
    assert len(json.loads(board.stdout)["panels"]) >= 10
