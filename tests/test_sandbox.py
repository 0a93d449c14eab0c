"""The code sandbox (tasks/scoring/sandbox.py) and the code reward (tasks/rewards/code.py) against hostile completions.

Every hostile program scores 0 with a recorded reason, sees none of our secrets, reaches neither our files nor
the network, and leaves no process or file behind. Where a leak is possible in principle, the test is built
so that the leak would *score*: the expected output is the secret itself (the AWS key, the credentials file,
/etc/shadow, "CONNECTED" for a socket), so a 0 proves the program could not get it. All hostile programs run
in one parallel `judge` call (module fixture) to keep the suite fast; each is its own test case.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from tasks.core.config import SandboxConfig
from tasks.core.errors import UserError
from tasks.rewards import code as code_rewards
from tasks.scoring import bounded, sandbox, sandbox_uids

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
TOKEN = uuid.uuid4().hex[:12]
SECRETS = {"AWS_SECRET_ACCESS_KEY": f"aws-secret-{TOKEN}", "AWS_ACCESS_KEY_ID": f"AKIA{TOKEN.upper()}",
           "MLFLOW_TRACKING_PASSWORD": f"mlflow-pw-{TOKEN}", "PREFECT_API_KEY": f"pnu_{TOKEN}",
           "HF_TOKEN": f"hf_{TOKEN}", "RLFLOW_SECRET": f"rlflow-{TOKEN}"}
TMP_MODE = os.stat("/tmp").st_mode
DAEMON_MARK = "987654"         # `sleep 987654`: the daemon's command line, looked for on the host afterwards

TEST_LIMITS = dict(timeout_seconds=3, cpu_seconds=2, memory_mb=256, file_size_mb=4, max_processes=16,
                   max_open_files=64, max_output_kb=64, tmpfs_mb=16, workers=2)


def fence(code: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(code).strip()}\n```\n"


def stdin_row(*cases: tuple[str, str]) -> dict:
    return {"verification_info": {"language": "python", "test_cases": [
        {"type": "stdin_stdout", "input": i, "output": o} for i, o in cases]}}


DOUBLE = stdin_row(("21\n", "42\n"), ("5\n", "10\n"))                      # print twice the number read
ADD = {"test_list": ["assert add(1, 2) == 3", "assert add(-5, 5) == 0", "assert add(10, 20) == 30"]}


def judge_rows(completions: list[str], rows: list[dict], mode: str = "fraction"):
    return code_rewards.judge(completions, [r.get("verification_info") for r in rows],
                              [r.get("test_list") for r in rows], [r.get("test_setup_code") for r in rows], mode)


def hostile_cases(ctx: dict) -> dict[str, tuple[str, dict]]:
    """name -> (program, row). `ctx` holds what the host prepared: secrets, paths, ports."""
    secret = SECRETS["AWS_SECRET_ACCESS_KEY"]
    return {
        "infinite_loop": ("while True: pass", DOUBLE),
        "fork_bomb": ("""
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass""", DOUBLE),
        "memory_bomb": ("""
            x = []
            while True:
                x.append(bytearray(10**7))""", DOUBLE),
        "disk_fill": ("""
            import os
            for path in ("/tmp/fill", "fill", "/dev/shm/fill", "/fill"):
                try:
                    with open(path, "wb") as f:
                        while True:
                            f.write(b"x" * 1_000_000)
                except (OSError, Exception):
                    pass""", DOUBLE),
        "huge_stdout": ("""
            while True:
                print("x" * 100_000)""", DOUBLE),
        "stderr_flood": ("""
            import sys
            while True:
                sys.stderr.write("e" * 100_000)""", DOUBLE),
        "env_secret": ("""
            import os
            print(os.environ.get("AWS_SECRET_ACCESS_KEY", "not found"))""", stdin_row(("", secret))),
        "env_dump": ("""
            import os
            for k, v in os.environ.items():
                print(k, v)""", stdin_row(("", secret))),
        "proc_environ": ("""
            import os
            found = []
            for pid in ["self", "1", str(os.getppid())] + os.listdir("/proc"):
                try:
                    found += open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
                except OSError:
                    pass
            key = b"AWS_SECRET_ACCESS_KEY="
            print(next((v[len(key):].decode() for v in found if v.startswith(key)), "none"))
            """, stdin_row(("", secret))),
        "read_repo": (f"""
            print(open({str(ROOT / 'README.md')!r}).read(), end="")""",
                      stdin_row(("", (ROOT / "README.md").read_text()))),
        "list_root": ("""
            import os
            print("\\n".join(sorted(os.listdir("/root"))))""", stdin_row(("", ctx["root_listing"]))),
        "aws_credentials": (f"""
            import os
            for path in (os.path.expanduser("~/.aws/credentials"), {ctx['credentials']!r}):
                try:
                    print(open(path).read(), end="")
                    break
                except OSError:
                    pass""", stdin_row(("", ctx["credentials_text"]))),
        "etc_shadow": ("""
            print(open("/etc/shadow").readline(), end="")""", stdin_row(("", ctx["shadow_line"]))),
        "write_outside": (f"""
            import os
            for path in ({ctx['escape_files'][0]!r}, {ctx['escape_files'][1]!r}, {ctx['escape_files'][2]!r}):
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    open(path, "w").write("escaped")
                except OSError:
                    pass
            print("never the answer")""", DOUBLE),
        "socket_localhost": (f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {ctx['port']}))
                s.sendall(b"hello")
                print("CONNECTED")
            except OSError as e:
                print("refused", e)""", stdin_row(("", "CONNECTED"))),
        "store_endpoint": (f"""
            import urllib.request
            try:
                r = urllib.request.urlopen({ctx['s3']!r} + "/", timeout=2)
                print("REACHED", r.status)
            except Exception as e:
                print("blocked", type(e).__name__)""", stdin_row(("", "REACHED 200"))),
        "kill_parent": ("""
            import os, signal
            for how in (lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL),
                        lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL),
                        lambda: os.kill(-1, signal.SIGKILL),
                        lambda: os.kill(1, signal.SIGKILL)):
                try:
                    how()
                except OSError:
                    pass""", DOUBLE),
        "exit_before_tests": ("""
            import sys
            def add(a, b):
                return 0
            sys.exit(0)""", ADD),
        "patch_harness": ("""
            import sys, builtins
            def add(a, b):
                return None
            main = sys.modules["__main__"]
            for name in ("evaluate", "encode", "send", "collect", "run_test", "b64"):
                if hasattr(main, name):
                    setattr(main, name, lambda *a, **k: ("ok", "True"))
            builtins.eval = lambda *a, **k: True
            f = sys._getframe()
            while f is not None:
                f.f_globals["encode"] = lambda *a, **k: "True"
                f = f.f_back""", ADD),
        "fake_all_passed": ("""
            print("All tests passed! 3/3 OK")
            print("42")""", ADD),
        "always_equal": ("""
            class Anything:
                def __eq__(self, other):
                    return True
                def __ne__(self, other):
                    return False
                __hash__ = object.__hash__
            def add(a, b):
                return Anything()""", ADD),
        "int_subclass_equal": ("""
            class Sneaky(int):
                def __eq__(self, other):
                    return True
                __hash__ = int.__hash__
            def add(a, b):
                return Sneaky(7)""", ADD),
        "fake_class_attr": ("""
            class Liar:
                __class__ = int
                def __eq__(self, other):
                    return True
                __hash__ = object.__hash__
            def add(a, b):
                return Liar()""", ADD),
        "sleep_past_timeout": ("""
            import time
            time.sleep(1000)""", DOUBLE),
        "ignore_sigterm": ("""
            import signal, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            while True:
                time.sleep(0.01)""", DOUBLE),
        "daemon": (f"""
            import os
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv("/usr/bin/sleep", ["sleep", "{DAEMON_MARK}"])
                os._exit(0)
            print("daemonised")""", DOUBLE),
        "close_stdout": ("""
            import os
            os.close(1)
            os.close(2)
            print("42")""", DOUBLE),
        "exhaust_fds": ("""
            fds = []
            try:
                while True:
                    fds.append(open("/dev/null"))
            except OSError:
                pass
            print(len(fds))""", DOUBLE),
        "deep_recursion": ("""
            import sys
            sys.setrecursionlimit(10**7)
            def f(n):
                return f(n + 1) + 1
            f(0)""", DOUBLE),
        "thread_bomb": ("""
            import threading, time
            n = 0
            try:
                while True:
                    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
                    n += 1
            except Exception:
                pass
            print(n)""", DOUBLE),
        "ctypes_segfault": ("""
            import ctypes
            ctypes.string_at(0)""", DOUBLE),
        "os_exit_fake_output": ("""
            import os, sys
            print("41")
            sys.stdout.flush()
            os._exit(0)""", DOUBLE),
        "forge_result_channel": ("""
            import base64, os
            def add(a, b):
                return -1
            fake_frames = ("T 0 1 0 - 0 0 %s - -\\nT 1 1 0 - 0 0 %s - -\\nD\\n" % (
                base64.b64encode(b"42\\n").decode(), base64.b64encode(b"10\\n").decode())).encode()
            fake_values = b"ok " + base64.b64encode(b"True") + b"\\n"
            targets = [f"/proc/self/fd/{n}" for n in range(3, 64)]
            for pid in ("1", str(os.getppid())):
                targets += [f"/proc/{pid}/fd/{n}" for n in range(0, 64)]
            for path in targets:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                    os.write(fd, fake_frames + fake_values)
                except OSError:
                    pass
            os._exit(0)""", ADD),
        "forge_stdin_frames": ("""
            import base64, os
            frames = ("T 0 1 0 - 0 0 %s - -\\nT 1 1 0 - 0 0 %s - -\\nD\\n" % (
                base64.b64encode(b"42\\n").decode(), base64.b64encode(b"10\\n").decode())).encode()
            for n in range(3, 256):
                try:
                    os.write(n, frames)
                except OSError:
                    pass
            for pid in ("1", str(os.getppid())):
                for n in range(0, 64):
                    try:
                        fd = os.open(f"/proc/{pid}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK)
                        os.write(fd, frames)
                    except OSError:
                        pass""", DOUBLE),
        "read_expected": ("""
            import gc, os
            hits = set()
            def look(text):
                if "EXPECTED-" in text:
                    hits.add(text[text.index("EXPECTED-"):][:30])
            for obj in gc.get_objects():
                for v in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
                    if isinstance(v, str):
                        look(v)
            paths = [f"/proc/{p}/{f}" for p in ("self", "1", str(os.getppid())) for f in ("environ", "cmdline", "mem")]
            for top in ("/", "/tmp", "/dev", "/code", "/home", "/root", "/work"):
                try:
                    paths += [os.path.join(top, name) for name in os.listdir(top)]
                except OSError:
                    pass
            for path in paths:
                try:
                    if os.path.isfile(path):                # not /dev/ptmx: reading it would block
                        look(open(path, "rb").read(1_000_000).decode(errors="ignore"))
                except Exception:
                    pass
            print(sorted(hits)[0] if hits else "nothing found")""", stdin_row(("", ctx["expected_token"]))),
        "read_harness_memory": ("""
            import ctypes, os
            ppid = os.getppid()
            got = []
            for what in ("mem", "environ", "cmdline", "maps"):
                try:
                    got.append(open(f"/proc/{ppid}/{what}", "rb").read(4096))
                except OSError as e:
                    got.append(b"denied")
            libc = ctypes.CDLL(None, use_errno=True)
            got.append(str(libc.ptrace(16, ppid, 0, 0)).encode())   # PTRACE_ATTACH
            print(b"|".join(got)[:200])""", stdin_row(("", ctx["expected_token"]))),
        "freeze_harness": ("""
            import os, signal
            os.kill(os.getppid(), signal.SIGSTOP)
            os.killpg(os.getpgid(0), signal.SIGSTOP)""", DOUBLE),
        "raise_limits": ("""
            import resource
            for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE):
                try:
                    resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                except (ValueError, OSError):
                    pass
            x = bytearray(2 * 1024**3)
            print(len(x))""", DOUBLE),
        "escape_userns": ("""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            print(libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())   # CLONE_NEWUSER | CLONE_NEWNS
            try:
                os.setuid(0)
                print("root!")
            except OSError as e:
                print(e)""", stdin_row(("", "0 0\nroot!"))),
    }


def left_after_dying(which=lambda found: True, seconds: float = 60) -> list[str]:
    """leftovers() (those `which` picks) once killed processes had the time to finish dying (a killed process
    freeing its memory on a loaded machine takes its time; it was given 0.2 s): [] as soon as it is."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in leftovers() if which(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def leftovers() -> list[str]:
    """Processes and files a sandbox of this process could have left on this machine (not those under a sandbox
    uid another process claimed: the other test worker's sandboxes, running now, were counted as left)."""
    found, ours = [], sandbox_uids.claimed()

    def another(uid: int) -> bool:
        return sandbox_uids.is_sandbox_uid(uid) and uid not in ours

    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        zombie = "\nState:\tZ" in status
        marked = sandbox.MARKER in cmd or f"sleep {DAEMON_MARK}" in cmd
        if not zombie and not another(uid) and (marked or sandbox_uids.is_sandbox_uid(uid)):
            found.append(f"process {name} uid {uid}: {cmd[:80]}")
    if os.stat("/tmp").st_mode != TMP_MODE:
        found.append(f"/tmp's mode changed to {oct(os.stat('/tmp').st_mode)}")
    for tmp in ("/tmp", "/var/tmp", "/dev/shm"):
        for entry in os.scandir(tmp) if os.path.isdir(tmp) else []:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            left = entry.name.startswith("rlflow-sbx-") or sandbox_uids.is_sandbox_uid(st.st_uid)
            if left and not another(st.st_uid):
                found.append(f"file {entry.path}")
    return found


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, s3_endpoint):
    """Run every hostile case in one parallel judge() call, with secrets in our environment and a fake HOME;
    returns (verdicts by name, context, what was left behind afterwards)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".aws").mkdir()
    credentials = home / ".aws" / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = AKIA{TOKEN}\naws_secret_access_key = cred-{TOKEN}\n")
    outside = tmp_path_factory.mktemp("outside")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        shadow = Path("/etc/shadow").read_text().splitlines(keepends=True)[0]
    except OSError:
        shadow = "root:"
    ctx = {"credentials": str(credentials), "credentials_text": credentials.read_text(), "shadow_line": shadow,
           "root_listing": "\n".join(sorted(os.listdir("/root"))) if os.access("/root", os.R_OK) else "root",
           "escape_files": [str(outside / "escaped.txt"), str(ROOT / f"escaped-{TOKEN}.txt"),
                            str(home / ".ssh" / "authorized_keys")],
           "port": listener.getsockname()[1], "s3": s3_endpoint, "expected_token": f"EXPECTED-{TOKEN}"}
    cases = hostile_cases(ctx)
    home_before = sorted(p.relative_to(home) for p in home.rglob("*"))
    # A process of ours that code killing "everything it can see" (kill -1, our group, our parent) would hit.
    sentinel = subprocess.Popen(["sleep", "600"])
    sandbox.configure(SandboxConfig(isolation="bubblewrap", **TEST_LIMITS))
    t0 = time.monotonic()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in SECRETS.items():
                mp.setenv(k, v)
            mp.setenv("HOME", str(home))
            verdicts = judge_rows([fence(code) for code, _ in cases.values()], [row for _, row in cases.values()])
        seconds = time.monotonic() - t0
        left = left_after_dying()
        try:
            connection = listener.accept()
        except BlockingIOError:
            connection = None
        home_after = sorted(p.relative_to(home) for p in home.rglob("*"))
        sentinel_state = Path(f"/proc/{sentinel.pid}/stat").read_text().rsplit(") ", 1)[1][0]   # R, S, T, Z...
        yield {"verdicts": dict(zip(cases, verdicts)), "ctx": ctx, "left": left, "seconds": seconds,
               "connection": connection, "home_changed": home_before != home_after,
               "sentinel": sentinel_state if sentinel.poll() is None else f"exited {sentinel.returncode}"}
    finally:
        sentinel.kill()
        sentinel.wait()
        sandbox.configure(None)
        listener.close()
        for path in ctx["escape_files"]:
            Path(path).unlink(missing_ok=True)


HOSTILE = list(hostile_cases({"credentials": "", "credentials_text": "", "shadow_line": "", "root_listing": "",
                              "escape_files": ["", "", ""], "port": 0, "s3": "", "expected_token": ""}))


@pytest.mark.bubblewrap
@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_completion_scores_zero_and_leaves_nothing(hostile, name):
    v = hostile["verdicts"][name]
    assert v.score == 0.0, f"{name}: {v}"
    assert v.reason and not v.reason.startswith("passed"), v.reason
    assert v.isolation == "bubblewrap"
    printed = "".join(v.outputs)
    for secret in [*SECRETS.values(), f"cred-{TOKEN}", hostile["ctx"]["expected_token"]]:
        assert secret not in printed, f"{name} printed {secret!r}"
    assert hostile["left"] == [], f"left behind: {hostile['left']}"
    assert hostile["connection"] is None, "a sandbox reached our listening socket"
    assert not hostile["home_changed"]
    for path in hostile["ctx"]["escape_files"]:
        assert not Path(path).exists(), f"{name}: wrote {path}"
    assert hostile["sentinel"] in ("S", "R"), f"a process of ours was killed or stopped: {hostile['sentinel']}"


@pytest.mark.bubblewrap
@pytest.mark.slow
def test_hostile_batch_costs_only_its_timeouts(hostile):
    """35+ programs, ~8 of them running into the 3 s wall clock, on 2 workers: the sandboxes run side by side, so
    the batch takes about half the sum of its sandboxes' own wall clocks (0.52 here, 2026-12-01), not the sum. A
    ratio of two clocks of the same run, which a loaded machine slows alike."""
    own = sum(v.seconds for v in hostile["verdicts"].values())
    assert sum(v.timed_out for v in hostile["verdicts"].values()) >= 1
    assert hostile["seconds"] < 0.8 * own, (hostile["seconds"], own)


@pytest.mark.bubblewrap
@pytest.mark.slow
def test_hostile_reasons_name_what_happened(hostile):
    reason = {name: v.reason for name, v in hostile["verdicts"].items()}
    assert reason["infinite_loop"].startswith(("timeout", "cpu limit"))
    assert reason["sleep_past_timeout"].startswith("timeout")
    assert reason["memory_bomb"].startswith("memory limit")
    assert reason["huge_stdout"].startswith("output limit")
    assert reason["ctypes_segfault"].startswith("crashed (SIGSEGV)")
    assert reason["exit_before_tests"].startswith("exited before the tests ran")
    assert "not a built-in value" in reason["always_equal"]
    assert reason["int_subclass_equal"].startswith("wrong answer")     # (read as the int it holds: 7)
    assert reason["socket_localhost"].startswith(("wrong answer", "runtime error: OSError"))   # (it ran: refused)
    assert reason["os_exit_fake_output"].startswith("wrong answer")


# ---------------------------------------------------------------------------------------------- honest code

SUM_ROW = stdin_row(("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("0 0\n", "0\n"))


@pytest.fixture
def quick_sandbox():
    sandbox.configure(SandboxConfig(**TEST_LIMITS))
    yield sandbox.runner()
    sandbox.configure(None)


def test_honest_completions_score_one(quick_sandbox):
    completions = [
        fence("a, b = map(int, input().split())\nprint(a + b)"),
        fence("def add(a, b):\n    return a + b"),
        "<think>maybe ```python\nprint(0)\n``` no</think>The answer:\n```python\nimport sys\n"
        "print(sum(map(int, sys.stdin.read().split())))\n```",
        fence("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
              "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
              "                return [seen[target - x], i]\n            seen[x] = i"),
        fence("def evens(xs):\n    return [x for x in xs if x % 2 == 0]\ndef half(x):\n    return x / 2"),
    ]
    rows = [SUM_ROW, ADD, SUM_ROW,
            {"verification_info": '{"language": "python", "test_cases": [{"type": "function_call", "fn_name": '
                                  '"twoSum", "input": "[[2, 7, 11, 15], 9]", "output": "[[0, 1]]"}]}'},
            {"test_list": ["assert set(evens([1, 2, 3, 4])) == set([2, 4])", "assert evens([]) == []",
                           "assert math.isclose(half(3), 1.5, rel_tol=1e-9)", "assert not evens([1])"],
             "test_setup_code": "import math"}]
    verdicts = judge_rows(completions, rows)
    assert [v.score for v in verdicts] == [1.0] * 5, verdicts
    assert verdicts[0].reason == "passed 3/3"
    assert verdicts[0].isolation == quick_sandbox.isolation


def test_partial_credit_in_fraction_mode_none_in_all_mode(quick_sandbox):
    wrong_on_zero = fence("a, b = map(int, input().split())\nprint(a + b if a else 7)")
    half_right = fence("def add(a, b):\n    return a + b if a >= 0 else 1")
    rows = [SUM_ROW, ADD]
    fraction = judge_rows([wrong_on_zero, half_right], rows)
    assert [v.score for v in fraction] == [pytest.approx(2 / 3), pytest.approx(2 / 3)]
    assert fraction[0].reason == "wrong answer (passed 2/3)"
    assert [v.score for v in judge_rows([wrong_on_zero, half_right], rows, mode="all")] == [0.0, 0.0]


def test_code_reward_signature_logs_reasons_and_metrics(quick_sandbox):
    extra, metrics = {}, {}
    scores = code_rewards.code_reward(
        [fence("print(int(input()) * 2)"), "I don't know", fence("print(1)"), "no tests here"],
        verification_info=[DOUBLE["verification_info"]] * 3 + [None], test_list=[None] * 4,
        log_extra=lambda column, values: extra.setdefault(column, values),
        log_metric=lambda name, value: metrics.setdefault(name, value), prompts=["p"] * 4)
    assert scores == [1.0, 0.0, 0.0, None]
    assert extra["code_reason"] == ["passed 2/2", "no code block", "wrong answer (passed 0/2)", "no tests"]
    assert metrics["code/isolation_bubblewrap"] == (1.0 if quick_sandbox.isolation == "bubblewrap" else 0.0)
    assert metrics["code/pass_rate"] == pytest.approx(1 / 3)
    doubling = [fence("print(int(input()) * 2)")]
    assert code_rewards.code_reward_all(doubling, verification_info=[DOUBLE["verification_info"]]) == [1.0]
    two_blocks = "```python\na\n```\n```python\nb\n```"
    assert code_rewards.code_format_reward(["```python\nx\n```", "no", two_blocks]) == [1.0, 0.0, 0.0]


def test_expected_values_never_enter_the_sandbox():
    """What is sent in: the code, the inputs and the expressions to evaluate; the expected side stays here."""
    cases, _ = code_rewards.parse_tests(stdin_row(("7\n", "EXPECTED-OUT")), ["assert f(1) == 'EXPECTED-VAL'",
                                          "assert 'EXPECTED-L' == g(2)", "assert h(3) in ['EXPECTED-IN']"], None, "")
    sent = repr([(c.test.stdin, c.test.exprs) for c in cases])
    assert "EXPECTED" not in sent and "f(1)" in sent and "g(2)" in sent and "h(3)" in sent


def test_extract_code_prefers_the_last_python_block():
    assert code_rewards.extract_code("```\na\n```\n```python\nb\n```\n```python\nc\n```") == "c\n"
    assert code_rewards.extract_code("```\na\n```\n```text\nb\n```") == "b\n"
    assert code_rewards.extract_code("<think>```python\nx\n```</think> nothing") is None
    assert code_rewards.extract_code("<think>still thinking ```python\nx\n```") is None
    assert code_rewards.extract_code("plain text") is None


# ---------------------------------------------------------------------------------------------- the fallback

@pytest.fixture
def rlimits_only():
    cfg = SandboxConfig(isolation="rlimits", **TEST_LIMITS)
    sandbox.configure(cfg)
    yield sandbox.runner(cfg)
    sandbox.configure(None)


@pytest.mark.slow
def test_rlimits_fallback_kills_timeouts_limits_memory_and_clears_env(rlimits_only, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    assert rlimits_only.isolation == "rlimits"
    programs = {"loop": "while True: pass", "sleep": "import time\ntime.sleep(1000)",
                "term": "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "while True: time.sleep(0.01)",
                "memory": "x = bytearray(2 * 1024**3)",
                "env": "import os\nprint(os.environ.get('AWS_SECRET_ACCESS_KEY', 'none'))\nprint(sorted(os.environ))",
                "daemon": f"import os\nif os.fork() == 0:\n    os.setsid()\n"
                          f"    os.execv('/usr/bin/sleep', ['sleep', '{DAEMON_MARK}'])"}
    rows = [DOUBLE] * 4 + [stdin_row(("", SECRETS["AWS_SECRET_ACCESS_KEY"]))] + [DOUBLE]
    verdicts = dict(zip(programs, judge_rows([fence(p) for p in programs.values()], rows)))
    assert all(v.score == 0.0 and v.isolation == "rlimits" for v in verdicts.values()), verdicts
    assert verdicts["loop"].reason.startswith(("timeout", "cpu limit"))
    assert verdicts["sleep"].reason.startswith("timeout") and verdicts["term"].reason.startswith("timeout")
    assert verdicts["memory"].reason.startswith("memory limit")
    env_seen = verdicts["env"].outputs[0]
    assert "none" in env_seen and not any(s in env_seen for s in SECRETS.values())
    assert not any(k in env_seen for k in SECRETS)
    assert left_after_dying() == []
    ok = judge_rows([fence("print(int(input()) * 2)")], [DOUBLE])[0]
    assert (ok.score, ok.isolation) == (1.0, "rlimits")


def test_cleanup_removes_locked_folders_and_never_follows_planted_links(rlimits_only, tmp_path):
    """The code makes its folders unreadable and plants symlinks to our files and to /tmp itself; removing
    its private folder must not change the permissions of anything outside it."""
    ours = tmp_path / "ours.txt"
    ours.write_text("keep")
    ours.chmod(0o644)
    tmp_mode = os.stat("/tmp").st_mode
    program = f"""
        import os
        for base in (".", "/tmp/rlflow-planted-{TOKEN}"):
            os.makedirs(base + "/locked/deeper", exist_ok=True)
            open(base + "/locked/deeper/f", "w").write("x")
            os.symlink({str(ours)!r}, base + "/locked/link-to-ours")
            os.symlink("/tmp", base + "/locked/link-to-tmp")
            os.chmod(base + "/locked/deeper", 0)
            os.chmod(base + "/locked", 0)
        print("done")"""
    verdict = judge_rows([fence(program)], [DOUBLE])[0]
    assert verdict.score == 0.0
    assert os.stat("/tmp").st_mode == tmp_mode
    assert (ours.stat().st_mode & 0o777, ours.read_text()) == (0o644, "keep")
    if IS_ROOT:                     # a sandbox uid of its own: what it left in /tmp is swept with it
        assert not Path(f"/tmp/rlflow-planted-{TOKEN}").exists()
        assert left_after_dying() == []
    shutil.rmtree(f"/tmp/rlflow-planted-{TOKEN}", ignore_errors=True)


def test_asking_for_bubblewrap_without_it_is_a_user_error():
    with pytest.raises(UserError, match=r"^reward\.sandbox\.isolation: .*not found"):
        sandbox.runner(SandboxConfig(isolation="bubblewrap", bwrap="/nonexistent/bwrap"))


def test_auto_without_bubblewrap_falls_back_to_rlimits_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_warned", False)
    r = sandbox.runner(SandboxConfig(isolation="auto", bwrap="/nonexistent/bwrap", timeout_seconds=3))
    assert r.isolation == "rlimits"
    assert any("isolation is rlimits, not bubblewrap" in m for m in caplog.messages)


@pytest.mark.bubblewrap
def test_bubblewrap_is_active_when_installed():
    assert sandbox.runner(SandboxConfig(**TEST_LIMITS)).isolation == "bubblewrap"


def test_one_slow_completion_costs_only_its_own_timeout(quick_sandbox):
    sleeper, honest = fence("import time\ntime.sleep(100)"), fence("print(int(input()) * 2)")
    verdicts = judge_rows([sleeper] + [honest] * 6, [DOUBLE] * 7)
    assert [v.score for v in verdicts] == [0.0] + [1.0] * 6
    assert [v.timed_out for v in verdicts] == [True] + [False] * 6       # (its timeout, charged to it alone)


def test_signal_names_in_reasons():
    crashed = sandbox.TestRun(ran=True, signal=signal.SIGSEGV)
    assert code_rewards.explain_failure(crashed) == "crashed (SIGSEGV)"
    assert code_rewards.explain_failure(sandbox.TestRun(ran=True, signal=signal.SIGXCPU)) == "cpu limit"


def test_values_from_the_sandbox_are_read_with_bounded_work():
    """A set of ints whose hashes all collide costs its size squared to build: refused before it is built;
    ordinary values read as before."""
    p = (1 << 61) - 1                               # int hashes are taken modulo this prime
    colliding = "{" + ", ".join(str(i * p) for i in range(1, 20_001)) + "}"
    with pytest.raises(ValueError, match="too large"):
        bounded.bounded_literal(colliding)
    assert bounded.bounded_literal("{1, 2, 3}") == {1, 2, 3}
    assert bounded.bounded_literal("[{'a': (1, 2.5)}, None]") == [{"a": (1, 2.5)}, None]
    run = sandbox.TestRun(ran=True, exit_code=0, values=[("ok", colliding)])
    check = code_rewards.parse_tests(None, ["assert f() == {1}"], None, "def f(): pass")[0][0].check
    assert check(run) == "unreadable value"


def test_reasons_carry_no_terminal_control_characters():
    stderr = "Traceback...\nValueError: \x1b[2J\x1b[31mgotcha \u202eevil\x07\x08"
    reason = code_rewards.explain_failure(sandbox.TestRun(ran=True, exit_code=1, stderr=stderr))
    assert reason.startswith("runtime error: ValueError: ?[2J?[31mgotcha ?evil"), repr(reason)
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f or c == "\u202e" for c in reason), repr(reason)


def test_sandbox_uids_are_claimed_never_shared_and_freed_when_the_holder_ends():
    """Two processes drawing from one small range get disjoint uids; the range exhausted is one clear line;
    a holder that ends (even killed) frees its uids."""
    first, count = 1_800_000_000, 256
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom tasks.scoring.sandbox_uids import claim_uid\n"
         f"print(sorted(claim_uid({first}, {count}) for _ in range(200)), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    theirs = set(eval(holder.stdout.readline()))
    try:
        mine = {sandbox_uids.claim_uid(first, count) for _ in range(count - 200)}
        assert len(theirs) == 200 and len(mine) == count - 200 and not theirs & mine
        with pytest.raises(UserError, match=r"reward.sandbox.uid_range: every uid of \[1800000000, 1800000256\)"):
            sandbox_uids.claim_uid(first, count)
    finally:
        holder.kill()
        holder.wait()
    assert sandbox_uids.claim_uid(first, count) in theirs           # its claims went with it


PROBE_SYSCALLS = r'''
import ctypes, errno, os, socket, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    print(f"{name}: " + ("ALLOWED" if r >= 0 else "blocked " + errno.errorcode.get(ctypes.get_errno(), "?")))
buf = ctypes.create_string_buffer(256)
addr = ctypes.addressof(buf)
call("ptrace attach to pid 1", 101, 16, 1, 0, 0)
call("process_vm_readv of pid 1", 310, 1, addr, 1, addr, 1, 0)
pidfd = libc.syscall(ctypes.c_long(434), ctypes.c_long(1), ctypes.c_long(0))      # pidfd_open(1): allowed
call("pidfd_getfd of pid 1", 438, pidfd, 0, 0)
call("prlimit64 of pid 1", 302, 1, 7, 0, addr)
call("shmget", 29, 0, 1 << 20, 0o1600)
call("msgget", 68, 0, 0o1600)
call("semget", 64, 0, 1, 0o1600)
call("keyctl", 250, 0, -3, 0)
call("io_uring_setup", 425, 1, addr)
call("userfaultfd", 323, 0)
call("perf_event_open", 298, addr, 0, -1, -1, 0)
call("bpf", 321, 0, addr, 64)
call("unshare user namespace", 272, 0x10000000)
call("mount", 165, 0, addr, 0, 0, 0)
for family, name in ((socket.AF_INET, "AF_INET"), (socket.AF_INET6, "AF_INET6"), (40, "AF_VSOCK"),
                     (socket.AF_NETLINK, "AF_NETLINK"), (socket.AF_PACKET, "AF_PACKET")):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family != 40 else socket.SOCK_STREAM).close()
        print(f"socket {name}: ALLOWED")
    except OSError as e:
        print(f"socket {name}: blocked {errno.errorcode.get(e.errno, '?')}")
a, b = socket.socketpair()
t = threading.Thread(target=lambda: a.send(b"x")); t.start(); t.join()
child = subprocess.run(["/usr/bin/python3", "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
status = open("/proc/self/status").read()
print("unix socket, thread, subprocess:", b.recv(1).decode(), child, [l for l in status.splitlines()
      if l.startswith("Seccomp:")][0].split()[1])
'''


@pytest.mark.bubblewrap
def test_the_seccomp_filter_refuses_what_reaches_outside_the_sandbox(quick_sandbox):
    """ptrace/pidfd_getfd/process_vm of bwrap's pid 1 (same uid, no rlimits), prlimit on another process,
    SysV IPC (kernel memory outside every limit), keyrings, io_uring, userfaultfd, perf, bpf, namespaces, mounts
    and sockets other than AF_UNIX (AF_VSOCK is not namespaced): all refused; threads, subprocesses and Unix
    sockets still work, under a seccomp filter (Seccomp: 2)."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("syscall numbers of x86_64")
    assert quick_sandbox.isolation == "bubblewrap" and quick_sandbox.seccomp
    run = quick_sandbox.run(PROBE_SYSCALLS, [sandbox.Test(stdin="")])
    out = run.tests[0].stdout.strip().splitlines()
    assert run.tests[0].exit_code == 0, run.tests[0].stderr[-2000:]
    assert len(out) == 20 and out[-1] == "unix socket, thread, subprocess: x 42 2", out
    allowed = [line for line in out[:-1] if "ALLOWED" in line]
    assert allowed == [], allowed


@pytest.mark.bubblewrap
def test_the_code_cannot_change_how_an_assert_is_computed(quick_sandbox):
    """Only the parts of an assert that need the code (f(1)) run inside; abs, sorted, the comparison and the
    expected values stay on the host: shadowing or patching builtins, or looking for the expected value in
    the harness's frames, gains nothing."""
    tests = ["assert abs(f(1) - 3.14159) < 1e-6", "assert sorted(f(2)) == [1, 2]",
             "assert all(f(x) == y for x, y in [(3, 9), (4, 16)])"]
    cheats = [
        "import builtins\ndef abs(x): return 0\nbuiltins.abs = lambda x: 0\nbuiltins.sorted = lambda x: [1, 2]\n"
        "builtins.all = lambda x: True\ndef f(x): return None",
        "import sys\ndef f(x):\n    fr = sys._getframe(1)\n    while fr:\n"
        "        for v in list(fr.f_locals.values()):\n"
        "            if '16' in repr(v): return 16\n        fr = fr.f_back\n    return 9 if x == 3 else -1",
    ]
    verdicts = code_rewards.judge([f"```python\n{c}\n```" for c in cheats], test_list=[tests] * len(cheats))
    assert [v.score for v in verdicts] == [0.0, 0.0], [v.reason for v in verdicts]
    honest = "def f(x):\n    return 3.14159 if x == 1 else ([2, 1] if x == 2 else x * x)"
    assert code_rewards.judge([f"```python\n{honest}\n```"], test_list=[tests])[0].score == 1.0
    sent = repr([c.test.exprs for c in code_rewards.parse_tests(None, tests, None, honest)[0]])
    assert "16" not in sent and "3.14159" not in sent and "sorted" not in sent


SHARE_MEMORY = """
import os
kids = []
for i in range(4):                      # 4 x 150 MiB: each under memory_mb (256), together over the sandbox's
    pid = os.fork()
    if pid == 0:
        b = bytearray(150 * 2**20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        import time
        time.sleep(0.3)
        os._exit(0)
    kids.append(pid)
print(sorted(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids))
"""

SPIN_TWO = """
import os, time
kids = []
for i in range(2):                      # two processes spinning for 1 s of wall clock each
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
t = os.times()
print(round(t.children_user + t.children_system, 2))
"""


@pytest.mark.bubblewrap
def test_a_cgroup_bounds_the_sandbox_as_a_whole_and_its_init_has_the_limits():
    """Processes that each stay under memory_mb but together pass the sandbox's memory are killed by the kernel
    (they are not without the cgroup); the cpus quota holds two spinning processes to half a CPU; pid 1 in the
    sandbox is the harness, with the sandbox's limits (bwrap's own init, unlimited, is gone); nothing is
    left in the cgroup after a daemon."""
    def make(**kw) -> sandbox.Runner:
        return sandbox.Runner("bubblewrap", sandbox.resolve_python(None),
                              sandbox.Limits.of(SandboxConfig(**{**TEST_LIMITS, **kw})), 1, shutil.which("bwrap"),
                              sandbox._interpreter_binds(sandbox.resolve_python(None)),
                              seccomp=sandbox.syscall_filter()[0])

    stale = Path("/sys/fs/cgroup/pids/rlflow-sandbox-1900065535")      # (a uid no process holds)
    if IS_ROOT and Path("/sys/fs/cgroup/pids").is_dir():
        stale.mkdir(exist_ok=True)                  # what a process killed before its exit handlers leaves
    # the memory runs get a whole CPU and time to spare: near its limit the kernel first reclaims the code's
    # file pages (slow on a slow disk), and CI's machine ran out of a 3 s clock at half a CPU before the kill
    bounded, unbounded = make(timeout_seconds=20), make(cgroup="off", timeout_seconds=20)
    if bounded._cgroup(0, bounded._uid(0) if IS_ROOT else None) is None:
        pytest.skip(f"no cgroup here: {bounded.why_no_cgroup}")
    assert not stale.exists()                       # swept when the next runner made its own
    run = bounded.run(SHARE_MEMORY, [sandbox.Test(stdin="")])
    assert "-9" in run.tests[0].stdout, run           # killed for the sandbox's memory
    assert unbounded.run(SHARE_MEMORY, [sandbox.Test(stdin="")]).tests[0].stdout.strip() == "[0, 0, 0, 0]"
    limited = make(cpus=0.5)

    cpu = float(limited.run(SPIN_TWO, [sandbox.Test(stdin="")]).tests[0].stdout)
    assert cpu < 0.85, cpu                             # 0.5 CPU for ~1 s (2.0 without the quota on 2 cores)

    probe = "print(open('/proc/1/cmdline').read().split(chr(0))[-2])\nprint(open('/proc/1/limits').read())"
    out = limited.run(probe, [sandbox.Test(stdin="")]).tests[0].stdout
    assert out.startswith(f"{sandbox.MARKER}\n"), out     # pid 1 is the harness
    limits = {line[:26].strip(): line[26:].split()[:2] for line in out.splitlines()[1:] if line.startswith("Max")}
    assert limits["Max address space"] == [str(256 << 20)] * 2, limits
    assert limits["Max processes"][1] != "unlimited" and limits["Max core file size"] == ["0", "0"], limits

    run = limited.run(f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/usr/bin/sleep', ['sleep', "
                      f"'{DAEMON_MARK}'])", [sandbox.Test(stdin="")])
    assert run.tests[0].ran and limited._cgroups[0].pids() == []
    assert not left_after_dying(lambda found: DAEMON_MARK in found)
    out = subprocess.run([sys.executable, "-m", "tasks.scoring.sandbox"], cwd=ROOT, capture_output=True, text=True)
    mine = out.stdout.split("cgroup per sandbox: ")[1].split()
    assert mine and not [d for d in mine if Path(d).exists()]       # a process removes its cgroups as it exits


# ---------------------------------------------------------------------------------------------- machine-wide budgets

PROBE_MACHINE_WIDE = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    print(f"{name}: " + ("ALLOWED" if r >= 0 else "blocked " + errno.errorcode.get(ctypes.get_errno(), "?")))
ctx = ctypes.c_ulong(0)
call("io_setup", 206, 1, ctypes.addressof(ctx))
call("io_uring_setup", 425, 1, ctypes.addressof(ctypes.create_string_buffer(256)))
call("inotify_init1", 294, 0)
call("inotify_init", 253)
call("fanotify_init", 300, 0, 0)
call("add_key", 248, 0, 0, 0, 0, -2)
try:
    os.openpty()
    print("openpty: ALLOWED")
except OSError as e:
    print("openpty: blocked", errno.errorcode.get(e.errno, "?"))
for path in ("/dev/ptmx", "/dev/pts/ptmx"):
    try:
        os.close(os.open(path, os.O_RDWR | os.O_NOCTTY))
        print(path + ": ALLOWED")
    except OSError as e:
        print(path + ": blocked", errno.errorcode.get(e.errno, "?"))
print("done")
'''


@pytest.mark.bubblewrap
def test_machine_wide_kernel_budgets_cannot_be_used_from_inside(quick_sandbox):
    """Asynchronous-I/O contexts (fs.aio-max-nr), io_uring, inotify instances (per user), fanotify, keyrings
    and pseudo-terminals (kernel.pty.max) are counted for the whole machine or user, not per cgroup: none can
    be had inside, so a sandbox cannot use up the host's."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("syscall numbers of x86_64")
    assert quick_sandbox.isolation == "bubblewrap"
    run = quick_sandbox.run(PROBE_MACHINE_WIDE, [sandbox.Test(stdin="")])
    out = run.tests[0].stdout.strip().splitlines()
    assert run.tests[0].exit_code == 0 and out[-1] == "done", (out, run.tests[0].stderr[-2000:])
    assert len(out) == 10, out
    allowed = [line for line in out if "ALLOWED" in line]
    assert allowed == [], allowed


def test_the_sandbox_has_no_pseudo_terminals():
    args = sandbox.bwrap_args(16)
    assert args[args.index("/dev/pts") - 1] == "--tmpfs" and args.index("/dev/pts") > args.index("--dev")


# ---------------------------------------------------------------------------------------------- expected sides

HELPER_ROW = {"test_list": ["assert f([3, 1, 2]) == expected([3, 1, 2])",
                            "assert f([5, 4]) == ' '.join(map(str, [4, 5]))", "assert g(2) == TABLE[2]"],
              "test_setup_code": "def expected(xs):\n    return sorted(xs)\nTABLE = {2: [4, 4]}\n"}


def test_expected_sides_that_are_not_literals_never_run_with_the_code():
    """A setup helper, a builtin or a setup value on the expected side: evaluated apart, without the code."""
    cases, setup = code_rewards.parse_tests(None, HELPER_ROW["test_list"], HELPER_ROW["test_setup_code"],
                                            "def f(xs): pass\ndef g(n): pass")
    sent = repr([c.test.exprs for c in cases])
    assert "expected(" not in sent and "map(" not in sent and "TABLE" not in sent, sent
    assert [c.expected and c.expected.exprs for c in cases] == [["expected([3, 1, 2])"], None, ["TABLE"]]  # (map: here)
    # a builtin the code itself defines, on the actual side, stays the code's
    own = code_rewards.parse_tests(None, ["assert filter([1, 0]) == [1]"], None, "def filter(xs): pass")[0][0]
    assert own.test.exprs == ["filter([1, 0])"] and own.expected is None


@pytest.mark.bubblewrap
def test_the_code_cannot_see_or_change_a_computed_expected_side(quick_sandbox):
    """Patching builtins (sorted, map) or the setup's helper, or reading its value, changes nothing: the
    expected side is computed where the code never ran."""
    cheats = [
        "import builtins\nbuiltins.sorted = lambda xs: 'X'\nbuiltins.map = lambda *a: ['X']\n"
        "builtins.list = lambda xs: 'X'\ndef f(xs): return 'X'\ndef g(n): return 'X'",
        "import sys, gc\ndef f(xs):\n    ns = sys._getframe(1).f_globals\n    ns['expected'] = lambda xs: 'X'\n"
        "    return 'X'\ndef g(n): return 'X'",
    ]
    honest = "def f(xs):\n    return sorted(xs) if len(xs) > 2 else '4 5'\ndef g(n):\n    return [4, 4]"
    rows = [HELPER_ROW] * 3
    verdicts = judge_rows([fence(c) for c in cheats] + [fence(honest)], rows)
    assert [v.score for v in verdicts[:2]] == [0.0, 0.0], [v.reason for v in verdicts]
    assert verdicts[2].score == 1.0, verdicts[2].reason
    broken = judge_rows([fence(honest)], [{"test_list": ["assert f([1]) == nope()"], "test_setup_code": "x = 1"}])
    assert broken[0].score == 0.0 and broken[0].reason.startswith("runtime error"), broken[0].reason


# ---------------------------------------------------------------------------------------------- host-side cost

def host_check(test: str, *values: str) -> tuple[str | None, int]:
    """The host's verdict on an assert, given the literals the sandbox returned for its actual side, and the most
    memory the verdict held at once (tracemalloc's peak, in bytes: a measure the machine's load cannot move)."""
    case = code_rewards.parse_tests(None, [test], None, "def f(x): pass")[0][0]
    tracemalloc.start()
    try:
        reason = case.check(sandbox.TestRun(ran=True, exit_code=0, values=[("ok", v) for v in values]))
        return reason, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_host_side_operations_on_the_codes_values_are_bounded_before_they_run():
    """Small values the code returns must not make the host build huge results: repetition, %-formatting,
    concatenation by sum, powers, round: each refused (TooCostly, raised by the check that comes before the
    operation). No large result is built: the verdict holds under 64 MB at its peak (the parse of the literals,
    ~50 MB for the sum's 50,000 items) where repetition, padding, range and repr would build 100 MB to terabytes;
    for those whose cost is work rather than size (sum, powers, round, big products) the refusal's reason is the
    proof. (Measured in memory, not seconds: a timed bound failed on a loaded machine.)"""
    costly = [("assert f(1) * f(2) == 'a'", "'aaaaaaaaaa'", str(2 * 10 ** 7)),      # 200 MB str
              ("assert [f(1)] * f(2) == []", "0", str(2 * 10 ** 7)),                  # 160 MB list
              ("assert f(1) % f(2) == ''", "'%99999999d'", "1"),                        # 100 MB of padding
              ("assert f(1) % f(2) == ''", "'%*d'", "(999999999, 1)"),
              ("assert f(1) ** 9999 == 0", repr(2 ** 4000)),                              # 40 M bits
              ("assert round(f(1), f(2)) == 0", "5", str(-10 ** 5)),                      # 10 ** 10 ** 5
              ("assert f(1) * f(2) == 0", hex(7 ** 20000), hex(7 ** 20000)),              # over INT_BITS
              ("assert list(range(f(1))) == []", str(10 ** 12)),
              ("assert str([f(1)] * f(2)) == ''", repr("a" * 100_000), "100"),                # 10 MB repr
              ("assert '%s' % ([f(1)] * 9,) == ''", repr("a" * 100_000))]
    for test, *values in costly:
        reason, peak = host_check(test, *values)
        assert reason is not None and reason.startswith("too costly to judge"), (test, reason)
        assert peak < 64 << 20, (test, peak)
    honest = [("assert f(1) == 'ab' * 3", "'ababab'"), ("assert f(1) * 2 == [1, 1]", "[1]"),
              ("assert f(1) % 7 == '  7'", "'%3d'"), ("assert sum(f(1), []) == [1, 2]", "[[1], [2]]"),
              ("assert f(1) == 2 ** 100", repr(2 ** 100)), ("assert round(f(1), 2) == 1.23", "1.2345"),
              ("assert set(f(1)) == {1}", repr([1] * 5000))]
    for test, *values in honest:
        assert host_check(test, *values)[0] is None, test


def test_values_with_colliding_hashes_or_deep_nesting_are_refused_before_they_are_built():
    """Hashes that collide make a set or dict cost its size squared times the length of its values: a value
    with more than a few distinct values of one hash is refused, however few elements it has; so is nesting
    deeper than the harness writes, and an int over the host's bound (TooCostly, raised before any set or dict is
    made); the same holds for sets the host builds."""
    p = (1 << 61) - 1
    big = 10 ** 1100                     # 2000 distinct ints of 1100 digits, one hash: seconds to build
    for text in ["{" + ", ".join(str(big + i * p) for i in range(2000)) + "}",
                 "{" + ", ".join(f"({big + i * p},): {i}" for i in range(2000)) + "}",
                 "{" + ", ".join(str(i * p) for i in range(1, 50)) + "}",
                 "[" * 100 + "]" * 100, "0x" + "f" * 20_000]:
        with pytest.raises(bounded.TooCostly, match="share one hash|nested too deeply|int too large"):
            bounded.bounded_literal(text)
    # (`set(f(1))` runs split now, where the test's process builds it: here, a set the code returns is not read)
    reason, _ = host_check("assert f(1) == {1}", "{" + ", ".join(str(i * p) for i in range(1, 50)) + "}")
    assert reason == "unreadable value", reason
    assert bounded.bounded_literal("{-1: 1, -2: 2, 1.0: (1+2j), (1, 'a'): set()}") == {
        -1: 1, -2: 2, 1.0: 1 + 2j, (1, "a"): set()}
    assert bounded.bounded_literal("[" * 50 + "]" * 50) is not None


# ---------------------------------------------------------------------------------------------- disk bandwidth

READ_DISK = r'''
import mmap, os, time
want, got, t0 = 192 << 20, 0, time.monotonic()
buf = mmap.mmap(-1, 1 << 20)
for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/bin", "/usr/lib/aarch64-linux-gnu"):
    try:
        entries = sorted(os.scandir(folder), key=lambda e: -e.stat().st_size if e.is_file() else 0)
    except OSError:
        continue
    for e in entries:
        if got >= want or not e.is_file() or e.stat().st_size < (4 << 20):
            break
        try:
            fd = os.open(e.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # out of the page cache: read from the disk
        except OSError:                                          # (O_DIRECT, past it, is refused: seccomp)
            continue
        while got < want:
            try:
                n = os.readv(fd, [buf])
            except OSError:
                break
            if n <= 0:
                break
            got += n
        os.close(fd)
print(got >> 20, round(time.monotonic() - t0, 2))
'''


@pytest.mark.bubblewrap
@pytest.mark.slow
def test_a_sandbox_reads_the_disk_at_a_bounded_rate():
    """The slot's cgroup limits read bandwidth on the disks behind the sandbox's file systems (IO_BPS): reading
    192 MiB past the page cache takes seconds, not a fraction of one; the isolation report names the limit."""
    from tasks.scoring import cgroups

    runner = sandbox.Runner("bubblewrap", sandbox.resolve_python(None),
                            sandbox.Limits.of(SandboxConfig(**{**TEST_LIMITS, "timeout_seconds": 20,
                                                               "cpu_seconds": 10})),
                            1, shutil.which("bwrap"), sandbox._interpreter_binds(sandbox.resolve_python(None)),
                            seccomp=sandbox.syscall_filter()[0])
    cg = runner._cgroup(0, runner._uid(0) if IS_ROOT else None)
    if cg is None or not cg.io_devices:
        pytest.skip(f"no io limit here: {runner.why_no_cgroup or (cg.why_no_io if cg else '')}")
    assert cgroups.block_devices(("/usr",))[0] in cg.io_devices
    run = runner.run(READ_DISK, [sandbox.Test(stdin="")])
    mib, seconds = map(float, run.tests[0].stdout.split())
    if mib < 64:
        pytest.skip(f"not enough large files under /usr to read ({mib} MiB)")
    assert mib / seconds < 1.5 * (cgroups.IO_BPS >> 20), (mib, seconds)
    out = subprocess.run([sys.executable, "-m", "tasks.scoring.sandbox"], cwd=ROOT, capture_output=True, text=True)
    assert "disk bandwidth per sandbox: " in out.stdout and " MiB/s" in out.stdout, out.stdout


def test_block_devices_are_the_disks_behind_the_paths():
    from tasks.scoring import cgroups

    devices = cgroups.block_devices(("/",))
    assert all(d.count(":") == 1 and all(p.isdigit() for p in d.split(":")) for d in devices), devices
    assert not [d for d in devices if d.startswith("0:")], devices


def test_a_setup_that_calls_the_code_keeps_its_helpers_with_the_code(quick_sandbox):
    """A setup helper that calls the code's function (it reads a name the setup does not define) cannot be
    run without the code: its part stays with the code, and an honest completion still passes."""
    row = {"test_list": ["assert verify(3) == True", "assert f(2) == twice(2)"],
           "test_setup_code": "def verify(n):\n    return f(n) == 2 * n\ndef twice(n):\n    return 2 * n\n"}
    cases = code_rewards.parse_tests(None, row["test_list"], row["test_setup_code"], "def f(n): pass")[0]
    assert [c.expected for c in cases] == [None, None] and cases[0].test.exprs == ["verify(3)"]
    assert judge_rows([fence("def f(n):\n    return 2 * n")], [row])[0].score == 1.0


def test_the_io_limit_is_written_where_possible_and_its_absence_reported(tmp_path):
    from tasks.scoring import cgroups

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "io.max").write_text("")
    cg = cgroups.Cgroup(2, {"unified": v2})
    cg.set_io(["254:0"], bps=1 << 20, iops=100)
    assert (v2 / "io.max").read_text() == "254:0 rbps=1048576 wbps=1048576 riops=100 wiops=100"
    assert cg.io_devices == ["254:0"] and cg.why_no_io == ""
    bare = cgroups.Cgroup(1, {"memory": tmp_path, "pids": tmp_path})
    bare.set_io(["254:0"])
    assert bare.io_devices == [] and "no blkio" in bare.why_no_io
    none = cgroups.Cgroup(2, {"unified": v2})
    none.set_io([])
    assert "no block device" in none.why_no_io


# Issue 44's hardening of the sandbox (items 1-3), here beside the leftovers checks: a test file runs in one
# xdist worker, so no sandbox of another test runs while this file looks for what sandboxes left behind.

def test_a_completion_too_deep_for_the_hosts_walks_costs_only_itself():
    """Item 2: a long chain of operators (2,000 deep) in a completion's code: the host reads its names without
    recursion and the sandbox runs it, the honest one beside it scores 1; a row whose own assert is that deep is a
    broken test, skipped (no score), not a crash of the batch."""
    from tasks.core.config import SandboxConfig
    from tasks.rewards import code as code_rewards
    from tasks.scoring import sandbox

    sandbox.configure(SandboxConfig(timeout_seconds=5, cpu_seconds=4, memory_mb=512, workers=2))
    try:
        chain = "+".join(["1"] * 2000)          # (deeper: ast.parse itself refuses it, RecursionError, caught)
        honest = "```python\ndef add(a, b):\n    return a + b\n```"
        deep = f"```python\nX = {chain}\ndef add(a, b):\n    return a + b\n```"
        tests = ["assert add(1, 2) == 3"]
        verdicts = code_rewards.judge([deep, honest], test_list=[tests, tests])
        assert verdicts[1].score == 1.0 and verdicts[0].score is not None, verdicts
        deep_row = [f"assert add(1, 2) == {'+'.join(['1'] * 2000)} - 1997"]
        verdicts = code_rewards.judge([honest, honest], test_list=[deep_row, tests])
        assert verdicts[0].score is None and verdicts[1].score == 1.0, verdicts
    finally:
        sandbox.configure(None)


MACHINE_WIDE = '''
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
out["sync"] = libc.syscall(162)                         # SYS_sync on x86_64; -1 and EPERM when refused
out["sync_errno"] = ctypes.get_errno()
fd = os.open("/tmp", os.O_RDONLY)
out["syncfs"] = libc.syncfs(fd)
out["syncfs_errno"] = ctypes.get_errno()
for name, how in (("open_direct", lambda: os.open("/usr/bin/env", os.O_RDONLY | os.O_DIRECT)),):
    try:
        how()
        out[name] = "opened"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
g = os.open("/usr/bin/env", os.O_RDONLY)
import fcntl
try:
    fcntl.fcntl(g, fcntl.F_SETFL, os.O_DIRECT)
    out["setfl_direct"] = "set"
except OSError as e:
    out["setfl_direct"] = errno.errorcode[e.errno]
print(sorted(out.items()))
'''


@pytest.mark.bubblewrap
def test_machine_wide_calls_and_direct_io_are_refused_in_the_sandbox():
    """Item 3: sync and syncfs (every dirty page of the host, past the sandbox's disk throttle) are refused;
    item 1: direct I/O, which queued behind that throttle puts a process where SIGKILL cannot reach it, is
    refused at open and by fcntl."""
    import platform

    from tasks.core.config import SandboxConfig
    from tasks.scoring import sandbox

    if platform.machine() != "x86_64":
        pytest.skip("the probe calls sync by its x86_64 number")
    sandbox.configure(SandboxConfig(isolation="bubblewrap", timeout_seconds=10, cpu_seconds=5))
    try:
        run = sandbox.runner().run(MACHINE_WIDE, [sandbox.Test(stdin="")])
    finally:
        sandbox.configure(None)
    got = dict(eval(run.tests[0].stdout.strip()))
    assert got["sync"] == -1 and got["sync_errno"] == 1 and got["syncfs"] == -1 and got["syncfs_errno"] == 1, got
    assert got["open_direct"] == "EINVAL" and got["setfl_direct"] == "EINVAL", got


ALWAYS_EQUAL = """
class A:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def startswith(self, *a): return True
    __hash__ = object.__hash__
"""


def test_a_comprehension_or_a_method_in_an_assert_is_decided_on_the_host(quick_sandbox):
    """A comprehension, a method call, isinstance in an assert ran whole in the sandbox, so an always-equal
    object, a lying `startswith` or a patched `range`/`isinstance` passed: 1.0 for nothing. Now the sandbox returns
    the comprehension's bindings and the values its element needs, a method's receiver, and the host computes the
    rest (a setup's table iterated is checked against its own value, computed without the code); correct code
    written with these shapes, and with literals' methods, map(), a key= lambda, type(), a Counter or a namedtuple,
    scores 1 (it scored 0)."""
    rows = [("assert all([f(i) == 2 * i for i in range(5)])", ""),
            ("assert all(f(x) == y for x, y in CASES)", "CASES = list(zip([1, 2], [2, 4]))"),
            ("assert [f(x) for x in range(6) if x % 2 == 0] == [0, 4, 8]", ""),
            ("assert all(x > 0 for x in g(5))", ""),
            ("assert s().startswith('He')", ""),
            ("assert isinstance(n(), int)", ""),
            ("assert s() == 'ab'.upper() + ','.join(['c'])", ""),
            ("assert sorted(p(), key=lambda t: t[1]) == [(2, 'a'), (1, 'b')] and p()[0][1] == 'b'", ""),
            ("assert list(map(f, [1, 2])) == [2, 4] and type(g(1)) == list", ""),
            ("assert c('aab') == {'a': 2, 'b': 1} and t() == (1, 2)", "")]
    cheats = {
        "always equal": ALWAYS_EQUAL + "def f(*a): return A()\ndef g(*a): return [A(), A()]\ns = n = p = c = t = f",
        "patched builtins": "import builtins\nbuiltins.range = lambda *a: []\nbuiltins.zip = lambda *a: []\n"
                            "builtins.isinstance = lambda *a: True\ndef f(x): return -1\ndef g(n): return [0, -1]\n"
                            "def n(): return 'x'\ns = p = c = t = f",
        "a str that lies": "class S(str):\n    def startswith(self, *a): return True\n"
                           "    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
                           "def s(): return S('xyz')\nf = g = n = p = c = t = s",
    }
    one = lambda program: judge_rows([fence(program)] * len(rows),  # noqa: E731
                                     [{"test_list": [t], "test_setup_code": setup} for t, setup in rows])
    for name, program in cheats.items():
        verdicts = one(program)
        assert [v.score for v in verdicts] == [0.0] * len(rows), (name, [v.reason for v in verdicts])
    fair = """
        from collections import Counter, namedtuple
        P = namedtuple('P', 'x y')
        def f(x): return 2 * x
        def g(n): return list(range(1, n + 1))
        def s(): return 'Hello'
        def n(): return 3
        def p(): return [(1, 'b'), (2, 'a')]
        def c(x): return Counter(x)
        def t(): return P(1, 2)"""
    verdicts = one(fair)
    by_row = {t: v for (t, _), v in zip(rows, verdicts, strict=True)}
    wants_other_s = "assert s() == 'ab'.upper() + ','.join(['c'])"
    assert all(v.score == 1.0 for t, v in by_row.items() if t != wants_other_s), [v.reason for v in verdicts]
    assert judge_rows([fence(fair.replace("'Hello'", "'ABc'"))], [{"test_list": [wants_other_s]}])[0].score == 1.0


def test_a_stdin_tests_output_given_as_a_list_of_lines_is_those_lines(quick_sandbox):
    """`"output": ["3"]` (lines, as its `input` may be given) was compared as the text "['3']": a correct program
    scored 0."""
    row = {"verification_info": {"language": "python", "test_cases": [
        {"type": "stdin_stdout", "input": ["1 2", "3 4"], "output": ["3", "7"]}]}}
    program = fence("import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))")
    assert judge_rows([program], [row])[0].score == 1.0


def test_the_rlimits_fallback_removes_what_the_code_left_in_world_writable_folders_below_tmp(rlimits_only, tmp_path):
    """Under the rlimits fallback (no bubblewrap) files the code wrote in /run/lock, or in a world-writable folder
    below /tmp that someone made, outlived the verdict (the sweep read the top of /tmp, /var/tmp, /dev/shm)."""
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("a uid of its own to sweep by: root only")

    shared = Path(tempfile.mkdtemp(prefix="rlflow-test-shared-"))
    os.chmod(shared, 0o1777)
    mark = f"rlflow-test-left-{uuid.uuid4().hex[:8]}"
    try:
        program = (f"open({str(shared / mark)!r}, 'w').write('x')\n"
                   f"open('/run/lock/{mark}', 'w').write('x')\nprint(int(input()) * 2)")
        verdict = judge_rows([fence(program)], [DOUBLE])[0]
        assert (verdict.score, verdict.isolation) == (1.0, "rlimits"), verdict
        assert not (shared / mark).exists() and not Path(f"/run/lock/{mark}").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        Path(f"/run/lock/{mark}").unlink(missing_ok=True)


def test_what_a_comprehension_reads_apart_from_its_rows_is_not_the_codes_to_decide(quick_sandbox):
    """The review of the host's comprehensions: map/filter of a lambda ran in the code's process (an always-equal
    passed), a loop name reused by a key= lambda was bound over, a setup value read in a comprehension's element
    came from the code's process (which had changed it), a setup table given as zip(...)/d.items()/range(len(..))
    was refused, a set's iteration order differed between processes; a host-side comprehension or a set method's
    argument grew without bound. Each cheat scores 0, each honest program 1."""
    cases = [  # (test, setup, cheat, honest)
        ("assert all(map(lambda x: f(x) == 2 * x, range(5)))", "", ALWAYS_EQUAL + "def f(x): return A()",
         "def f(x): return 2 * x"),
        ("assert len(list(filter(lambda x: f(x) != 2 * x, range(5)))) == 0", "",
         ALWAYS_EQUAL + "def f(x): return A()", "def f(x): return 2 * x"),
        ("assert all(f(x) == EXP[x] for x in range(3) if x >= 0)", "EXP = {0: 0, 1: 2, 2: 4}",
         "def f(x):\n    globals()['EXP'].update({0: 5, 1: 5, 2: 5})\n    return 5", "def f(x): return 2 * x"),
        ("assert all([f(a) == b for a, b in zip(INS, OUTS)])", "INS = [1, 2]\nOUTS = [2, 4]",
         "def f(x): return -1", "def f(x): return 2 * x"),
        ("assert all([f(k) == v for k, v in CASES.items()]) and all(f(INS[i]) == 2 * INS[i] for i in range(len(INS)))",
         "CASES = {1: 2, 2: 4}\nINS = [3]", "def f(x): return 0", "def f(x): return 2 * x"),
        ("assert sorted([f(s) for s in {'ab', 'cd', 'ef', 'gh'}]) == ['AB', 'CD', 'EF', 'GH']", "",
         "def f(s): return s", "def f(s): return s.upper()"),
        ("assert sorted(f(), key=len) == ['a', 'bb']", "", "def f(): return ['bb']", "def f(): return ['bb', 'a']"),
        ("assert {1, 2}.issubset(f())", "", "def f(): return [1, 2] + [k * (2**61 - 1) for k in range(1, 2000)]",
         "def f(): return [3, 2, 1]"),
        ("assert ['#' * n for n in f()] == ['#']", "", "def f(): return [499000] * 400", "def f(): return [1]"),
    ]
    rows = [{"test_list": [t], "test_setup_code": setup} for t, setup, _, _ in cases]
    for k, (t, _, cheat, honest) in enumerate(cases):
        got = judge_rows([fence(cheat), fence(honest)], [rows[k], rows[k]])
        assert [v.score for v in got] == [0.0, 1.0], (t, [v.reason for v in got])
    costly = judge_rows([fence(cases[7][2]), fence(cases[8][2])], [rows[7], rows[8]])
    # (a comprehension over the code's values now runs split from the code, its cost the sandbox's, not the host's)
    assert costly[0].reason.startswith("too costly to judge") and costly[1].score == 0.0, [v.reason for v in costly]
    unsorted = "assert all(sorted(f(i), key=lambda i: -i) == [2, 1, 3] for i in range(2))"   # (the lambda's own i)
    assert judge_rows([fence("def f(n): return [2, 1, 3]")], [{"test_list": [unsorted]}])[0].score == 0.0


def test_a_comprehensions_parts_run_per_item_and_its_order_and_the_hosts_own_builtins_hold(quick_sandbox):
    """The second review: map/filter of a function ran whole as list(map(...)) in the code's process (its own
    `list` answered); a part of an element that reads no item ran once, before the loop (a random `stable_hash`
    passed, a counter or unique ids failed); rows in another order than the iterable's passed (a reversing
    `range`); a long %-format string cost seconds; `&`, `|`, `^`, `<<`, `>>` were not computed (correct code 0)."""
    cases = [  # (test, setup, cheat, honest)
        ("assert all(map(is_even, [2, 4, 6])) and not any(map(is_neg, [1, 2]))", "",
         "list = lambda *a: []\ndef is_even(x): return False\ndef is_neg(x): return True",
         "def is_even(x): return x % 2 == 0\ndef is_neg(x): return x < 0"),
        ("assert len(list(filter(is_odd, [2, 4, 6]))) == 0", "",
         "import builtins\nbuiltins.filter = lambda *a: []\ndef is_odd(x): return True", "def is_odd(x): return x % 2"),
        ("assert len({h('abc') for _ in range(5)}) == 1 and [nxt() for _ in range(3)] == [1, 2, 3]", "",
         "import random\ndef h(s): return random.random()\nC = [0]\ndef nxt():\n    C[0] += 1\n    return C[0]",
         "def h(s): return len(s)\nC = [0]\ndef nxt():\n    C[0] += 1\n    return C[0]"),
        ("assert [sq(x) for x in range(5)] == [0, 1, 4, 9, 16]", "",
         "import builtins\nr = builtins.range\nbuiltins.range = lambda *a: list(r(*a))[::-1]\n"
         "def sq(x): return (4 - x) ** 2", "def sq(x): return x * x"),
        ("assert f(5) & 1 == 1 and f(3) ^ 1 == 2 and f(3) << 1 == 6 and f(4) | 1 == 5 and f(8) >> 1 == 4", "",
         "def f(x): return 0", "def f(x): return x"),
        ("assert f(1) % 7 == 3", "", "def f(x): return '%(' * 90000", "def f(x): return 10"),
    ]
    for t, setup, cheat, honest in cases:
        row = {"test_list": [t], "test_setup_code": setup}
        got = judge_rows([fence(cheat), fence(honest)], [row, row])
        assert [v.score for v in got] == [0.0, 1.0], (t, [v.reason for v in got])


def test_a_function_named_like_a_builtin_the_host_computes_is_the_codes(quick_sandbox):
    """A task "write `max`": `assert max([1, 5, 3]) == 5` was computed with the host's own `max`, so every
    completion passed, a wrong one too. The code's `max` is judged now; on the expected side a builtin stays
    Python's, and `import math` leaves math.isclose the host's."""
    rows = [{"test_list": ["assert max([1, 5, 3]) == 5", "assert f(2) == max([1, 4])",
                           "assert math.isclose(f(2), 4.0)"]}] * 3
    programs = ["def max(xs):\n    return 0\ndef f(x): return 2 * x",
                "def max(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        best = x if x > best else best\n"
                "    return best\ndef f(x): return 2 * x",
                "import math\nmath.isclose = lambda *a, **k: True\ndef max(xs): return 5\ndef f(x): return 3"]
    got = judge_rows([fence(p) for p in programs], rows)
    assert [v.passed for v in got] == [2, 3, 1], [v.reason for v in got]
    checker = {"test_list": ["assert isinstance(g(), int)"]}       # (given the code's value: a checker, ours)
    cheat = judge_rows([fence("isinstance = lambda *a: True\ndef g(): return 'x'")], [checker])[0]
    assert cheat.score == 0.0, cheat.reason


HUMANEVAL = '''

METADATA = {'author': 'jt', 'dataset': 'test'}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert True, "This prints if this assert fails 1 (good for debugging!)"

'''
HUMANEVAL_LOOP = '''
def check(candidate):
    import random
    assert candidate(0, 1) == 1
    assert candidate(1, 0) == 1
    rng = random.Random(0)
    for _ in range(50):
        x, y = rng.randint(0, 1000), rng.randint(0, 1000)
        assert candidate(x, y) == x + y
'''
EVALPLUS = '''
import math
def assertion(out, exp, atol):
    assert out == exp or (atol and math.isclose(out, exp, abs_tol=atol))
def check(candidate):
    inputs = [[1, 2], [3, 4], [10, 20]]
    results = [3, 7, 30]
    for inp, exp in zip(inputs, results):
        assertion(candidate(*inp), exp, 0)
check(add)
'''
PYTEST_MODULE = '''
from solution import add as plus
import pytest

def test_small():
    """Small numbers."""
    assert plus(1, 2) == 3
    assert plus(-1, 1) == 0

def test_loop():
    for i in range(10):
        assert plus(i, i) == 2 * i

total = 0
assert plus(2, 2) == 4
total = plus(total, 5)
assert total == 5

if __name__ == "__main__":
    pytest.main()
'''


def test_humaneval_and_pytest_test_modules_are_cases():
    """A `test` column (HumanEval's check(candidate) with `entry_point`, pytest's test functions, asserts at a
    module's top level) was not read: every row scored None ("no tests"). Leading asserts are one case each, the
    rest of a test function one case; HumanEval's `assert True` pays nothing; a module that does not parse gives
    none."""
    count = lambda test, entry=None: len(code_rewards.parse_tests(None, None, None, "", test, entry)[0])  # noqa: E731
    assert count(HUMANEVAL, "has_close_elements") == 3
    assert count(HUMANEVAL) == 0                           # (no entry point: check(candidate) cannot be called)
    assert count(HUMANEVAL_LOOP, "add") == 3
    assert count(PYTEST_MODULE) == 4                      # two asserts, a loop, the top level's statements
    assert count(EVALPLUS, "add") == 1
    assert count("def check(candidate):\n    assert candidate(1) ==", "f") == 0
    assert code_rewards.judge([fence("def f(x): return x")], test=["not python ("], entry_point=["f"])[0].reason \
        == "no tests"


def test_test_modules_are_judged_on_the_host(quick_sandbox):
    """Each assert of a test function that loops is recorded inside and computed on the host: an always-equal
    object passes none of them, nor does a `range` the code empties (the tests keep the builtins' own)."""
    close = fence("""
        def has_close_elements(numbers, threshold):
            return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])""")
    add, wrong = fence("def add(x, y):\n    return x + y"), fence("def add(x, y):\n    return x + y if y < 5 else 0")
    always_equal = fence(ALWAYS_EQUAL + "def add(*a): return A()\nhas_close_elements = add")
    # right for small sums only, with `range` emptied: the tests' loops run on the builtins as they were (and the
    # code's own process, whose builtins it broke, answers nothing: split from the test, it only harms itself)
    no_loops = fence("import builtins\nbuiltins.range = lambda *a: iter(())\n"
                     "def add(x, y): return x + y if x + y < 50 else 0\nhas_close_elements = add")
    # the test functions' names taken by the code: the row's own are the ones run
    names = fence("def check(candidate): pass\ndef test_loop(): pass\n_rlflow_test_0 = check\n"
                  "def add(x, y): return x + y if x + y < 50 else 0\nhas_close_elements = add")
    rows = [(HUMANEVAL, "has_close_elements"), (HUMANEVAL_LOOP, "add"), (PYTEST_MODULE, None)]
    for completion, want in [(close, [1.0, None, None]), (add, [None, 1.0, 1.0]), (wrong, [None, 2 / 3, 0.5]),
                             (always_equal, [0.0, 0.0, 0.0]), (no_loops, [0.0, 0.0, 0.0]),
                             (names, [0.0, 2 / 3, 1.0])]:
        for (test, entry), score in zip(rows, want, strict=True):
            if score is None:
                continue
            got = code_rewards.code_reward([completion], test=[test], entry_point=[entry])
            assert got == [pytest.approx(score)], (completion, test[:40], got)
    # evalplus's helper holds the asserts: the test function passes when it does not raise (the weaker form)
    assert code_rewards.code_reward([add, wrong], test=[EVALPLUS] * 2, entry_point=["add"] * 2) == [1.0, 0.0]
    # an assert in a branch that rightly never runs (pytest's "should raise" idiom) is not required; `assert False`
    # is an assert
    raises = "def test_raises():\n    try:\n        add(None, 1)\n    except TypeError:\n        pass\n" \
             "    else:\n        assert False, 'should raise'\ndef test_false():\n    if add(1, 1) == 2:\n" \
             "        return\n    assert False\n"
    lenient = fence("def add(x, y):\n    return (x or 0) + y")
    assert code_rewards.code_reward([add, lenient], test=[raises] * 2) == [1.0, 0.5]


EVALPLUS_NUMPY = '''
import numpy as np

def is_floats(x) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64 or x.dtype == np.float32
    return False

def assertion(out, exp, atol):
    exact_match = out == exp
    if atol == 0 and is_floats(exp):
        atol = 1e-6
    if not exact_match and atol != 0:
        assert np.allclose(out, exp, rtol=1e-07, atol=atol)
    else:
        assert exact_match

def check(candidate):
    inputs = [[1, 2], [3, 4], [10, 20]]
    results = [3, 7, 30]
    for i, (inp, exp) in enumerate(zip(inputs, results)):
        assertion(candidate(*inp), exp, 0)
'''
MBPP_PLUS = EVALPLUS_NUMPY.split("def check(candidate):")[0] + '''
inputs = [[1, 2], [3, 4], [10, 20]]
results = [3, 7, 30]
for i, (inp, exp) in enumerate(zip(inputs, results)):
    assertion(add(*inp), exp, 0)
'''
SHAPES = '''
import contextlib
import pytest

@pytest.fixture
def numbers():
    return [1, 2]

def test_shadowing_a_builtin():
    str = "abc" * 2
    list = [1, 2]
    assert echo(str) == str
    assert echo(list) == list

def test_suppressed():
    with contextlib.suppress(ZeroDivisionError):
        1 / 0
        assert echo(1) == 2

assert echo(0) == 0

def test_a_helper_defined_after_an_assert():
    assert twice(echo(3)) == 6

def twice(x):
    return 2 * x
'''


def test_test_modules_of_real_datasets_read_right_and_are_not_gamed(quick_sandbox):
    """evalplus's HumanEval+ (its helper reads numpy, absent from the sandbox's Python) and MBPP+ (its loop at the
    top level, run as setup before every test) failed every correct program; a test's own `str` was compared as
    the builtin; an assert under `with suppress` was required; a helper defined after a top-level assert was local
    to it. Cheats: an always-equal object handed to evalplus's `assertion` helper, and `zip` or `range` patched
    so a loop runs once or never, passed; the tests now see the builtins as they were before the code ran."""
    add = fence("def add(x, y):\n    return x + y")
    cheats = [fence(ALWAYS_EQUAL + "def add(*a): return A()"),
              fence("import builtins\nbuiltins.zip = lambda *a: iter(())\nbuiltins.enumerate = lambda *a: iter(())\n"
                    "builtins.range = lambda *a: iter([0])\ndef add(x, y): return 3")]
    for test, entry in ((EVALPLUS_NUMPY, "add"), (MBPP_PLUS, None)):
        assert code_rewards.code_reward([add, *cheats], test=[test] * 3, entry_point=[entry] * 3) == [1.0, 0.0, 0.0]
    echo = fence("def echo(x):\n    return x")
    assert code_rewards.code_reward([echo], test=[SHAPES]) == [1.0], code_rewards.judge([echo], test=[SHAPES])[0]
    loop = "def check(candidate):\n    for x in range(10):\n        assert candidate(x) == 2 * x\n"
    once = fence("import builtins\nbuiltins.range = lambda *a: iter([0])\ndef dbl(x): return 0")
    assert code_rewards.code_reward([fence("def dbl(x): return 2 * x"), once], test=[loop] * 2,
                                    entry_point=["dbl"] * 2) == [1.0, 0.0]


def test_a_test_modules_loop_names_its_modules_and_types_are_its_own(quick_sandbox):
    """A second review: MBPP+'s loop names were declared global (the code's `return exp` read the expected value,
    and a correct program's `from math import exp` was shadowed); a metaclass answered `__eq__` for a class whose
    own always equals; a module the code put in sys.modules was the one the tests imported."""
    mbpp_plus = "inputs = [[1], [2], [3]]\nresults = [2, 4, 6]\nfor inp, exp in zip(inputs, results):\n" \
                "    assert dbl(*inp) == exp\n"
    honest = fence("from math import exp\ndef dbl(x):\n    return int(round(exp(0))) * 2 * x")
    reads_exp = fence("def dbl(x):\n    return exp")
    assert code_rewards.code_reward([honest, reads_exp], test=[mbpp_plus] * 2) == [1.0, 0.0]
    helper = "def same(out, exp):\n    assert out == exp\ndef check(candidate):\n    for x in range(3):\n" \
             "        same(candidate(x), 2 * x)\n"
    metaclass = fence("""
        class Meta(type):
            def __getattribute__(cls, name):
                return object.__eq__ if name == '__eq__' else type.__getattribute__(cls, name)
        class A(metaclass=Meta):
            def __eq__(self, other): return True
            __hash__ = object.__hash__
        def dbl(x): return A()""")
    assert code_rewards.code_reward([metaclass], test=[helper], entry_point=["dbl"]) == [0.0]
    statistics = "from statistics import median\ndef check(candidate):\n    for x in range(3):\n" \
                 "        assert candidate(x) == median([2 * x, 2 * x])\n"
    fake = fence("import sys, types\nsys.modules['statistics'] = types.SimpleNamespace(median=lambda *a: -1)\n"
                 "def dbl(x): return -1")
    assert code_rewards.code_reward([fence("def dbl(x): return 2 * x"), fake], test=[statistics] * 2,
                                    entry_point=["dbl"] * 2) == [1.0, 0.0]


def test_a_test_module_runs_split_from_the_code(quick_sandbox):
    """A test module's tests ran in the code's process, recording values for the host: the code forged the
    records on their pipe, read the expected value from the test's frame, patched the test's helpers through a
    trace hook, its globals or an import hook, and every MBPP+ row paid 1.0. Now the test runs in a process that
    never holds the code (harness.run_split), which it calls through a pipe, plain values and handles across; a
    parametrized test is one case per listed case; in-place changes, iterators, generators, a class's instances,
    `import solution`, a test module's own helper beside the code's and large inputs read as Python has them."""
    mbpp_plus = "import numpy as np\ndef assertion(out, exp, atol):\n    assert out == exp\n" \
                "inputs = [[3], [5], [10], [0]]\nresults = [6, 10, 20, 0]\n" \
                "for i, (inp, exp) in enumerate(zip(inputs, results)):\n    assertion(double(*inp), exp, 0)\n"
    helper = "import math\ndef ref(x):\n    return x * 2\ndef check(candidate):\n    assert candidate(2) == ref(2)\n" \
             "    for x in range(3):\n        assert candidate(x) == ref(x)\n"
    honest = fence("def double(x):\n    return 2 * x")
    cheats = [
        fence("import os\nos.write(3, b'ok W10=\\n')\nos._exit(0)"),
        fence("import sys\ndef double(x):\n    return sys._getframe(1).f_locals.get('exp')"),
        fence("import sys\ndef _t(frame, event, arg):\n    if event == 'call':\n"
              "        frame.f_globals['assertion'] = lambda *a, **k: None\n        frame.f_globals['ref'] = "
              "lambda *a: 0\n    return None\nsys.settrace(_t)\nsys.setprofile(_t)\ndef double(x): return 0"),
        fence("import sys, types\ndef double(*a, **k):\n    g = sys._getframe(1).f_globals\n"
              "    for n, v in list(g.items()):\n        if isinstance(v, types.FunctionType):\n"
              "            g[n] = lambda *a, **k: 0\n    return 0"),
        fence("import gc\ndef double(x):\n    for o in gc.get_objects():\n"
              "        if isinstance(o, list) and o[:1] == [[3]]:\n            return 0\n    return 0"),
    ]
    for test, entry in ((mbpp_plus, None), (helper, "double")):
        got = code_rewards.code_reward([honest, *cheats], test=[test] * 6, entry_point=[entry] * 6)
        assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], (test[:30], got)
    pytest_module = '''
import pytest
import solution
from solution import Stack, rev, gen as g

def helper(x):
    return sorted(x)

def test_stack():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2 and len(s) == 1 and isinstance(s, Stack)

def test_in_place_and_iterators():
    a = [1, 2, 3]
    rev(a)
    assert a == [3, 2, 1] and list(g(3)) == [0, 1, 2] and helper([2, 1]) == [1, 2]
    assert any(solution.double(x) == 2 for x in [1, 2] for _ in [0])

def test_large():
    arr = list(range(100000))
    assert total(arr) == sum(arr)

@pytest.mark.parametrize("x, y", [(1, 2), (3, 6), (10, 20)])
def test_param(x, y):
    assert double(x) == y
'''
    good = fence("class Stack:\n    def __init__(self): self.items = []\n    def push(self, x): self.items.append(x)\n"
                 "    def pop(self): return self.items.pop()\n    def __len__(self): return len(self.items)\n"
                 "def helper(x): return x + 1\ndef rev(a): a.reverse()\ndef gen(n):\n    yield from range(n)\n"
                 "def total(a): return sum(a)\ndef double(x): return helper(x) * 2 - 2")
    zero = fence("def double(x): return 0")
    assert len(code_rewards.parse_tests(None, None, None, "", pytest_module, None)[0]) == 6
    assert code_rewards.judge([good], test=[pytest_module])[0].score == 1.0, \
        code_rewards.judge([good], test=[pytest_module])[0]
    assert code_rewards.code_reward([zero], test=["@pytest.mark.parametrize('x, y', [(0, 0), (3, 6)])\n"
                                                  "def test_p(x, y):\n    assert double(x) == y\n"]) == [0.5]


def test_a_builtin_the_code_redefines_is_the_codes_where_nothing_else_tests_it(quick_sandbox):
    """`assert 5 == max([1, 5])` for a task "write `max`": the call on the expected side was evaluated as the
    builtin, so the assert tested nothing and `def max(*a): return 0` passed; it is the code's where no other part
    of the assert is."""
    cheat = fence("def max(*a): return 0\ndef divmod(*a): return 0")
    honest = fence("def max(xs):\n    m = xs[0]\n    for x in xs:\n        m = x if x > m else m\n    return m\n"
                   "def divmod(a, b):\n    return (a // b, a % b)")
    tests = ["assert 5 == max([1, 5])", "assert (3, 1) == divmod(7, 2)"]
    assert code_rewards.code_reward([cheat, honest], test_list=[tests] * 2) == [0.0, 1.0]
    sorts = fence("def f(x): return sorted(x)\ndef sorted(x): return [0]")   # (beside the code's f: the builtin)
    assert code_rewards.code_reward([sorts], test_list=[["assert f([2, 1]) == sorted([2, 1])"]]) == [0.0]


def test_frozensets_inside_sets_and_as_keys_cross_as_values(quick_sandbox):
    """A frozenset inside a set or as a dict key was written as a set literal, which cannot be hashed when read
    back: a correct power-set program scored "unreadable value". Now `frozenset({...})`, read by the host's
    bounded reader and by the harness's own."""
    code = fence("def f():\n    return {frozenset({1, 2}), frozenset()}\ndef g():\n    return {frozenset({1}): 1}")
    tests = ["assert f() == {frozenset({1, 2}), frozenset()}", "assert g() == {frozenset({1}): 1}"]
    module = "def test_a():\n    x = f()\n    assert frozenset() in x and g() == {frozenset({1}): 1}\n"
    assert code_rewards.code_reward([code], test_list=[tests]) == [1.0]
    assert code_rewards.code_reward([code], test=[module]) == [1.0]


def test_the_split_test_reads_the_codes_objects_consistently_and_takes_what_python_would(quick_sandbox):
    """A review of the split form: a handle's length and items were asked of the code one by one, so an object
    saying `len` 3 and iterating nothing passed a "length, then zip" test, and a context manager's `__exit__`
    could swallow a failed assert. Now a length is that of the items, read once until the next call, and the
    test's block is never suppressed. Correct programs that failed: a range, generator, deque, Counter or
    bytearray argument, a callback, the code's own exception class, operators on its objects, a keyword argument
    sorted in place, a list changed before a raise, a 100-deep list, nan, KeyError's argument; a pytest.param."""
    def score(code: str, test: str) -> float:
        return code_rewards.code_reward([fence(code)], test=[test])[0]
    floats = "import math\ndef test_floats():\n    r = f([3, 1, 2])\n    e = [0.5, 1.5, 2.5]\n" \
             "    assert len(r) == len(e)\n    for a, b in zip(r, e):\n        assert math.isclose(a, b)\n"
    assert score("class R:\n    def __len__(self): return 3\n    def __iter__(self): return iter([])\n"
                 "def f(x): return R()", floats) == 0.0
    assert score("def f(x): return [0.5, 1.5, 2.5]", floats) == 1.0
    assert score("class T:\n    def __enter__(self): return self\n    def __exit__(self, *a): return True\n"
                 "def f(x): return 0", "def test_a():\n    with T():\n        assert f(1) == 2\n") == 0.0
    honest = '''
from collections import Counter, deque
class NegErr(ValueError):
    pass
class V:
    def __init__(self, x): self.x = x
    def __add__(self, o): return V(self.x + o.x)
def total(x): return sum(x)
def top(c): return c.most_common(1)[0][0]
def first(d): return d[0]
def apply(fn, xs): return [fn(x) for x in xs]
def check(x):
    if x < 0:
        raise NegErr("neg")
    return x
def sort_it(arr): arr.sort()
def fill_then_fail(x):
    x.append(1)
    raise KeyError("missing")
def flatten(x):
    out = []
    for v in x:
        out += flatten(v) if isinstance(v, list) else [v]
    return out
def nan(): return float("nan")
'''
    test = '''
import math
import pytest
from collections import Counter, deque
from solution import NegErr, V

def test_arguments():
    assert total(range(5)) == 10 and total(x for x in [1, 2]) == 3 and total(bytearray(b"ab")) == 195
    assert top(Counter("aab")) == "a" and first(deque([7])) == 7

def test_callbacks_exceptions_operators():
    assert apply(lambda x: x * 2, [1, 2]) == [2, 4]
    try:
        check(-1)
    except NegErr as e:
        assert str(e) == "neg" and isinstance(e, ValueError)
    else:
        assert False
    assert (V(1) + V(2)).x == 3

def test_in_place_deep_nan():
    lst = [3, 1]
    sort_it(arr=lst)
    y = []
    try:
        fill_then_fail(y)
    except KeyError as e:
        assert e.args == ("missing",)
    assert lst == [1, 3] and y == [1]
    x = [1]
    for _ in range(100):
        x = [x]
    assert flatten(x) == [1] and math.isnan(nan())

@pytest.mark.parametrize("a, b", [(1, 1), pytest.param(2, 2, id="two")])
def test_param(a, b):
    assert total([a]) == b
'''
    assert score(honest, test) == 1.0, code_rewards.judge([fence(honest)], test=[test])[0]
    assert len(code_rewards.parse_tests(None, None, None, "", test, None)[0]) == 7


def test_the_split_test_never_sends_the_code_a_value_to_compare(quick_sandbox):
    """A second review: operators and `in` on the code's objects were asked of the code with the test's operand,
    often the expected value: `abs(f(x) - exp) < tol` with a `__sub__` answering 0, `p in result` with a
    `__contains__` answering True, `f(x) <= 1` with a `__le__` answering True all paid 1.0. Now an operator
    whose result is a plain value is refused, comparisons are not asked, `in` reads the items. Correct programs
    it failed: a callback from the code's threads (the pipes' conversation crossed), a large argument (parsed
    as a literal: a million items took 1 GB), a builtin type as an argument, an exception class's parent, a
    callback reading what the call it is made from changes, complex inf, 140-deep lists."""
    def score(code: str, test: str, entry=None) -> float:
        return code_rewards.code_reward([fence(code)], test=[test], entry_point=[entry])[0]
    tol = "def check(candidate):\n    assert abs(candidate(3.5) - 0.5) < 1e-6\n    assert candidate([3]) <= 1\n"
    assert score("class Z:\n    def __sub__(self, o): return 0\n    def __le__(self, o): return True\n"
                 "def f(x): return Z()", tol, "f") == 0.0
    assert score("def f(x): return x - 3 if isinstance(x, float) else 1", tol, "f") == 1.0
    perm = "def test_perm():\n    result = f('ab')\n    assert len(result) == 2\n    for p in ['ab', 'ba']:\n" \
           "        assert p in result\n"
    assert score("class R:\n    def __iter__(s): return iter(['x'] * 2)\n    def __contains__(s, o): return True\n"
                 "def f(s): return R()", perm) == 0.0
    honest = '''
from concurrent.futures import ThreadPoolExecutor
class BankError(Exception):
    pass
class Insufficient(BankError):
    pass
class C:
    def __init__(self): self.count, self.subs = 0, []
    def subscribe(self, fn): self.subs.append(fn)
    def inc_by(self, n):
        for _ in range(n):
            self.count += 1
            for fn in self.subs:
                fn(self)
def pmap(fn, xs):
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(fn, xs))
def biggest(xs): return max(xs)
def only(xs, t): return [x for x in xs if isinstance(x, t)]
def withdraw(x): raise Insufficient("no")
def same(x): return x
'''
    test = '''
from solution import BankError, Insufficient

def test_a():
    assert pmap(lambda x: x * x, list(range(50))) == [x * x for x in range(50)]
    assert biggest(list(range(3 * 10 ** 5))) == 3 * 10 ** 5 - 1 and only([1, "a", 2.0], int) == [1]
    try:
        withdraw(1)
    except BankError:
        pass
    c, seen = C(), []
    c.subscribe(lambda o: seen.append(o.count))
    c.inc_by(2)
    x = 1
    for _ in range(140):
        x = [x]
    assert seen == [1, 2] and same(complex(float("inf"), 0)) == complex(float("inf"), 0) and same(x) == x
'''
    assert score(honest, test) == 1.0, code_rewards.judge([fence(honest)], test=[test])[0]


def test_a_test_list_assert_that_decides_inside_runs_split_from_the_code(quick_sandbox):
    """A `test_list` assert whose part that needs the code compares or decides (a lambda, a comprehension with
    two `for`s) ran whole in the code's process, the weak form: an always-equal object passed the lambda, and a
    correct program failed the comprehension ("returned a generator"). Such an assert now runs split from the
    code, as a test module's do."""
    rows = [{"test_list": ["assert (lambda v: double(v) == 2 * v)(3)",
                           "assert any(double(x) == 2 for x in [1, 2] for _ in [0])", "assert double(2) == 4"]}] * 3
    got = judge_rows([fence("def double(x): return 2 * x"), fence(ALWAYS_EQUAL + "def double(x): return A()"),
                      fence("def double(x): return 0")], rows)
    assert [v.score for v in got] == [1.0, 0.0, 0.0], [v.reason for v in got]


def test_no_read_of_the_codes_object_lets_the_code_decide_an_assert(quick_sandbox):
    """A third review: an index or the truth of a handle was asked apart from its items (`r[i] <= r[i + 1]` with
    `__getitem__` answering i passed a sort test); an operator with the test's value handed the code the expected
    value, then its result's `__float__` answered (`fabs(f(x) - 3.5) < 1e-6`); a context manager's `__exit__`
    swallowed the TypeError or KeyError the code's values caused, skipping the asserts; the code's process ending
    (`os._exit(0)`) was caught by the test's `except Exception`; a StopIteration ended the test's `map`; the code's
    patched `math` was the test's. Each paid 1.0; each now 0, and an honest program still 1."""
    def score(code: str, test: str, entry=None) -> float:
        return code_rewards.code_reward([fence(code)], test=[test], entry_point=[entry])[0]
    sort = "def test_sort():\n    r = sort_it([3, 1, 2])\n    assert len(r) == 3 and all(r[i] <= r[i + 1] for i in " \
           "range(2)) and sorted(r) == [1, 2, 3]\n"
    assert score("class R:\n    def __init__(self, a): self.a = a\n    def __iter__(self): return iter(self.a)\n"
                 "    def __getitem__(self, i): return i\ndef sort_it(a): return R(a)", sort) == 0.0
    assert score("def sort_it(a): return sorted(a)", sort) == 1.0
    close = "import math\ndef check(candidate):\n    assert math.fabs(candidate(2) - 3.5) < 1e-6\n" \
            "    assert math.isclose(candidate(1), 2.5)\n"
    assert score("class N:\n    def __sub__(self, o): return self\n    def __float__(self): return 0.0\n"
                 "def f(x): return N()", close, "f") == 0.0
    assert score("import math\nmath.isclose = lambda *a, **k: True\ndef f(x): return 0.0", close, "f") == 0.0
    assert score("def f(x): return x + 1.5", close, "f") == 1.0
    assert score("class S:\n    def __enter__(self): return self\n    def __exit__(self, kind, *a): return True\n"
                 "    def compute(self, x): return {}", "def test_w():\n    with S() as s:\n"
                 "        assert s.compute(2)['value'] == 4\n") == 0.0
    assert score("import os\ndef f(x): os._exit(0)", "def test_e():\n    try:\n        f(-1)\n"
                 "    except Exception:\n        pass\n    else:\n        assert False\n") == 0.0
    assert score("def is_prime(n): raise StopIteration", "def test_p():\n    assert all(map(is_prime, [2, 3]))\n"
                 "    assert not any(map(is_prime, [4, 6]))\n") == 0.0


def test_the_codes_own_subclass_of_a_builtin_container_keeps_its_methods(quick_sandbox):
    """An `LRUCache(OrderedDict)` or a `Stack(list)` of the code's crossed as its contents (a dict, a list), so
    `cache.put` and `stack.push` were AttributeErrors and correct programs failed; they are handles now (their
    length, items and `in` read from their items), and a namedtuple still crosses as the tuple it is."""
    code = fence('''
from collections import OrderedDict, namedtuple
class LRUCache(OrderedDict):
    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity
    def get(self, key):
        if key not in self:
            return -1
        self.move_to_end(key)
        return self[key]
    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)
class Stack(list):
    def push(self, x): self.append(x)
P = namedtuple("P", "x y")
def mk(): return P(1, 2)''')
    test = "def test_lru():\n    c = LRUCache(2)\n    c.put(1, 1)\n    c.put(2, 2)\n    assert c.get(1) == 1\n" \
           "    c.put(3, 3)\n    assert c.get(2) == -1 and len(c) == 2 and 3 in c\n" \
           "def test_stack():\n    s = Stack()\n    s.push(3)\n" \
           "    assert len(s) == 1 and s[0] == 3 and list(s) == [3]\n" \
           "def test_tuple():\n    assert mk() == (1, 2)\n"
    assert code_rewards.code_reward([code], test=[test]) == [1.0], code_rewards.judge([code], test=[test])[0]


def test_the_helpers_a_prompt_defines_are_the_tests_own(quick_sandbox):
    """HumanEval/50: the prompt defines `encode_shift` whole and asks for `decode_shift`, whose tests call both.
    Taken from the code, an answer redefining `encode_shift` as the identity (and `decode_shift` too) passed, and a
    correct answer that did not repeat the helper failed (NameError). Text and chat prompts, fenced or not."""
    helper = ('import string\n\ndef encode_shift(s: str):\n    """returns encoded string by shifting every '
              'character by 5."""\n    return "".join([chr(((ord(ch) + 5 - ord("a")) % 26) + ord("a")) for ch in s])'
              '\n\n\ndef decode_shift(s: str):\n    """takes as input string encoded with encode_shift function."""\n')
    test = ("def check(candidate):\n    for s in ['abc', 'hello', 'xyz']:\n"
            "        assert candidate(encode_shift(s)) == s\n")
    only = fence('def decode_shift(s):\n    return "".join(chr(((ord(c) - 5 - ord("a")) % 26) + ord("a")) for c in s)')
    whole = fence(helper + '    return "".join(chr(((ord(c) - 5 - ord("a")) % 26) + ord("a")) for c in s)')
    cheat = fence("def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s")
    chat = [{"role": "user", "content": "Complete the function:\n```python\n" + helper + "```\n"}]
    system = [{"role": "system", "content": "Answer in a single\n```python code block. Define the function."},
              {"role": "user", "content": "Complete this:\n" + helper + "\nThanks."}]      # (the recipes' shape)
    template = "<|im_start|>user\n" + helper + "<|im_end|>\n<|im_start|>assistant\n"
    for prompt in (helper, chat, system, template):
        got = code_rewards.code_reward([only, whole, cheat], test=[test] * 3, entry_point=["decode_shift"] * 3,
                                       prompts=[prompt] * 3)
        assert got == [1.0, 1.0, 0.0], code_rewards.judge([only, whole, cheat], test=[test] * 3,
                                                          entry_point=["decode_shift"] * 3, prompts=[prompt] * 3)
    # a prompt that defines nothing whole (a stub only, or prose): the code's names, as before
    stub = [{"role": "user", "content": "Write decode_shift; encode_shift is yours to write too."}]
    assert code_rewards.code_reward([whole, only], test=[test] * 2, entry_point=["decode_shift"] * 2,
                                    prompts=[stub] * 2) == [1.0, 0.0]


def test_a_split_tests_definitions_never_reach_the_codes_process(quick_sandbox):
    """A split case's definitions (a test module, or a test_list's weak asserts, expected values included) were the
    setup of the run's plain asserts too, which run in the code's process: the code found them with
    gc.get_objects(), kept them in the sandbox's /tmp, and its split process answered from them. An MBPP+ row
    (test_list and a test module) also failed honest code on the module's `import numpy` there."""
    spot = f"/tmp/.rlflow-leak-{uuid.uuid4().hex}"
    cheat = fence(f"""
        import gc, os, re
        if not os.path.exists({spot!r}):
            for o in gc.get_objects():
                if isinstance(o, dict) and isinstance(o.get("setup"), str) and "_rlflow_case" in o["setup"]:
                    with open({spot!r}, "w") as fh:
                        fh.write(o["setup"])
                    break
        TABLE = {{}}
        if os.path.exists({spot!r}):
            src = open({spot!r}).read()
            TABLE.update((int(a), int(b)) for b, a in re.findall(r"f\\(v\\) == (\\d+)\\)\\((\\d+)\\)", src))
            TABLE.update((int(a), int(b)) for a, b in re.findall(r"\\[(\\d+), (\\d+)\\]", src))
        def f(x):
            return TABLE.get(x, 2 * x)""")
    honest = fence("def f(x):\n    return {1: 2, 3: 1234567, 5: 99, 7: 4242}.get(x, 0)")
    weak = ["assert f(1) == 2", "assert (lambda v: f(v) == 1234567)(3)"]
    module = "import numpy as np\ninputs = [[7], [5]]\nresults = [4242, 99]\n" \
             "for inp, exp in zip(inputs, results):\n    assert f(*inp) == exp\n"
    try:
        got = code_rewards.code_reward([honest, cheat, honest, cheat], test=[None, None, module, module],
                                       test_list=[weak, weak, ["assert f(1) == 2"], ["assert f(1) == 2"]])
    finally:
        if os.path.exists(spot):
            os.unlink(spot)
    assert got == [1.0, 0.5, 1.0, 0.5], got


def test_an_expected_output_of_zero_is_zero_and_a_missing_one_no_test(quick_sandbox):
    """A stdin/stdout case whose output was the number 0 was read as "" (an empty program passed, the honest one
    failed), and a case without an output expected "" too."""
    zero = {"test_cases": [{"type": "stdin_stdout", "input": "5 5\n", "output": 0}]}
    honest, empty = fence("a, b = map(int, input().split())\nprint(a - b)"), fence("pass")
    assert code_rewards.code_reward([honest, empty], verification_info=[zero] * 2) == [1.0, 0.0]
    missing = {"test_cases": [{"type": "stdin_stdout", "input": "5 5\n"}]}
    assert code_rewards.judge([empty], verification_info=[missing])[0].score is None


def test_a_builtin_the_code_redefines_is_pythons_where_another_part_tests_the_code(quick_sandbox):
    """`assert sorted([3, 1, 2]) == g([3, 1, 2])`: the left side reads only a builtin the code redefines, and was
    run as the code's, so `def sorted(*a): return 0` with `def g(l): return 0` passed. Where another part tests a
    function of the code's own, such a part is Python's; alone (a task "write `max`") it stays the code's."""
    rows = [["assert sorted([3, 1, 2]) == g([3, 1, 2])", "assert len('hello') == g('hello')"],
            ["assert math.isclose(sum([0.5, 0.25]), g([0.5, 0.25]))"]]
    honest = [fence("def g(l): return sorted(l)"), fence("def g(l): return sum(l)")]
    cheat = [fence("def sorted(*a, **k): return 0\ndef len(*a): return 0\ndef g(l): return 0"),
             fence("def sum(*a): return 0.0\ndef g(l): return 0.0")]
    for row, good, bad in zip(rows, honest, cheat):
        assert code_rewards.code_reward([good, bad], test_list=[row] * 2)[1] == 0.0, row
    assert code_rewards.code_reward([fence("def max(*a): return 5")], test_list=[["assert max([1, 2]) == 5"]]) == [1.0]


def test_a_test_module_with_tests_it_cannot_run_has_no_score(quick_sandbox):
    """A `Test*` class's methods, a parametrize over a named table, stacked or other decorators, fixtures and
    unittest.TestCase were dropped while the module's other tests ran: `def f(x): return 0` was paid 1.0 for the
    trivial `f(0) == 0` left. Such a row has no tests now (no score, no training on it)."""
    head = "import pytest\nfrom solution import f\ndef test_zero():\n    assert f(0) == 0\n"
    unrunnable = [head + "class TestF:\n    def test_two(self):\n        assert f(1) == 2\n",
                  head + "CASES = [(1, 2)]\n@pytest.mark.parametrize('x, y', CASES)\ndef test_t(x, y):\n"
                         "    assert f(x) == y\n",
                  head + "@pytest.mark.timeout(2)\ndef test_t():\n    assert f(5) == 10\n",
                  head + "def test_out(capsys):\n    print(f(2))\n    assert capsys.readouterr().out == '4\\n'\n",
                  "import unittest\nfrom solution import f\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                  "        self.assertEqual(f(1), 2)\n"]
    wrong = fence("def f(x): return 0")
    assert code_rewards.code_reward([wrong] * len(unrunnable), test=unrunnable) == [None] * len(unrunnable)
    runnable = head + "@pytest.mark.parametrize('x, y', [(1, 2), (3, 6)])\ndef test_t(x, y):\n    assert f(x) == y\n"
    assert code_rewards.code_reward([wrong, fence("def f(x): return 2 * x")], test=[runnable] * 2) == [1 / 3, 1.0]


def test_an_iterator_the_code_returns_is_read_where_an_assert_consumes_it(quick_sandbox):
    """`assert list(double([1, 2])) == [2, 4]` with `return map(...)`: the code's part crossed as a value, and a
    map, generator or dict view is none ("returned a map"): honest code scored 0. Such asserts run split."""
    asserts = ["assert list(double([1, 2])) == [2, 4]", "assert set(evens([1, 2, 4])) == {2, 4}",
               "assert sorted(keys({'b': 1, 'a': 2})) == ['a', 'b']", "assert len(tuple(evens([2, 3]))) == 1"]
    honest = fence("def double(l): return map(lambda x: 2 * x, l)\n"
                   "def evens(l): return (x for x in l if x % 2 == 0)\ndef keys(d): return d.keys()")
    wrong = fence("def double(l): return iter([0])\ndef evens(l): return iter([])\ndef keys(d): return iter(['b'])")
    assert code_rewards.code_reward([honest, wrong], test_list=[asserts] * 2) == [1.0, 0.0]


def test_a_prompts_function_to_mend_and_a_test_helper_the_module_calls_stay_as_they_were(quick_sandbox):
    """A review found: any whole function of a prompt became the tests' (a prompt showing a buggy `add` to mend
    failed the mended one), a stub raising NotImplementedError too; and a `test(candidate)` the module calls itself
    made the row "no tests". Prompt helpers count only in HumanEval's form (an entry point), stubs never."""
    good, bad = fence("def add(a, b):\n    return a + b"), fence("def add(a, b):\n    return a - b")
    buggy = "This function is buggy:\n```python\ndef add(a, b):\n    return a - b\n```\nFix it."
    assert code_rewards.code_reward([good, bad], test=["assert add(1, 2) == 3\n"] * 2, prompts=[buggy] * 2) == \
        [1.0, 0.0]
    two = "def helper(x):\n    raise NotImplementedError\n\ndef add(a, b):\n    pass\n"
    both = fence("def helper(x):\n    return x + 1\ndef add(a, b):\n    return helper(a) + b - 1")
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert helper(1) == 2\n"
    assert code_rewards.code_reward([both], test=[check], entry_point=["add"], prompts=[two]) == [1.0]
    called = "def test(candidate):\n    assert candidate(1, 2) == 3\n\ntest(add)\n"
    assert code_rewards.code_reward([good, bad], test=[called] * 2) == [1.0, 0.0]


def test_an_exception_of_the_codes_keeps_its_attributes_across(quick_sandbox):
    """A test catching the code's exception and reading `e.code` failed honest code: the exception's twin carried
    its args only."""
    test = ("from solution import pay, Refused\ndef test_refused():\n    try:\n        pay(-1)\n"
            "    except Refused as e:\n        assert e.code == 5 and e.args == ('no',)\n    else:\n"
            "        assert False\n")
    honest = fence("class Refused(Exception):\n    def __init__(self, msg):\n        super().__init__(msg)\n"
                   "        self.code = 5\ndef pay(x):\n    raise Refused('no')")
    wrong = fence("class Refused(Exception):\n    pass\ndef pay(x):\n    raise Refused('no')")
    assert code_rewards.code_reward([honest, wrong], test=[test] * 2) == [1.0, 0.0]


def test_a_test_function_the_module_calls_at_its_top_level_is_one_case(quick_sandbox):
    """`def test_a(): ...` then `test_a()` at the top level: the call became a case of its own, which could not
    find test_a (a case, not a definition): honest code scored 0.5."""
    test = "from solution import f\ndef test_a():\n    assert f(1) == 2\n\ntest_a()\n"
    assert code_rewards.code_reward([fence("def f(x): return 2 * x"), fence("def f(x): return 0")],
                                    test=[test] * 2) == [1.0, 0.0]


def test_the_codes_own_dict_subclass_indexed_by_an_int_is_read_by_key(quick_sandbox):
    """`g[5]` of the code's `Graph(dict)` was read as the 6th of its items (an index of an iterable), not the value
    at key 5: honest code failed."""
    test = "from solution import build\ndef test_graph():\n    g = build()\n    assert g[5] == [] and g[1] == [2, 3]\n"
    honest = fence("class Graph(dict):\n    pass\ndef build():\n    g = Graph()\n    g[1] = [2, 3]\n    g[5] = []\n"
                   "    return g")
    wrong = fence("class Graph(dict):\n    pass\ndef build():\n    g = Graph()\n    g[1] = [3]\n    g[5] = []\n"
                  "    return g")
    assert code_rewards.code_reward([honest, wrong], test=[test] * 2) == [1.0, 0.0]


def test_an_endless_generator_of_the_codes_is_read_as_the_test_takes_it(quick_sandbox):
    """`list(islice(fib(), 5))`: iterating a generator handle read it whole first, so an endless one (the usual
    answer to "write a generator of ...") filled the memory and honest code failed. It is read a few items at a
    time; a generator consumed once is empty the second time, as in Python."""
    test = ("import itertools\nfrom solution import fib\ndef test_f():\n"
            "    assert list(itertools.islice(fib(), 5)) == [0, 1, 1, 2, 3]\n"
            "    g = fib()\n    assert [x for _, x in zip(range(3), g)] == [0, 1, 1]\n"
            "def test_once():\n    g = fib(3)\n    assert list(g) == [0, 1, 1] and list(g) == []\n")
    honest = fence("def fib(n=None):\n    a, b, i = 0, 1, 0\n    while n is None or i < n:\n        yield a\n"
                   "        a, b, i = b, a + b, i + 1")
    wrong = fence("def fib(n=None):\n    while True:\n        yield 1")
    assert code_rewards.code_reward([honest, wrong], test=[test] * 2) == [1.0, 0.0]
