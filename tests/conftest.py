"""Real servers on 127.0.0.1 for the whole session: an S3-compatible server (moto in server mode) and a
Prefect API (prefect_test_harness). MLflow runs on sqlite in each test's folder; the UI check starts an MLflow
tracking server and a Prefect server with its UI (`mlflow server`, `prefect server start`). The tiny model is built
offline into a session cache and loaded through `from_pretrained` like any hub model.

Tiers (markers, registered in pyproject.toml; `make test-fast` deselects all but the unmarked):
  slow        end-to-end runs: flows, stage subprocesses, many seconds each
  server      needs a server a fixture starts (moto S3, Prefect): set here from the fixtures a test uses
  drill       fault drills: processes killed mid-run, then resumed
  ui          drives the MLflow and Prefect UIs in headless Chromium (Debian's chromium, playwright)
  browser     the browser environment: episodes in headless Chromium (Debian's chromium, playwright)
  vllm, deepspeed, bubblewrap, ui, browser, openenv, verifiers04, gpu
              needs that engine / sandbox / device. Skipped where it is missing, except in CI (CI=true), where
              a missing vLLM environment, DeepSpeed or bubblewrap fails the test instead of silently dropping
              the engine or security tests; gpu tests are skipped without a GPU everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
VERIFIERS04_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
SERVER_FIXTURES = {"s3_endpoint", "bucket", "prefect_api", "s3_with_auth", "mlflow_server", "prefect_ui"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# `make drills` (RLFLOW_DRILL_TRIALS set) runs the drills at length; `make test` keeps to a small set (CI budget)
AT_LENGTH = pytest.mark.skipif("RLFLOW_DRILL_TRIALS" not in os.environ,
                               reason="make drills runs it (make test keeps to a small set: the CI budget)")
# The checkout's own output folders (the demo's): tests write under their tmp_path, never here.
CHECKOUT_OUTPUTS = [ROOT / "rlflow-runs", ROOT / "rlflow-store", ROOT / "mlflow.db", ROOT / "mlruns"]


def _have_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# marker: (is it here?, what is missing, how to get it, required in CI)
REQUIRES = {
    "vllm": (VLLM_PYTHON.exists, f"the vLLM environment ({VLLM_PYTHON})", "make setup builds it", True),
    "deepspeed": (lambda: importlib.util.find_spec("deepspeed") is not None, "deepspeed",
                  "make setup installs it (.[test])", True),
    "bubblewrap": (lambda: shutil.which("bwrap") is not None, "bubblewrap",
                   "make setup installs it (apt-get install bubblewrap)", True),
    "ui": (lambda: CHROMIUM is not None and importlib.util.find_spec("playwright") is not None,
           "chromium and playwright", "make setup installs them (apt-get install chromium; .[test])", True),
    "openenv": (OPENENV_PYTHON.exists, f"the OpenEnv environment ({OPENENV_PYTHON})", "make setup builds it", True),
    "verifiers04": (VERIFIERS04_PYTHON.exists, f"verifiers 0.4's environment ({VERIFIERS04_PYTHON})",
                    "make setup builds it", True),
    "browser": (lambda: CHROMIUM is not None and importlib.util.find_spec("playwright") is not None,
                "chromium and playwright", "make setup installs them (apt-get install chromium; .[test])", True),
    "gpu": (_have_gpu, "a CUDA GPU", "run on a GPU machine", False),
}


# The files that take longest, longest first (seconds of `make test` on 2 cores, 2026-12-02: 510, 480, 416, 280,
# 242, 188, 186, 163, 154, 139, 122, 119): the two workers take whole files in collection order, and
# alphabetical order left test_real_model.py for one worker alone at the end (~3 min of the other idle).
LONGEST_FIRST = ("test_browser", "test_bad_input", "test_deepspeed", "test_vllm", "test_reasoning_gym",
                 "test_launchers", "test_replicas", "test_envs", "test_streaming", "test_real_model", "test_resume",
                 "test_failures")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))     # (stable: each file's own order kept)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for name, (here, what, how, in_ci) in REQUIRES.items():
        if item.get_closest_marker(name) is not None and not here():
            if IN_CI and in_ci:
                pytest.fail(f"{what} is missing in CI ({how}): the {name} tests must run there", pytrace=False)
            pytest.skip(f"{what} is missing ({how})")


def _outputs() -> dict[str, float]:
    found = {}
    for path in CHECKOUT_OUTPUTS:
        for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
            if p.exists():
                found[str(p)] = p.stat().st_mtime
    return found


def pytest_sessionstart(session):
    session.config._rlflow_outputs = _outputs()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_rlflow_outputs", None)
    if before is None:
        return
    changed = sorted(p for p, mtime in _outputs().items() if before.get(p) != mtime)
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"tests wrote into the checkout's own output folders: {changed[:5]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

# Fake credentials for the local S3 server; set before boto3 is imported anywhere.
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


SHARED_CACHE = ("models", "gguf", "known-files", "mlflow-db")


@pytest.fixture(autouse=True)
def said_afresh(monkeypatch):
    """What rlflow says once per process (config warnings, the first cut prompt) is said afresh in each test: a
    file that ran before in the same xdist worker (which ones do changes from run to run) may have said it."""
    from tasks.core import config_base, data

    monkeypatch.setattr(config_base, "_SAID", set())
    monkeypatch.setattr(data, "_CUT_SAID", [])


@pytest.fixture(scope="session", autouse=True)
def rlflow_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("rlflow-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # what is built once and written atomically (builtin models, converted GGUF files, the hash memo) is shared
        # by the session's workers (their common base folder): SmolLM2's conversion took ~45 s on each worker
        shared = tmp_path_factory.getbasetemp().parent / "rlflow-shared-cache"
        for part in SHARED_CACHE:
            (shared / part).mkdir(parents=True, exist_ok=True)
            (cache / part).symlink_to(shared / part, target_is_directory=True)
    os.environ["RLFLOW_CACHE"] = str(cache)
    yield cache
    from tasks.engines.detached import _stop

    for state in (cache / "trainer").glob("*.json"):    # resident trainers a failed test left running
        try:
            _stop(state, json.loads(state.read_text()))
        except (OSError, ValueError):
            pass


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free port of 127.0.0.1 (a real HTTP server; boto3 talks to it over TCP)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint):
    import boto3

    name = f"rlflow-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API for the session; its URL is handed to subprocess runs too. At the session's end Prefect's
    log and event workers are drained with a timeout, as `rlflow run` does (flows/cli.py), and the harness's own
    drain, which has none, is skipped: a clean-clone run hung there after its last test (2026-12-03)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    class Drained:
        def drain(self, *args, **kwargs):
            return None

    with pytest.MonkeyPatch.context() as patch, prefect_test_harness(server_startup_timeout=120):
        yield str(get_current_settings().api.url)
        for worker in (APILogWorker, EventsWorker):
            try:
                worker.drain_all(timeout=10)
            except Exception:  # noqa: BLE001 - a worker never started, or one that is gone: nothing to send
                pass
        patch.setattr(APILogWorker, "instance", classmethod(lambda cls, *args, **kwargs: Drained()))
        patch.setattr(EventsWorker, "drain_all", classmethod(lambda cls, *args, **kwargs: None))


def _free_port() -> int:
    """A port free now for a server told it (below the ephemeral range: free_ports)."""
    return free_ports(1)


def once_written(store, key: str, act):
    """A thread that calls act() once `key` is complete in `store` (join it after the run), started."""
    import threading
    import time

    def wait_then_act() -> None:
        deadline = time.monotonic() + 300
        while store.manifest(key) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        act()
    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


_PORTS = random.SystemRandom()


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free now, for servers told a fixed port each (generate.replica_port + i,
    as on sky). Drawn below the kernel's ephemeral range, where no other test's server is handed a port by the
    kernel: a port picked there could be taken a moment later by a server that the other xdist worker starts."""
    import socket

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    low = low if low > 11000 + n else 60000          # (a machine whose ephemeral range takes nearly every port)
    for _ in range(1000):
        base = _PORTS.randrange(10000, low - n)     # (not the global random: a stage seeds it, the same in both
        #                                             xdist workers, which then drew the same ports)
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def _serve(argv: list[str], env: dict, ready_url: str, log: Path, timeout: float = 120):
    """Start a server process (own session) and wait until `ready_url` answers; returns the process."""
    import time
    import urllib.request

    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[:3]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(ready_url, timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{argv[:3]} not ready in {timeout} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server (sqlite behind it, artifacts proxied), as a team would run one."""
    home, port = tmp_path_factory.mktemp("mlflow-server"), _free_port()
    proc = _serve([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                   "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination",
                   str(home / "artifacts")], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                  f"http://127.0.0.1:{port}/health", home / "server.log")
    yield f"http://127.0.0.1:{port}"
    _stop(proc)


@pytest.fixture(scope="session")
def prefect_ui(tmp_path_factory):
    """A Prefect server with its UI (prefect_test_harness serves the API only); its API URL."""
    home, port = tmp_path_factory.mktemp("prefect-server"), _free_port()
    api = f"http://127.0.0.1:{port}/api"
    proc = _serve([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  {"PREFECT_HOME": str(home), "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_API_URL": api}, f"{api}/health", home / "server.log")
    yield api
    _stop(proc)


def run_cli(args: list[str], cwd: Path, prefect_api: str, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)


def run_cli_many(calls: list[tuple[list[str], Path]], prefect_api: str,
                 timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """run_cli for many command lines at once: each is a fork of one process that imported the CLI's modules
    (tests/cli_forks.py), so each costs what the command does, not ~8 s of imports."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    out = subprocess.run([sys.executable, "-m", "tests.cli_forks"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout, input=json.dumps([{"args": a, "cwd": str(c)} for a, c in calls]))
    assert out.returncode == 0, out.stderr[-3000:]
    return [subprocess.CompletedProcess(a, r["rc"], r["stdout"], r["stderr"])
            for (a, _), r in zip(calls, json.loads(out.stdout))]


def s3_overrides(endpoint: str, bucket: str) -> list[str]:
    return ["-o", f"store.uri=s3://{bucket}/runs", "-o", f"store.endpoint_url={endpoint}"]


def read_summary(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def user_module(tmp_path: Path, monkeypatch, name: str, text: str) -> Path:
    """A module of the user's (reward functions) importable here and in every stage process this test starts;
    KILL_DIR (for the fault drills' markers) is tmp_path."""
    mod = tmp_path / "mods"
    mod.mkdir(exist_ok=True)
    (mod / f"{name}.py").write_text(text)
    monkeypatch.setenv("PYTHONPATH", f"{mod}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("KILL_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(str(mod))
    return mod


# The tiny model's tokenizer, and a copy with a ChatML template (Qwen's layout): the episode tests'.
CHATML = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tokenizer():
    from tasks.core import builtin_models
    from tasks.core.models import load_tokenizer

    return load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))


@pytest.fixture(scope="session")
def chatml():
    """The tiny tokenizer with a ChatML template whose end of turn is its EOS (Qwen's layout)."""
    from transformers import AutoTokenizer

    from tasks.core import builtin_models

    tok = AutoTokenizer.from_pretrained(builtin_models.resolve("builtin:tiny-lm"))    # (a copy of our own)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template, tok.eos_token = CHATML, "<|im_end|>"
    return tok


@pytest.fixture
def fake_cloud(tmp_path, monkeypatch):
    """The SkyPilot SDK replaced by tests/fake_sky, for the bridge process only."""
    state = tmp_path / "cloud"
    state.mkdir()
    wrapper = tmp_path / "sky-python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT / 'tests' / 'fake_sky'}{os.pathsep}$PYTHONPATH "
                       f"PATH={Path(sys.executable).parent}{os.pathsep}$PATH exec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_SKY_DIR", str(state))

    class Cloud:
        python = str(wrapper)

        def scenario(self, **kw):
            (state / "scenario.json").write_text(json.dumps(kw))

        def preempt(self, cluster: str) -> None:
            """The cloud takes a cluster's machine back (tests/fake_sky: preempt)."""
            spec = importlib.util.spec_from_file_location("fake_sky", ROOT / "tests/fake_sky/sky/__init__.py")
            fake = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(fake)
            fake.preempt(cluster)

        def preempt_once_written(self, store, key: str, cluster: str):
            """A thread that preempts `cluster` once `key` is complete in `store` (join it after the run)."""
            return once_written(store, key, lambda: self.preempt(cluster))

        def calls(self):
            path = state / "calls.jsonl"
            return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return Cloud()
