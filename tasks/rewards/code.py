"""Code rewards: run the completion's Python against the row's tests in the sandbox, score the tests passed.

    reward.functions: [{fn: "tasks.rewards.code:code_reward", weight: 1.0}]        # share of tests passed
    reward.functions: [{fn: "tasks.rewards.code:code_reward_all", weight: 1.0}]    # 1 only if all pass

    >>> code_reward(["```python\\nprint(sum(map(int, input().split())))\\n```"],
    ...             verification_info=[{"test_cases": [{"type": "stdin_stdout", "input": "1 2\\n", "output": "3\\n"}]}])
    [1.0]

The code is the completion's last ```python block, else its last ``` block; the tests come from the row
(`verification_info`, `test_list`, or a `test` module: HumanEval's check(candidate) with `entry_point`, pytest's
test_* functions; none: None). Verdicts are made on the host (asserts: tasks/scoring/asserts.py)
and expected outputs never enter the sandbox (tasks/scoring/sandbox.py, docs/sandbox.md): only a plain value or
stdout judged here counts. Each completion gets a reason ("passed 3/3", "wrong answer (passed 1/3)"...), code/* metrics.
More: docs/internals.md (tasks/rewards/code.py): test formats, how each verdict is made, reasons and metrics.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.rewards import after_reasoning, text_of
from tasks.scoring import sandbox
from tasks.scoring.asserts import TooDeep
from tasks.scoring.cases import Case, _values_check, assert_cases, explain_failure, printable
from tasks.scoring.module_tests import module_cases, prompt_definitions

MAX_TEXT = 1 << 20          # characters of a completion the host reads (a code block past them is not read)


@dataclass
class Verdict:
    score: float | None
    reason: str
    passed: int = 0
    total: int = 0
    isolation: str | None = None
    timed_out: bool = False
    seconds: float = 0.0                                   # wall clock of its sandbox
    outputs: list[str] = field(default_factory=list)     # what each test printed (capped by the sandbox)


def code_reward(completions: list, verification_info: list | None = None, test_list: list | None = None,
                test_setup_code: list | None = None, mode: str = "fraction", log_extra=None, log_metric=None,
                test: list | None = None, entry_point: list | None = None, prompts: list | None = None,
                **kwargs) -> list[float | None]:
    """Share of the row's tests the completion's code passes (mode="all": 1.0 only when all pass). The helpers a
    prompt defines whole (HumanEval's `encode_shift`, `poly`) are the tests' own, not the code's."""
    verdicts = judge(completions, verification_info, test_list, test_setup_code, mode, test, entry_point, prompts)
    log_verdicts(verdicts, log_extra, log_metric)
    return [v.score for v in verdicts]


def code_reward_all(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the code passes every test of its row, else 0.0 (binary: no credit for a constant that
    happens to satisfy some asserts)."""
    return code_reward(completions, **{**kwargs, "mode": "all"})


def code_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the answer (after any <think>...</think>) holds exactly one ```python block, else 0.0."""
    return [1.0 if len(_PYTHON_BLOCK.findall(after_reasoning(text_of(c)))) == 1 else 0.0 for c in completions]


def judge(completions: list, verification_info: list | None = None, test_list: list | None = None,
          test_setup_code: list | None = None, mode: str = "fraction", test: list | None = None,
          entry_point: list | None = None, prompts: list | None = None) -> list[Verdict]:
    """One Verdict per completion; the completions with code and tests run in parallel sandboxes."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_reward: mode must be 'fraction' or 'all', got {mode!r}")
    n = len(completions)
    verdicts: list[Verdict | None] = [None] * n
    jobs, pending = [], []
    expected_jobs: dict[tuple, int] = {}     # (setup, expected expressions) -> its job: one per row, not per completion
    for j, completion in enumerate(completions):
        code = extract_code(text_of(completion)[:MAX_TEXT])
        try:              # (the host's own reading of the code and the row is bounded; past it: this one scores 0)
            cases, setup = parse_tests(_at(verification_info, j), _at(test_list, j), _at(test_setup_code, j), code,
                                       _at(test, j), _at(entry_point, j), _at(prompts, j))
        except (RecursionError, MemoryError, TooDeep) as e:
            verdicts[j] = Verdict(0.0, f"the host cannot read this code: {e or type(e).__name__}")
            continue
        if not cases:
            verdicts[j] = Verdict(None, "no tests")
        elif code is None:
            verdicts[j] = Verdict(0.0, "no code block", total=len(cases))
        else:
            jobs.append((code, [c.test for c in cases], setup))
            key = (next((c.expected_setup for c in cases if c.expected is not None), ""),
                   tuple(tuple(c.expected.exprs) for c in cases if c.expected is not None))
            if key[1] and key not in expected_jobs:
                expected_jobs[key] = len(expected_jobs)
            pending.append((j, cases, expected_jobs.get(key)))
    if jobs:
        runner = sandbox.runner()
        # the expected sides that need the setup run in sandboxes of their own, which never hold the code
        runs = runner.map(jobs + [("", [sandbox.Test(exprs=list(e)) for e in exprs], setup)
                                  for setup, exprs in expected_jobs])
        runs, expected_runs = runs[:len(jobs)], runs[len(jobs):]
        _check_sandbox_alive(runner, runs)
        for (j, cases, e), run in zip(pending, runs):
            try:
                verdicts[j] = decide(cases, run, mode, expected_runs[e] if e is not None else None)
            except (RecursionError, MemoryError) as ex:       # (a check the host could not finish: this one only)
                verdicts[j] = Verdict(0.0, f"the host could not check this code's values: {type(ex).__name__}",
                                      total=len(cases))
    return verdicts


def decide(cases: list[Case], run: sandbox.Run, mode: str, expected: sandbox.Run | None = None) -> Verdict:
    """`expected`: the run of the cases' expected sides (in case order, only the cases that have one)."""
    wanted = iter(expected.tests if expected is not None else [])
    reasons = [case.check(t, next(wanted, None) if case.expected is not None else None)
               for case, t in zip(cases, run.tests)]
    passed = sum(r is None for r in reasons)
    total = len(cases)
    first = next((r for r in reasons if r is not None), None)
    if run.output_limit and first is None:
        first, passed = "output limit", 0
    if run.error and passed < total:
        first = f"sandbox ended early: {printable(run.error)}" if first in (None, "not run") else first
    score = passed / total if mode == "fraction" else float(passed == total)
    reason = f"passed {passed}/{total}" if first is None else f"{first} (passed {passed}/{total})"
    return Verdict(score, reason, passed, total, run.isolation, run.timed_out, run.seconds,
                   [t.stdout for t in run.tests])


def log_verdicts(verdicts: list[Verdict], log_extra=None, log_metric=None) -> None:
    """Reasons as the `code_reason` column of TRL's completions table; batch metrics."""
    if log_extra is not None:
        log_extra("code_reason", [v.reason for v in verdicts])
    if log_metric is None:
        return
    scored = [v for v in verdicts if v.score is not None]
    ran = [v for v in scored if v.isolation is not None]
    if ran:
        log_metric("code/isolation_bubblewrap", 1.0 if ran[0].isolation == "bubblewrap" else 0.0)
        log_metric("code/seconds", sum(v.seconds for v in ran) / len(ran))
    if scored:
        log_metric("code/pass_rate", sum(v.passed / max(v.total, 1) for v in scored) / len(scored))
        log_metric("code/all_passed", sum(v.passed == v.total for v in scored) / len(scored))
        log_metric("code/no_code_block", sum(v.reason == "no code block" for v in scored) / len(scored))
    log_metric("code/timeouts", float(sum(v.timed_out for v in verdicts)))


def _check_sandbox_alive(runner: sandbox.Runner, runs: list[sandbox.Run]) -> None:
    """A whole batch with no test run is more likely a broken sandbox than a batch of hostile programs:
    probe it again and fail the stage (an infrastructure error, retried) if it no longer works."""
    if len(runs) > 1 and all(r.error and not any(t.ran for t in r.tests) for r in runs):
        problem = sandbox.probe(runner)
        if problem is not None:
            raise RuntimeError(f"code sandbox ({runner.isolation}) stopped working: {problem}")


# --------------------------------------------------------------------------------------------- the code

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_BLOCK = re.compile(r"```(?:python|py|python3)[ \t]*\n.*?```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The last ```python block of the answer, else its last ``` block, else None."""
    blocks = _FENCE.findall(after_reasoning(completion))
    python = [body for lang, body in blocks if lang.strip().lower() in ("python", "py", "python3")]
    return python[-1] if python else (blocks[-1][1] if blocks else None)


def _at(column: list | None, j: int):
    return column[j] if column is not None and j < len(column) else None


# --------------------------------------------------------------------------------------------- the tests

def parse_tests(verification_info, test_list, test_setup_code, code: str | None, test=None,
                entry_point=None, prompt=None) -> tuple[list[Case], str]:
    """The row's tests as sandbox tests plus host-side checks, and the setup code run before asserts (the row's
    test_setup_code; a split case's test carries its definitions, which the code's process never holds: before
    2026-12-06 a test module's, its expected values included, were the setup of the asserts run in the code's
    process, read there with gc.get_objects() and handed on through /tmp to the split tests)."""
    cases: list[Case] = []
    info = _as_json(verification_info)
    if isinstance(info, dict) and str(info.get("language") or "python").lower().startswith("python"):
        for tc in info.get("test_cases") or []:
            case = _verification_case(tc, code) if isinstance(tc, dict) else None
            if case is not None:
                cases.append(case)
    tests = _as_json(test_list)
    if isinstance(tests, str):
        tests = [tests]
    setup = test_setup_code if isinstance(test_setup_code, str) else ""
    for src in tests or []:
        if isinstance(src, str):
            cases += assert_cases(src, setup, code)
    source = setup              # the split cases' definitions: the tests' process alone ever holds them
    if weak := [c.weak for c in cases if c.weak]:    # (run split from the code, as a test module's asserts)
        split, source = module_cases("\n".join(weak), None, source, code)
        if len(split) == len(weak):
            it = iter(split)
            cases = [next(it) if c.weak else c for c in cases]
    if isinstance(test, str) and test.strip():
        more, source = module_cases(test, entry_point, source, code, first=len(cases),
                                    given=prompt_definitions(prompt, entry_point))
        cases += more
    for c in cases:
        if c.test.names is not None:
            c.test.setup = source
    return cases, setup


def _as_json(value):
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _verification_case(tc: dict, code: str | None) -> Case | None:
    kind = tc.get("type") or "stdin_stdout"
    if kind == "stdin_stdout":
        if tc.get("output") is None:      # (no expected output: no test; an empty program printed "" and passed)
            return None
        inp, out = ("\n".join(map(str, v)) if isinstance(v, list) else "" if v is None else str(v)    # (0: "0")
                    for v in (tc.get("input"), tc["output"]))
        return Case(sandbox.Test(stdin=inp), _stdout_check(out))     # (a list of lines, as an input's)
    if kind == "function_call" and tc.get("fn_name"):
        try:
            args, want = (json.loads(v) if isinstance(v, str) else v for v in (tc["input"], tc["output"]))
        except (TypeError, ValueError, KeyError):
            return None
        args = args if isinstance(args, list) else [args]
        fn = str(tc["fn_name"])
        if not fn.isidentifier():
            return None
        call = f"Solution().{fn}" if code and re.search(r"^class\s+Solution\b", code, re.M) else fn
        # APPS-derived rows wrap the return value in a list: accept the value or [value], as APPS does.
        return Case(sandbox.Test(exprs=[f"{call}(*{args!r})"]),
                    _values_check(lambda v, w: v[0] == want or [v[0]] == want))
    return None


def _stdout_check(expected: str) -> Callable[[sandbox.TestRun], str | None]:
    want = normalise_output(expected)

    def check(t: sandbox.TestRun, e: sandbox.TestRun | None = None) -> str | None:
        if (fail := explain_failure(t)) is not None:
            return fail
        return None if normalise_output(t.stdout) == want else "wrong answer"
    return check


def normalise_output(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)

