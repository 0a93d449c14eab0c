"""Places on the local disk: the cache, the checkout rlflow runs from, and the sibling virtualenvs.

vLLM and SkyPilot pin packages below what the rest of rlflow needs (Makefile), so each lives in a virtualenv
of its own beside `.venv`: `.venv-vllm` and `.venv-sky`. Their interpreters are found by one rule,
`sibling_python`: the working directory first (where `rlflow` is run from, and a SkyPilot node's workdir),
then the checkout this code was imported from (where `make setup` built them).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]     # the checkout holding tasks/ and flows/


def cache_root() -> Path:
    """Local cache: builtin models, verified copies of store folders, vLLM server state. $RLFLOW_CACHE."""
    return Path(os.environ.get("RLFLOW_CACHE", Path.home() / ".cache" / "rlflow"))


def sibling_python(venv: str) -> str | None:
    """`<dir>/<venv>/bin/python` for the first of (working directory, repository root) that has it, or None."""
    for folder in (Path.cwd(), REPO_ROOT):
        python = folder / venv / "bin" / "python"
        if python.exists():
            return str(python)
    return None
