"""README's GPU tests: the parts it lists (each meant for one 10-minute GPU call) run together through
``scripts/gpu_check.sh suite_all`` and cover every ``gpu`` test once. Checked on the CPU, where every part runs and
each of its tests skips: the parts' JUnit files then name the tests they hold."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
TWO_GPUS = "tests/test_distributed_targets.py"  # a part of its own on two GPUs: gpu_check.sh two_gpus


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=600)


def test_suite_all_runs_every_part_and_the_parts_cover_every_gpu_test_once(tmp_path):
    parts = _run("bash", "scripts/gpu_check.sh", "parts").stdout.splitlines()
    assert len(parts) >= 8 and all(p.startswith("pytest -q -m gpu tests/") for p in parts), parts
    done = _run("bash", "scripts/gpu_check.sh", "suite_all", OUT=str(tmp_path), JOBS="2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("part ")]
    assert len(lines) == len(parts) and all(" rc=0 " in line for line in lines), done.stdout[-3000:]
    held = []
    for i in range(len(parts)):
        cases = ET.parse(tmp_path / f"part-{i}.xml").getroot().iter("testcase")
        names = [f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}" for c in cases]
        assert names, f"part {i} holds no test: {parts[i]}"
        held += names
    assert len(held) == len(set(held)), sorted({n for n in held if held.count(n) > 1})[:10]
    listed = _run(sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests")
    assert listed.returncode == 0, listed.stdout[-3000:]
    every = {line for line in listed.stdout.splitlines() if "::" in line and not line.startswith(TWO_GPUS)}
    assert set(held) == every, (sorted(every - set(held))[:10], sorted(set(held) - every)[:10])
