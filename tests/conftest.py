"""Real servers on 127.0.0.1 for the whole session: an S3-compatible server (moto in server mode) and a
Prefect API (prefect_test_harness). MLflow runs on sqlite in each test's folder. The tiny model is built
offline into a session cache and loaded through `from_pretrained` like any hub model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

# Fake credentials for the local S3 server; set before boto3 is imported anywhere.
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def rlflow_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("rlflow-cache")
    os.environ["RLFLOW_CACHE"] = str(cache)
    return cache


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
    """One Prefect API for the session; its URL is handed to subprocess runs too."""
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(get_current_settings().api.url)


def run_cli(args: list[str], cwd: Path, prefect_api: str, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)


def s3_overrides(endpoint: str, bucket: str) -> list[str]:
    return ["-o", f"store.uri=s3://{bucket}/runs", "-o", f"store.endpoint_url={endpoint}"]


def read_summary(path: Path) -> dict:
    return json.loads(Path(path).read_text())
