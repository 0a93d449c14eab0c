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
                   "-o", "data.system_prompt=Say the next letter, three times.",     # chat prompts: readable?
                   "-o", f"tracking.uri={mlflow_server}", "-o", f"tracking.experiment={name}",
                   "-o", f"store.uri=file://{tmp_path}/store", "--summary-json", str(tmp_path / "s.json")],
                  tmp_path, prefect_ui)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = read_summary(tmp_path / "s.json")
    run_url = re.search(r"MLflow run:\s+(\S+)", out.stdout).group(1)
    runs_url = re.search(r"MLflow runs:\s+(\S+)", out.stdout).group(1)
    assert run_url.startswith(f"{mlflow_server}/#/experiments/")
    assert run_url.endswith(f"/runs/{summary['mlflow_run_id']}/model-metrics?workflowType=machine_learning")
    assert runs_url.endswith("/runs?workflowType=machine_learning&viewStateShareKey=rlflow")
    assert "View run" not in out.stdout                                  # MLflow's own URL line: once is enough
    episodes_url = re.search(r"episodes:\s+(\S+)", out.stdout).group(1)
    assert episodes_url == run_url.split("/model-metrics?")[0] + "/traces"

    client = MlflowClient(mlflow_server)
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    assert "reward/mean" in metrics and not any(k.startswith("cost") for k in metrics)   # no price: no cost
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    assert versions == [1, 2]                                  # the evaluated policies (2 and 4), not all four
    policy = client.get_model_version(name, "2").tags["rlflow.policy_uri"]
    assert policy == f"file://{tmp_path}/store/{name}/policy/v000004"
    # the episodes as traces of the run: every evaluated one (v2, v4) and the samples table's 8 per iteration, each
    # with its spans and its rewards as feedback; their cost in the flow is a metric
    exp = client.get_run(summary["mlflow_run_id"]).info.experiment_id
    traces = client.search_traces(locations=[exp], run_id=summary["mlflow_run_id"], max_results=500)
    by = {}
    for t in traces:
        by.setdefault((t.info.tags["rlflow.split"], t.info.tags["rlflow.iteration"]), []).append(t)
    assert {k: len(v) for k, v in by.items() if k[0] == "train"} == {("train", str(i)): 8 for i in range(1, 5)}
    assert {k for k in by if k[0] != "train"} == {("eval", "2"), ("eval", "4")}
    one = by[("train", "4")][0]
    assert [s.name for s in one.data.spans] == ["completion", "model call"]
    assert {a.name for a in one.info.assessments} == {"reward", "successor_reward"}
    assert metrics["tracking/traces"] >= 8 and "tracking/trace_seconds" in metrics
    shots = _shots(tmp_path)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_MS)

        # MLflow: the printed link opens the run's metric charts (model training, not GenAI), no click needed;
        # MLflow orders the chart sections alphabetically (docs/operations.md says so)
        page.goto(run_url)
        expect(page.get_by_role("heading", name=name)).to_be_visible()
        expect(page.get_by_role("heading", name="pass_at_1")).to_be_visible()          # eval/pass_at_1's chart
        expect(page.locator("svg.main-svg").first).to_be_visible()                     # a chart drawn (plotly)
        sections = [s for s, _ in re.findall(r"^([\w/]+)\n\((\d+)\)$", page.inner_text("body"), re.M)]
        ours = [s for s in sections if s in ("eval", "generate", "reward", "train")]
        assert ours == ["eval", "generate", "reward", "train"], sections
        assert not any(s.startswith("cost") for s in sections)
        page.screenshot(path=shots / "mlflow-run-metrics.png")

        # MLflow: the printed runs link: the experiment's runs (not its traces) with reward and eval columns
        page.goto(runs_url)
        expect(page.get_by_role("link", name=name).first).to_be_visible()              # the run's row
        for column in ("reward/mean", summary["held_out"]["metric"]):                  # (eval/reward_mean)
            expect(page.get_by_text(column, exact=True).first).to_be_visible()
        page.screenshot(path=shots / "mlflow-runs-list.png")

        # MLflow: the samples of the last iteration as a table, chat prompts as "role: content" lines
        page.goto(run_url.replace("/model-metrics?", "/artifacts/samples/iter-000004.json?"))
        expect(page.get_by_role("columnheader", name="completion")).to_be_visible()
        expect(page.get_by_role("columnheader", name="reward/successor_reward")).to_be_visible()
        assert page.get_by_role("row").count() >= 1 + 2 * 4 // 2          # the header and the sampled rows
        expect(page.get_by_text(re.compile("^system: Say the next letter")).first).to_be_visible()
        assert "'role'" not in page.inner_text("body")
        page.screenshot(path=shots / "mlflow-samples-table.png")
        expect(page.get_by_role("columnheader", name="trace")).to_be_visible()      # each row: its trace's link
        link = page.get_by_text(re.compile(r"/traces\?selectedEvaluationId=tr-")).first.inner_text()

        # MLflow: the printed episodes link opens the run's Traces tab; a row's link opens its trace: the spans
        # and, in the assessments pane, each reward function's score
        page.goto(episodes_url)
        expect(page.get_by_text(re.compile(rf"^{len(traces)} of {len(traces)}$"))).to_be_visible()
        expect(page.get_by_role("columnheader", name="successor_reward").first).to_be_visible()
        page.screenshot(path=shots / "mlflow-traces.png")
        page.goto(link)
        expect(page.get_by_text("model call", exact=True).first).to_be_visible()
        page.locator("button[aria-label^='Assess trace']").first.click()
        expect(page.get_by_text(re.compile(r"^Feedback \(2\)$"))).to_be_visible()
        expect(page.get_by_text("successor_reward", exact=True).last).to_be_visible()
        page.screenshot(path=shots / "mlflow-trace.png")

        # MLflow: the registered model has one version per evaluated policy; a version names its policy's store URI
        page.goto(f"{mlflow_server}/#/models/{name}?workflowType=machine_learning")
        expect(page.get_by_role("link", name="Version 2")).to_be_visible()
        assert page.get_by_role("link", name="Version 3").count() == 0
        page.screenshot(path=shots / "mlflow-model-versions.png")
        page.goto(f"{mlflow_server}/#/models/{name}/versions/2?workflowType=machine_learning")
        expect(page.get_by_text(policy, exact=False).first).to_be_visible()
        page.screenshot(path=shots / "mlflow-model-version.png")

        # Prefect: the flow run is titled with the run's name; its one artifact is the latest report, with the
        # reward per iteration drawn, and a link that opens the MLflow run
        base = prefect_ui.rsplit("/api", 1)[0]
        flow_run, artifacts = _flow_run(prefect_ui, name)
        assert [a["key"] for a in artifacts] == [f"{name}-report"]                  # one card, updated in place
        page.goto(f"{base}/runs/flow-run/{flow_run}")
        expect(page.get_by_text(name, exact=True).first).to_be_visible()
        page.get_by_text("Artifacts", exact=True).first.click()
        expect(page.get_by_text(f"{name}-report", exact=True).first).to_be_visible()
        page.screenshot(path=shots / "prefect-artifacts.png")
        page.get_by_text(f"{name}-report", exact=True).first.click()
        expect(page.get_by_text(f"{name} — iteration 4/4").first).to_be_visible()
        expect(page.get_by_text(re.compile("^[▁▂▃▄▅▆▇█]{4}$")).first).to_be_visible()   # the reward trend: a sparkline
        page.screenshot(path=shots / "prefect-report.png")
        prompt = page.get_by_text(re.compile("^system: Say the next letter")).first         # a sample's prompt:
        prompt.scroll_into_view_if_needed()
        assert re.fullmatch(r"system: Say the next letter, three times\.\nuser: \S+", prompt.inner_text())  # two lines
        page.screenshot(path=shots / "prefect-report-samples.png")
        # Prefect: the key's page (its versions: one per flow run) says what each is, not only its id
        page.goto(f"{base}/artifacts/key/{name}-report")
        expect(page.get_by_text(re.compile(r"^iteration 4/4, reward \d\.\d{3}: rlflow run ui-check's report")).first
               ).to_be_visible()
        page.screenshot(path=shots / "prefect-report-key.png")
        page.goto(f"{base}/artifacts/artifact/{artifacts[0]['id']}")
        link = page.get_by_role("link", name="MLflow run").first
        assert link.get_attribute("href") == run_url
        link.evaluate("a => a.removeAttribute('target')")               # open it here, not in a new tab
        link.click()
        expect(page.get_by_role("heading", name=name)).to_be_visible()
        browser.close()

    for shot in ("mlflow-run-metrics", "mlflow-runs-list", "mlflow-samples-table", "mlflow-traces", "mlflow-trace",
                 "mlflow-model-versions",
                 "mlflow-model-version", "prefect-artifacts", "prefect-report", "prefect-report-samples",
                 "prefect-report-key"):
        data = (shots / f"{shot}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, shot


def _flow_run(api: str, run_name: str) -> tuple[str, list[dict]]:
    """The id of the flow run named `run_name` (there is one) and its artifacts."""
    import json
    import urllib.request

    def post(path: str, body: dict) -> list:
        req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())

    runs = post("/flow_runs/filter", {"limit": 50})
    mine = [r for r in runs if r["name"] == run_name]
    assert len(mine) == 1, [r["name"] for r in runs]
    artifacts = post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [mine[0]["id"]]}}})
    return mine[0]["id"], artifacts
