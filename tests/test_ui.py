"""What a user sees: a run tracked to an MLflow server and a Prefect server with its UI, looked at in headless
Chromium (Debian's chromium, driven by playwright), with a screenshot of each view.

Screenshots go to $RLFLOW_UI_SHOTS when set (e.g. `RLFLOW_UI_SHOTS=/tmp/shots make test`), else to the test's
temporary folder (pytest prints neither: look there after a failure).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, TINY, read_summary, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.ui]
WAIT_MS = 60_000           # a view's first render on a busy 2-core machine


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("RLFLOW_UI_SHOTS") or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_mlflow_and_prefect_uis_show_the_run(tmp_path, mlflow_server, prefect_ui):
    from mlflow import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    name = "ui-check"
    out = run_cli(["run", str(TINY), "-o", f"run.name={name}", "-o", "run.iterations=4", "-o", "eval.every=2",
                   "-o", "generate.prompts_per_iteration=2", "-o", "generate.num_generations=4",
                   "-o", f"tracking.uri={mlflow_server}", "-o", f"tracking.experiment={name}",
                   "-o", f"store.uri=file://{tmp_path}/store", "--summary-json", str(tmp_path / "s.json")],
                  tmp_path, prefect_ui)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = read_summary(tmp_path / "s.json")
    run_url = re.search(r"MLflow run:\s+(\S+)", out.stdout).group(1)
    assert run_url.startswith(f"{mlflow_server}/#/experiments/") and run_url.endswith("?workflowType=machine_learning")
    assert "View run" not in out.stdout                                  # MLflow's own URL line: once is enough

    client = MlflowClient(mlflow_server)
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    assert "reward/mean" in metrics and not any(k.startswith("cost") for k in metrics)   # no price: no cost
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    assert versions == [1, 2]                                  # the evaluated policies (2 and 4), not all four
    shots = _shots(tmp_path)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_MS)

        # MLflow: the run as model training (not GenAI evaluations), its metric charts
        page.goto(run_url)
        expect(page.get_by_role("heading", name=name)).to_be_visible()
        expect(page.get_by_text("Model metrics", exact=True).first).to_be_visible()
        page.get_by_text("Model metrics", exact=True).first.click()
        expect(page.get_by_role("heading", name="pass_at_1")).to_be_visible()          # eval/pass_at_1's chart
        sections = re.findall(r"^([\w/]+)\n\((\d+)\)$", page.inner_text("body"), re.M)     # "reward\n(4)"
        assert {"reward", "eval", "train", "generate"} <= {s for s, _ in sections}, sections
        assert not any(s.startswith("cost") for s, _ in sections)
        page.screenshot(path=shots / "mlflow-run-metrics.png")

        # MLflow: the samples of the last iteration as a table
        page.goto(run_url.replace("?", "/artifacts/samples/iter-000004.json?"))
        expect(page.get_by_role("columnheader", name="completion")).to_be_visible()
        expect(page.get_by_role("columnheader", name="reward/successor_reward")).to_be_visible()
        assert page.get_by_role("row").count() >= 1 + 2 * 4 // 2          # the header and the sampled rows
        page.screenshot(path=shots / "mlflow-samples-table.png")

        # MLflow: the registered model has one version per evaluated policy
        page.goto(f"{mlflow_server}/#/models/{name}?workflowType=machine_learning")
        expect(page.get_by_role("link", name="Version 2")).to_be_visible()
        assert page.get_by_role("link", name="Version 3").count() == 0
        page.screenshot(path=shots / "mlflow-model-versions.png")

        # Prefect: the flow run's artifacts; the MLflow one is a link that opens the run
        base = prefect_ui.rsplit("/api", 1)[0]
        flow_run = _flow_run_id(prefect_ui, name)
        page.goto(f"{base}/runs/flow-run/{flow_run}")
        page.get_by_text("Artifacts", exact=True).first.click()
        expect(page.get_by_text(f"{name}-report", exact=True).first).to_be_visible()
        page.screenshot(path=shots / "prefect-artifacts.png")
        page.get_by_text(f"{name}-mlflow", exact=True).last.click()
        link = page.locator(f"a[href^='{mlflow_server}/#/experiments/']").first
        expect(link).to_be_visible()
        assert link.get_attribute("href") == run_url
        page.screenshot(path=shots / "prefect-mlflow-link.png")
        link.evaluate("a => a.removeAttribute('target')")               # open it here, not in a new tab
        link.click()
        expect(page.get_by_role("heading", name=name)).to_be_visible()
        browser.close()

    for shot in ("mlflow-run-metrics", "mlflow-samples-table", "mlflow-model-versions", "prefect-artifacts",
                 "prefect-mlflow-link"):
        data = (shots / f"{shot}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, shot


def _flow_run_id(api: str, run_name: str) -> str:
    import json
    import urllib.request

    req = urllib.request.Request(f"{api}/flow_runs/filter", data=json.dumps({"limit": 50}).encode(),
                                 headers={"content-type": "application/json"})
    runs = json.loads(urllib.request.urlopen(req, timeout=10).read())
    mine = [r for r in runs if f"run.name={run_name}" in r["name"]]
    assert mine, [r["name"] for r in runs]
    return mine[0]["id"]
