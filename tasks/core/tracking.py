"""MLflow: one MLflow run per rlflow run (a resumed run continues its MLflow run), metrics per iteration,
a sample table, the reward-curve plot, and the published policies as registered model versions (those evaluated
and the last, or every one: publish.register).

What a user opens first: the run's Model metrics (its chart sections are in MLflow's order, alphabetical: eval,
generate, iteration, reward, time, train) and the experiment's runs list with reward and evaluation columns (a
shared view stored as an experiment tag, `viewStateShareKey=rlflow` in the link). MLflow 3.17's UI shows what
its GenAI / Model training switch says (GenAI unless told), not the experiment's kind: every link carries
`workflowType=machine_learning`.

All calls go through an explicit MlflowClient for `tracking.uri`; nothing touches MLflow's global state.
Per-iteration work (metrics, sample table, model registration) runs on one background thread, in order, so
the loop never waits on MLflow; `drain()`/`end()` do, raise what failed there, and give up on a server silent for
ANSWER_SECONDS, saying what it lacks. A run killed (or given up on) with work queued loses nothing: on resume the
flow logs every iteration after the last one MLflow has, and registration is idempotent.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.errors import UserError
from tasks.core.registry import (
    CHAMPION,
    champion,
    ensure_registered_model,
    promote_if_better,
    register_policy,
    registered_model_name,
)
from tasks.core.retention import holds_no_iteration
from tasks.core.tracking_db import sqlite_file, tracking_client

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store

TAG_RUN, TAG_STORE = "rlflow.run", "rlflow.store"
CURVE_METRIC = "reward/mean"
EXPERIMENT_KIND = "mlflow.experimentKind"     # what MLflow's UI shows an experiment as (its own tag)
VIEW_KEY = "rlflow"                           # the experiment's shared view of the runs list (links)
UI_MODE = "workflowType=machine_learning"     # MLflow's UI opens on its GenAI views unless a link says this
LOCAL_UI = "http://127.0.0.1:5000"            # where `mlflow ui` serves a database or folder


def reading_client(uri: str, field: str):
    """A client for a command that only reads what the tracking URI holds (a model version to export or to
    score with): a sqlite database that does not exist is one line naming `field`, not a new empty database
    made on the way to "not found"."""
    database = sqlite_file(uri)
    if database is not None and not database.exists():
        raise UserError(f"{field}: no MLflow database at {database} (tracking.uri {uri}): nothing is registered there")
    if uri.startswith(("http://", "https://")):
        require_answer(uri, f"{field} (tracking.uri)")
    return tracking_client(uri)


def require_answer(uri: str, field: str, timeout: float = 10.0, experiment: str | None = None) -> None:
    """UserError naming `field` unless the MLflow server at the http(s) `uri` answers, and not as another kind of
    server: MLflow's REST API's lookup of `experiment` (default: one that need not exist) must not end in an error
    reply that is not MLflow's JSON (a plain web server's 404, another API's), and the experiment must not be
    deleted there. A redirect, an auth proxy's 401/403 or login page, and a TLS certificate urllib does not trust
    pass: what is behind them is MLflow's client's to reach, with its own credentials. MLflow's client retries a
    refused connection for minutes, saying nothing."""
    import base64
    import os
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri)
    base = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl().rstrip("/")
    headers = {}
    user, password = parts.username or os.environ.get("MLFLOW_TRACKING_USERNAME"), \
        parts.password or os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    name = experiment if experiment is not None else "rlflow-preflight"
    url = f"{base}/api/2.0/mlflow/experiments/get-by-name?{urllib.parse.urlencode({'experiment_name': name})}"

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None                  # (a redirect is answered as what it is: an HTTPError 3xx, which passes)

    try:
        with urllib.request.build_opener(Stay).open(urllib.request.Request(url, headers=headers),
                                                    timeout=timeout) as reply:
            status, body = reply.status, reply.read(1 << 20)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read(1 << 20)
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", e)
        if isinstance(why, ssl.SSLCertVerificationError) or isinstance(e, ssl.SSLCertVerificationError):
            return               # (it answered TLS: a certificate MLflow's own settings may trust, not urllib)
        raise UserError(f"{field}: {base}: no MLflow server answers there ({why}); expected a running tracking "
                        f"server, or sqlite:///PATH") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if status >= 400 and status not in (401, 403) and not (isinstance(answer, dict) and "error_code" in answer):
        raise UserError(f"{field}: {base}: a server answers there, but not as an MLflow tracking server (HTTP "
                        f"{status} to MLflow's experiments/get-by-name); expected an MLflow server's URL")
    stage = ((answer.get("experiment") or {}) if isinstance(answer, dict) else {}).get("lifecycle_stage")
    if experiment is not None and stage == "deleted":
        raise UserError(f"tracking.experiment: {experiment!r} was deleted in MLflow at {base}; restore it (`mlflow "
                        f"experiments restore`) or name another")


def local_folder(uri: str) -> Path | None:
    """The local folder a tracking URI writes in: a sqlite database's, or a file store itself (a bare path or
    file://); None for a server or a database in memory."""
    if uri.startswith("sqlite:"):
        database = sqlite_file(uri)
        return database.parent if database is not None else None
    if uri.startswith("file://"):
        return Path(uri[len("file://"):]).absolute()
    return Path(uri).absolute() if uri and ":" not in uri else None


def experiment_id(client, cfg: Config) -> str:
    """tracking.experiment's id, the experiment made if it is new (a user error naming tracking.uri if the
    tracking server refuses)."""
    from mlflow.exceptions import MlflowException

    try:
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        # a new experiment is one of model training (3.17's UI follows the link's workflowType: Tracker.links)
        return exp.experiment_id if exp else client.create_experiment(
            cfg.tracking.experiment, tags={EXPERIMENT_KIND: "custom_model_development"})
    except MlflowException as e:
        raise UserError(f"tracking.uri: {cfg.tracking.uri}: {str(e).splitlines()[0][:200]}") from None


def share_view(client, exp_id: str, cfg: Config) -> None:
    """The runs list as a user wants it first: reward and evaluation columns, newest run on top. MLflow's UI reads
    a view from the experiment tag `mlflow.sharedViewState.<key>` when a link says `viewStateShareKey=<key>`
    (Tracker.links); the metric columns of every config tracked to this experiment, in the order first seen."""
    tag = f"mlflow.sharedViewState.{VIEW_KEY}"
    current = client.get_experiment(exp_id).tags.get(tag)
    try:
        columns = json.loads(current)["selectedColumns"] if current else []
    except (ValueError, KeyError, TypeError):          # not ours, or edited by hand: ours again
        columns = []
    wanted = [CURVE_METRIC] + ([cfg.eval.metric_key()] if cfg.eval.every else [])
    metrics = [c for c in columns if isinstance(c, str) and c.startswith("metrics.")]
    metrics += [f"metrics.`{m}`" for m in wanted if f"metrics.`{m}`" not in metrics]
    # (only metric columns: with MLflow's own, Models and the rest, they start beyond a 1400-pixel window's edge)
    view = json.dumps({"selectedColumns": metrics, "orderByKey": "attributes.start_time", "orderByAsc": False})
    if view != current:
        client.set_experiment_tag(exp_id, tag, view)


def absolute_uri(uri: str) -> str:
    """A tracking URI that means the same from any directory (a relative sqlite database or folder made absolute)."""
    if uri.startswith("sqlite:///"):
        database = uri[len("sqlite:///"):]
        if database and database != ":memory:" and not database.startswith("/"):
            return f"sqlite:///{Path(database).absolute()}"
        return uri
    if ":" not in uri:                                  # a bare folder
        return str(Path(uri).absolute())
    return uri


def mlflow_command() -> str:
    """The `mlflow` of this environment by its absolute path (a line a user pastes from any directory, with no
    virtual environment active); plain `mlflow` when it has none."""
    import shlex

    exe = Path(sys.executable).parent / "mlflow"
    return shlex.quote(str(exe)) if exe.exists() else "mlflow"


def readable_prompt(prompt) -> str:
    """A chat prompt as a person reads it, one `role: content` line per message (a samples table's prompt column
    in MLflow and Prefect). The reward stage keeps a chat prompt as its messages; outputs made before 2026-11-27
    hold their Python repr, read back here; anything else is shown as it is."""
    messages = prompt
    if isinstance(prompt, str) and prompt.startswith("[{"):
        import ast

        try:
            messages = ast.literal_eval(prompt)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return prompt
    if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
        return "" if prompt is None else str(prompt)

    def text(content) -> str:            # a multimodal content is a list of parts: their text
        if isinstance(content, list):
            return " ".join(str(p.get("text", f"[{p.get('type', 'part')}]")) if isinstance(p, dict) else str(p)
                            for p in content)
        return "" if content is None else str(content)
    return "\n".join(f"{m['role']}: {text(m.get('content'))}" for m in messages)


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


_STOP = object()        # (the Tracker's flushing thread ends on it)
ANSWER_SECONDS = 300.0  # how long drain/end wait on a tracking server that answers nothing (one MLflow request
#                         waits 120 s, then retries): then the run ends without it and says what it lacks


class TrackingUnanswered(RuntimeError):
    """The tracking server stopped answering while the run waited on it (the store has everything)."""


def metric_key(name: str) -> str:
    """`name` as MLflow takes a metric's key: characters it refuses (anything but letters, digits, `_ - . : /` and
    spaces) as `_`, no empty, `.` or `..` path part, at most 250 characters. A reward function's log_metric("pass@1")
    is logged as reward/pass_1 where MLflow would refuse the whole batch (and the run with it)."""
    key = re.sub(r"[^/\w.\- :]", "_", str(name))
    for _ in range(2):                        # (again after the cut: it may end a part in "." or "/")
        key = "/".join(p if p != ".." else "__" for p in key.split("/") if p not in ("", "."))[:250] or "_"
    return key


class Tracker:
    """The MLflow side of one training run.

    `log_iteration` only appends to a pending buffer; a worker thread flushes it at most every
    `tracking.flush_seconds` (and on `drain`/`end`): model versions first, then the iterations' sample
    tables in one artifact upload, then every metric in one `log_batch` — the resume marker goes last.
    """

    def __init__(self, cfg: Config, store_root: str):
        self.cfg, self.client, self.store_root = cfg, tracking_client(cfg.tracking.uri), store_root
        self.run_id: str | None = None
        self.status_before: str | None = None     # the MLflow run's status when this flow run found it
        self.model_name = registered_model_name(cfg)
        self._registered: dict[str, str] = {}      # policy URI -> model version, for this MLflow run
        self.floor: float | None = None            # eval.baseline: the starting model's metric; champion must beat it
        self._pending: list[tuple[int, dict, list | None, str | None, list, list]] = []
        self.experiment_id: str | None = None
        self.superseded: str | None = None         # the MLflow run found was an earlier run's: the line to say
        self._traced = False                       # some traces queued in MLflow's exporter (drain waits)
        self._last_flush = time.monotonic()
        self._jobs, self._lock = queue.Queue(), threading.Lock()
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._ended = False                        # end() ran: no thread flushes any more (see _stop_worker)
        self._answered = time.monotonic()          # the worker's last answer from MLflow (or idle since)
        self._flushing: list[int] = []             # the iterations the worker is sending now

    @property
    def _unanswered(self) -> bool:
        """drain gave up on the server: nothing more is sent to it."""
        return isinstance(self._failure, TrackingUnanswered)

    def _check(self) -> None:                     # (background flushing: _check to _flush)
        if self._unanswered:
            raise self._failure
        if self._failure is not None:
            raise RuntimeError(f"MLflow logging failed: {self._failure}") from self._failure

    def _request_flush(self, job=None) -> None:
        """Queue a flush (or `job`, a call to MLflow) for the worker; returns at once."""
        if self._unanswered:        # (given up on: nothing more is sent to it)
            return
        if self._ended:             # (after end: flushed in the caller's thread, so no thread outlives the run)
            self._last_flush = time.monotonic()
            self._flush() if job is None else job()
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="rlflow-tracking", daemon=True)
            self._worker.start()
        if job is None:
            self._last_flush = time.monotonic()
        if not self._jobs.unfinished_tasks:         # (an idle worker: the wait for an answer starts now)
            self._tick()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            if (job := self._jobs.get()) is _STOP:
                self._jobs.task_done()
                return
            try:
                if self._failure is None:
                    self._flush() if job is None else job()
            except BaseException as e:  # surfaced by the next log_iteration or by drain()
                if not self._unanswered:      # (given up on already: that is said)
                    self._failure = e
            finally:
                self._tick()
                self._jobs.task_done()

    def _call(self, job) -> None:
        """`job` (a call to MLflow) on the worker after what is queued, waited for as drain waits; raises its error."""
        self._request_flush(job)
        self._wait()
        self._check()

    def _tick(self) -> None:
        """MLflow answered a request of the worker's (the time a silent server is measured from)."""
        self._answered = time.monotonic()

    def _wait(self) -> None:
        """Wait until the worker has done every queued job, while MLflow answers: after ANSWER_SECONDS with no
        answer, give up on it (TrackingUnanswered, saying what it lacks; nothing more is sent to it)."""
        while self._jobs.unfinished_tasks:
            if time.monotonic() - self._answered > ANSWER_SECONDS:
                its = sorted({*self._flushing, *(p[0] for p in self._pending)})
                lacks = ("the run's end is not recorded there; " if not its else f"iteration {its[0]} is stored but "
                         "not logged there; " if len(its) == 1 else f"iterations {its[0]}-{its[-1]} are stored but "
                         "not logged there; ")
                self._failure = TrackingUnanswered(
                    f"MLflow at {self.cfg.tracking.uri} has not answered for {ANSWER_SECONDS:g} s: {lacks}the same "
                    f"command run again when it answers logs them (nothing is lost: the store has the run)")
                raise self._failure         # (and the worker runs nothing queued after it, should it answer)
            time.sleep(0.05)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        self._flushing = [p[0] for p in pending]
        try:
            self._send(pending)
        finally:
            self._flushing = []

    def _send(self, pending: list[tuple]) -> None:
        from mlflow.entities import Metric

        key = self.cfg.eval.metric_key()
        for iteration, metrics, _, policy_uri, _, _ in pending:
            wanted = (self.cfg.publish.register_versions == "every" or key in metrics    # (evaluated)
                      or iteration == self.cfg.run.iterations)
            if policy_uri and self.cfg.publish.register_model and wanted and policy_uri not in self._registered:
                self._registered[policy_uri] = register_policy(self.cfg, self.run_id, policy_uri, iteration,
                                                               self.client, checked=True)
                self._tick()
            beats_base = self.floor is None or metrics.get(key, self.floor) > self.floor
            if policy_uri in self._registered and key in metrics and beats_base:
                promote_if_better(self.client, self.model_name, self._registered[policy_uri], key, metrics[key])
                self._tick()
        for iteration, metrics, samples, _, traces, _ in pending:
            if traces:
                links = self._traces(iteration, metrics, traces)
                for row, link in zip(samples or [], links):
                    row["trace"] = link
        with tempfile.TemporaryDirectory() as tmp:
            for iteration, _, samples, _, _, _ in pending:
                if samples:  # mlflow.log_table's format, written directly (log_table re-lists artifacts per call)
                    cols = list(dict.fromkeys(c for s in samples for c in s))
                    rows = [[readable_prompt(s.get(c)) if c == "prompt" else s.get(c) for c in cols] for s in samples]
                    (Path(tmp) / f"iter-{iteration:06d}.json").write_text(json.dumps({"columns": cols, "data": rows}))
            if any(Path(tmp).iterdir()):
                self.client.log_artifacts(self.run_id, tmp, "samples")
                self._tick()
                self._tables(sorted(f"samples/{f.name}" for f in Path(tmp).iterdir()))
        now = int(time.time() * 1000)
        for _, _, _, _, _, folders in pending:       # (an evaluation's pictures: before the iteration's metrics, whose
            for folder, artifact_path in folders:    # reward/mean marks it logged for a resume)
                for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
                    where = Path(artifact_path, file.parent.relative_to(folder)).as_posix()
                    self.client.log_artifact(self.run_id, str(file), where.removesuffix("/."))
                    self._tick()
        batch = [Metric(metric_key(k), float(v), now, it) for it, metrics, _, _, _, _ in pending
                 for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
            self._tick()

    def log_iteration(self, iteration: int, metrics: dict[str, float], samples: list[dict] | None = None,
                      policy_uri: str | None = None, traces: list[tuple[str, str]] | None = None,
                      folders: list[tuple[Path, str]] | None = None) -> None:
        """Queue an iteration's metrics, sample table, model version, traces ((split, store key of records):
        "train" the reward stage's, whose samples-table rows get a trace each; "eval"/"eval-greedy" the evaluate
        stage's, every one) and folders of artifacts ((folder, artifact path): an evaluation's pictures, which
        stay where they are); returns at once."""
        self._check()
        with self._lock:
            self._pending.append((iteration, dict(metrics), [dict(s) for s in samples] if samples else samples,
                                  policy_uri, list(traces or []) if self.cfg.tracking.traces else [],
                                  list(folders or [])))
        if time.monotonic() - self._last_flush >= self.cfg.tracking.flush_seconds:
            self._request_flush()

    def _traces(self, iteration: int, metrics: dict, traces: list[tuple[str, str]]) -> list[str | None]:
        """Log the records at each key as traces of the run (tasks/core/traces.py); their cost goes in `metrics`
        (tracking/trace_seconds, tracking/traces). Returns the links of the training records' traces, in the
        samples table's order."""
        from tasks.core import rollout
        from tasks.core.store import open_store
        from tasks.core.traces import (
            ITERATION_TAG,
            RUN_TAG,
            SPLIT_TAG,
            episode_tree,
            log_trees,
            sample_rows,
            trace_to,
            trace_url,
        )

        t0 = time.perf_counter()
        trace_to(self.cfg.tracking.uri)         # (traces go where MLflow's global URI says; the environment kept)
        store, run, links, n = open_store(self.cfg), self.cfg.run.name, [], 0
        for split, key in traces:
            if store.manifest(key) is None:
                continue
            try:
                records = rollout.load(store, key, layout.GREEDY if split == "eval-greedy" else "")
            except FileNotFoundError:            # (an evaluation with no records of that kind)
                continue
            if split == "train":
                records = [records[i] for i in sample_rows(len(records), self.cfg.tracking.sample_completions)]
                made = store.manifest(layout.rollouts(run, iteration)) or {}
                policy = (made.get("meta") or {}).get("policy")
                seconds = float(metrics.get("generate/sampling_seconds", 0.0))
            else:
                policy, seconds = (layout.policy(run, iteration) if iteration else layout.BASE), 0.0
            trees = [episode_tree(r, policy=policy, call_seconds=seconds) for r in records]
            ids = log_trees(self.client, self.experiment_id, self.run_id, trees,
                            {ITERATION_TAG: str(iteration), SPLIT_TAG: split, RUN_TAG: run}, answered=self._tick)
            n += len(ids)
            self._traced = True
            if split == "train":
                links = [trace_url(self.cfg.tracking.uri, self.experiment_id, i) or i for i in ids]
        metrics["tracking/trace_seconds"] = time.perf_counter() - t0
        metrics["tracking/traces"] = float(n)
        return links

    def drain(self) -> None:
        """Flush everything pending and wait for it (traces too); raise if tracking failed or stopped answering."""
        self._request_flush()
        self._wait()
        self._check()
        if self.cfg.tracking.traces and self._traced:     # (sent as they are made, unless the user's
            import mlflow  # (MLFLOW_ENABLE_ASYNC_TRACE_LOGGING queued them: traces.py)

            self._call(mlflow.flush_trace_async_logging)

    def start(self, store: Store | None = None) -> str:
        """Find this run's MLflow run (same run name and store) or create it; log the resolved config. One that
        logged iterations the store holds none of (an earlier run's) is left as it is (`superseded` says so)."""
        from mlflow.entities import Param

        cfg = self.cfg
        exp_id = self.experiment_id = experiment_id(self.client, cfg)
        share_view(self.client, exp_id, cfg)
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`{TAG_RUN}` = '{cfg.run.name}' and tags.`{TAG_STORE}` = '{self.store_root}'",
            max_results=1, order_by=["attributes.start_time DESC"])
        earlier = None                              # (the MLflow run of an earlier run of the name: superseded)
        if found and store is not None and self.last_logged_iteration(found[0].info.run_id) and \
                holds_no_iteration(store, cfg.run.name):
            earlier, found = found[0].info.run_id, []
            self.superseded = (f"MLflow run {earlier} logged iterations of an earlier run {cfg.run.name} whose "
                               f"outputs are gone from {store.uri(cfg.run.name)}: this run logs to a new one")
        if found:
            self.run_id = found[0].info.run_id
            self.status_before = found[0].info.status      # a refused resume puts it back (see finish)
            self.client.update_run(self.run_id, status="RUNNING")
            logged = found[0].data.params
        else:
            run = self.client.create_run(exp_id, run_name=cfg.run.name,
                                         tags={TAG_RUN: cfg.run.name, TAG_STORE: self.store_root})
            self.run_id, logged = run.info.run_id, {}
        params = {k: v[:6000] for k, v in _flatten(cfg.model_dump(mode="json")).items() if k not in logged}
        if cfg.publish.register_model:
            ensure_registered_model(self.client, self.model_name)
            if earlier and (champ := champion(self.client, self.model_name)) and champ.run_id == earlier:
                self.client.delete_registered_model_alias(self.model_name, CHAMPION)      # (its weights are gone)
                self.superseded += f"; its champion (version {champ.version}) is no champion now"
            for mv in self.client.search_model_versions(f"name = '{self.model_name}' and run_id = '{self.run_id}'"):
                self._registered[mv.tags.get("rlflow.policy_uri", mv.source)] = str(mv.version)
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        return self.run_id

    def last_value(self, metric: str) -> float:
        """The metric's value at the highest step logged so far (0.0 if never): running totals resume."""
        history = self.client.get_metric_history(self.run_id, metric)
        return max(history, key=lambda m: (m.step, m.timestamp)).value if history else 0.0

    def last_logged_iteration(self, run_id: str | None = None) -> int:
        history = self.client.get_metric_history(run_id or self.run_id, CURVE_METRIC)
        return max((m.step for m in history), default=0)

    def log_reward_curve(self, rewards: list[float], out_dir: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "reward_curve.png"
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3)
        ax.set_xlabel("iteration")
        ax.set_ylabel("mean reward")
        ax.set_title(f"{self.cfg.run.name}: mean reward per iteration")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        self._call(lambda: self.client.log_artifact(self.run_id, str(path), "plots"))
        return path

    def _tables(self, paths: list[str]) -> None:
        """Mark sample files as tables, as mlflow.log_table does (the `mlflow.loggedArtifacts` tag), so the MLflow
        UI shows them as tables (its Evaluation view) and `load_table` finds them; the newest 60 (a tag value is
        at most 8000 characters)."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        run = self.client.get_run(self.run_id)
        listed = json.loads(run.data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        listed += [{"path": p, "type": "table"} for p in paths if {"path": p, "type": "table"} not in listed]
        self.client.set_tag(self.run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(listed[-60:]))

    def end(self, status: str = "FINISHED", refused: bool = False) -> None:
        """Flush and close the MLflow run. With status FAILED, tracking errors are swallowed: the caller is
        already raising the error that matters. `refused`: this flow run stopped on the user's input (a resume
        with another config): an earlier run's status is left as it was, not turned FAILED."""
        if refused and self.status_before in ("FINISHED", "KILLED"):
            status = self.status_before
        if self._unanswered:        # (given up on: the run stays RUNNING there until the command runs again)
            self._stop_worker()
            if status == "FINISHED":
                self._check()
            return
        try:
            self.drain()
            self._call(lambda: self.client.set_terminated(self.run_id, status=status))
        except Exception:
            self._stop_worker()
            if status == "FINISHED":
                raise
        else:
            self._stop_worker()

    def _stop_worker(self) -> None:
        """End the flushing thread once the run is closed (a process that runs many flows, a tuning study's or a
        Prefect worker's, kept one idle thread per run). Called after drain(), so the thread is idle and ends at
        once; not on an interrupt (Ctrl-C in drain: the process is ending, and a join would hold it back)."""
        self._ended = True
        if (worker := self._worker) is not None:
            self._worker = None
            self._jobs.put(_STOP)
            if not self._unanswered:    # (a thread still waiting on the server ends when it answers, or with us)
                worker.join()

    def model_version(self, policy_uri: str) -> str | None:
        """The registered model version of a published policy (after drain; None when registration is off)."""
        return self._registered.get(policy_uri)

    def links(self) -> dict[str, str | None]:
        """Where to look: `run` the run's Model metrics page (a tracking server) or `<uri> run <id>` (a database or
        folder); `runs` the experiment's runs list in its shared view (a server); `view` the command that serves a
        database or folder, then the page to open (None for a server)."""
        uri = self.cfg.tracking.uri
        exp = self.client.get_run(self.run_id).info.experiment_id
        run_page = f"#/experiments/{exp}/runs/{self.run_id}/model-metrics?{UI_MODE}"
        runs_page = f"#/experiments/{exp}/runs?{UI_MODE}&viewStateShareKey={VIEW_KEY}"
        traces_page = f"#/experiments/{exp}/runs/{self.run_id}/traces"
        if uri.startswith(("http://", "https://")):
            base = uri.rstrip("/")
            return {"run": f"{base}/{run_page}", "runs": f"{base}/{runs_page}", "view": None,
                    "traces": f"{base}/{traces_page}" if self.cfg.tracking.traces else None}
        serve = f"{mlflow_command()} ui --backend-store-uri {absolute_uri(uri)}"
        return {"run": f"{uri} run {self.run_id}", "runs": None, "view": f"{serve}  then open {LOCAL_UI}/{run_page}",
                "traces": f"{LOCAL_UI}/{traces_page} (served as `view` says)" if self.cfg.tracking.traces else None}
