"""The minimal loop (flows/minimal_loop.py) keeps working: the four stage functions in a plain Python loop on a
local store, two iterations of the demo, as a newcomer runs it; run again, it redoes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.slow


def test_the_minimal_loop_runs_two_iterations_and_resumes_with_nothing_to_do(tmp_path):
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "flows.minimal_loop", str(TINY), "--store", str(store), "--iterations", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    first = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [line for line in first.stdout.splitlines() if line.startswith("iter ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert "reward 0.018" in lines[0]                 # configs/tiny.yaml's header: 0.018 at iteration 1 (seeded)
    assert lines[1].endswith(f"-> file://{store}/tiny-demo/policy/v000002")
    assert json.loads((store / "tiny-demo" / "policy" / "LATEST").read_text())["target"] == "tiny-demo/policy/v000002"
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [line for line in again.stdout.splitlines() if line.startswith("iter ")] == lines   # reused, same numbers
