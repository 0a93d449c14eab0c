"""Code-reward throughput: programs scored per second through the sandbox (bubblewrap, then the rlimits
fallback) versus a bare `subprocess.run([python, file])` per test of the same honest programs, no isolation.

    python bench/sandbox_throughput.py [--programs 200] [--workers 0] [--timeout 2]

The mix is what a GRPO batch of code completions looks like: mostly honest solutions of two stdin/stdout
problems (3 tests each) and two MBPP-style assert problems (3 asserts each), some wrong answers, some runtime
errors and a few infinite loops (70 / 15 / 10 / 5 %). A timeout costs `--timeout` seconds of one worker,
so the mix's rate depends on it; the honest-only rows compare the isolation cost alone. Prints programs/s
and the ratios (medians of interleaved rounds: a shared machine's load drifts). Results: docs/sandbox.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.core.config import SandboxConfig  # noqa: E402
from tasks.rewards import code as code_rewards  # noqa: E402
from tasks.scoring import sandbox  # noqa: E402

SUM = [("1 2\n", "3"), ("10 -4\n", "6"), ("100000 23\n", "100023")]
WORDS = [("hello big world\n", "world big hello"), ("a\n", "a"), ("x y\n", "y x")]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 20) == 30"]
EVENS_TESTS = ["assert evens([1, 2, 3, 4]) == [2, 4]", "assert evens([]) == []", "assert evens([7]) == []"]

PROBLEMS = {     # name: (tests, honest, wrong, runtime error)
    "sum": (SUM, "a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a - b)",
            "a, b = map(int, input().split())\nprint(a / 0)"),
    "words": (WORDS, "print(' '.join(reversed(input().split())))", "print(input())",
              "print(input().split()[5])"),
    "add": (ADD_TESTS, "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b",
            "def add(a, b):\n    return a + c"),
    "evens": (EVENS_TESTS, "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
              "def evens(xs):\n    return xs", "def evens(xs):\n    return [x for x in xs if x % 0 == 0]"),
}
LOOP = "while True:\n    pass"
# the same assert problem with its expected sides computed by a helper of test_setup_code: each row's expected
# sides run in one sandbox of their own (never with the code), what --helper measures against literal ones
HELPER_SETUP = "def reference(xs):\n    return [x for x in xs if x % 2 == 0]\n"
HELPER_TESTS = ["assert evens([1, 2, 3, 4]) == reference([1, 2, 3, 4])", "assert evens([]) == reference([])",
                "assert evens([7]) == reference([7])"]


def make_mix(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """[(problem, kind, code)]: 70% honest, 15% wrong, 10% runtime error, 5% infinite loop."""
    rng = random.Random(seed)
    kinds = rng.choices(["honest", "wrong", "error", "loop"], weights=[70, 15, 10, 5], k=n)
    out = []
    for kind in kinds:
        name = rng.choice(list(PROBLEMS))
        _, honest, wrong, error = PROBLEMS[name]
        out.append((name, kind, {"honest": honest, "wrong": wrong, "error": error, "loop": LOOP}[kind]))
    return out


def row(name: str) -> tuple[dict | None, list | None]:
    tests = PROBLEMS[name][0]
    if name in ("sum", "words"):
        return {"language": "python", "test_cases": [{"type": "stdin_stdout", "input": i, "output": o}
                                                     for i, o in tests]}, None
    return None, tests


def through_sandbox(mix, isolation: str, workers: int, timeout: float) -> tuple[float, list[float]]:
    """isolation "bubblewrap-no-seccomp": bubblewrap without its syscall filter (what the filter costs);
    "bubblewrap-no-cgroup": without a cgroup per sandbox (what the cgroup costs)."""
    cfg = SandboxConfig(isolation=isolation.split("-")[0], workers=workers, timeout_seconds=timeout,
                        cgroup="off" if isolation.endswith("no-cgroup") else "auto")
    sandbox.configure(cfg)
    runner = sandbox.runner(cfg)                               # probe outside the timing
    program = runner.seccomp
    if isolation.endswith("no-seccomp"):
        runner.seccomp = None
    completions = [f"```python\n{code}\n```" for _, _, code in mix]
    rows = [row(name) for name, _, _ in mix]
    try:
        t0 = time.perf_counter()
        scores = code_rewards.code_reward(completions, verification_info=[r[0] for r in rows],
                                          test_list=[r[1] for r in rows])
        return time.perf_counter() - t0, scores
    finally:
        runner.seccomp = program


def bare(mix, python: str, workers: int, timeout: float) -> tuple[float, list[float]]:
    """The reference: each test as `python file` (stdin tests fed the input, assert tests appended to the
    code), pass = right stdout / exit 0; no isolation, no limits."""
    def score(item) -> float:
        name, _, code = item
        tests = PROBLEMS[name][0]
        passed = 0
        with tempfile.TemporaryDirectory(prefix="rlflow-bench-") as d:
            for i, test in enumerate(tests):
                path = Path(d) / f"t{i}.py"
                stdin_test = isinstance(test, tuple)
                path.write_text(code if stdin_test else f"{code}\n{test}\n")
                try:
                    r = subprocess.run([python, str(path)], input=test[0] if stdin_test else "",
                                       capture_output=True, text=True, timeout=timeout)
                except subprocess.TimeoutExpired:
                    continue
                passed += r.returncode == 0 and (not stdin_test or r.stdout.strip() == test[1])
        return passed / len(tests)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scores = list(pool.map(score, mix))
    return time.perf_counter() - t0, scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=0, help="0 = os.cpu_count()")
    ap.add_argument("--timeout", type=float, default=2.0, help="wall clock per completion (s)")
    ap.add_argument("--repeats", type=int, default=3, help="honest-only rounds, the three paths interleaved "
                                                            "(a shared machine's load drifts): medians are compared")
    ap.add_argument("--helper", type=int, default=1, help="also time rows whose expected sides call a setup "
                                                          "helper (1) or not (0)")
    args = ap.parse_args()
    workers = args.workers or os.cpu_count()
    mix = make_mix(args.programs)
    honest = [m for m in mix if m[1] == "honest"]
    python = sandbox.resolve_python(None)
    print(f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, host Python "
          f"{platform.python_version()}, sandbox python {python}, {workers} workers, timeout {args.timeout} s, "
          f"root: {os.geteuid() == 0}")
    print(f"mix: {len(mix)} programs = {len(honest)} honest, {sum(m[1] == 'wrong' for m in mix)} wrong, "
          f"{sum(m[1] == 'error' for m in mix)} runtime errors, {sum(m[1] == 'loop' for m in mix)} infinite loops; "
          f"3 tests each")
    paths = [p for p in ("bubblewrap", "rlimits") if _works(p)] + ["bare"]
    if "bubblewrap" in paths and sandbox.runner(SandboxConfig(isolation="bubblewrap")).seccomp:
        paths.insert(1, "bubblewrap-no-seccomp")
    probe = sandbox.runner(SandboxConfig(isolation="bubblewrap")) if "bubblewrap" in paths else None
    if probe is not None and probe._cgroup(0, probe._uid(0) if os.geteuid() == 0 else None) is not None:
        paths.insert(1, "bubblewrap-no-cgroup")
    variants = ("bubblewrap-no-seccomp", "bubblewrap-no-cgroup")
    rates: dict[str, list[float]] = {p: [] for p in paths}
    for repeat in range(args.repeats):
        for path in paths:
            if path == "bare":
                seconds, scores = bare(honest, python, workers, args.timeout)
            else:
                seconds, scores = through_sandbox(honest, path, workers, args.timeout)
            assert sum(scores) == len(honest), (path, scores)          # every honest program scores 1
            rates[path].append(len(honest) / seconds)
        print(f"round {repeat + 1}, honest: " + ", ".join(f"{p} {rates[p][-1]:.1f}" for p in paths) + " programs/s")
    median = {p: statistics.median(r) for p, r in rates.items()}
    for path in paths:
        print(f"{path:10s} honest {len(honest):4d} programs: median {median[path]:6.1f} programs/s "
              f"(rounds: {', '.join(f'{r:.1f}' for r in rates[path])})")
    for path in [p for p in paths[:-1] if p not in variants]:
        seconds, scores = through_sandbox(mix, path, workers, args.timeout)
        print(f"{path:10s} mix    {len(mix):4d} programs in {seconds:6.2f} s = {len(mix) / seconds:6.1f} programs/s "
              f"(mean reward {sum(scores) / len(scores):.3f}; the loops alone cost "
              f"{sum(m[1] == 'loop' for m in mix) * args.timeout / workers:.0f} s)")
    for path in paths[:-1]:
        print(f"ratio bare / {path} (honest, medians): {median['bare'] / median[path]:.2f}x")
    if "bubblewrap-no-seccomp" in median:
        print(f"ratio bubblewrap without / with its seccomp filter (honest, medians): "
              f"{median['bubblewrap-no-seccomp'] / median['bubblewrap']:.2f}x")
    if "bubblewrap-no-cgroup" in median:
        print(f"ratio bubblewrap without / with its cgroup (honest, medians): "
              f"{median['bubblewrap-no-cgroup'] / median['bubblewrap']:.2f}x")
    if "bubblewrap" in median and "rlimits" in median:
        print(f"ratio rlimits / bubblewrap (honest, medians): {median['rlimits'] / median['bubblewrap']:.2f}x")
    if args.helper and "bubblewrap" in paths:
        helper_rates(args.programs // 4, workers, args.timeout, args.repeats)


def helper_rates(n: int, workers: int, timeout: float, repeats: int) -> None:
    """Rows of n/8 prompts x 8 completions (a GRPO group): literal expected sides vs a setup helper's, whose
    expected sides run in a sandbox of their own once per row and batch."""
    cfg = SandboxConfig(isolation="bubblewrap", workers=workers, timeout_seconds=timeout)
    sandbox.configure(cfg)
    sandbox.runner(cfg)
    code = [f"```python\n{PROBLEMS['evens'][1]}\n```"] * n
    rates: dict[str, list[float]] = {"literal": [], "helper": []}
    for _ in range(repeats):
        for kind in rates:
            tests = EVENS_TESTS if kind == "literal" else HELPER_TESTS
            setup = None if kind == "literal" else HELPER_SETUP
            t0 = time.perf_counter()
            for group in range(0, n, 8):     # one reward call per group of 8 completions of one prompt
                scores = code_rewards.code_reward(code[group:group + 8], test_list=[tests] * 8,
                                                  test_setup_code=[setup] * 8)
                assert scores == [1.0] * len(scores), (kind, scores)
            rates[kind].append(n / (time.perf_counter() - t0))
    median = {k: statistics.median(r) for k, r in rates.items()}
    print(f"expected sides (groups of 8, {n} programs): literal {median['literal']:.1f}, setup helper "
          f"{median['helper']:.1f} programs/s; ratio {median['literal'] / median['helper']:.2f}x")


def _works(isolation: str) -> bool:
    try:
        sandbox.runner(SandboxConfig(isolation=isolation))
        return True
    except Exception as e:             # e.g. bubblewrap missing on this machine
        print(f"{isolation}: unavailable ({e})")
        return False


if __name__ == "__main__":
    main()
