"""Episodes as MLflow traces: what the model said, what the environment or tool answered, and what each reward
function made of it, readable in the run's Traces tab (MLflow 3).

Which: every evaluated episode (the evaluate stage's records, sampled and greedy) and, of the training batch, the
completions the samples table shows (`sample_rows`: the same records, so each table row links to its trace),
when `tracking.traces` is on. The flow's tracker logs them on its background thread (tasks/core/tracking.py), read
back from the store, so the stages never wait for MLflow.

One trace per record: the episode, a span per model call and per environment step, laid end to end from the
stage's start, and each reward function's score as MLflow feedback.
More: docs/internals.md (tasks/core/traces.py): the spans, their attributes and times.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tasks.core.contracts import Rollout
from tasks.core.process_wide import environment_variables, restore

SPLIT_TAG, ITERATION_TAG, RUN_TAG = "rlflow.split", "rlflow.iteration", "rlflow.run"
_TEXT_LIMIT = 20_000          # characters of one message content kept in a span (MLflow stores spans as JSON)


def trace_to(uri: str) -> None:
    """Send this process's traces to `uri`. MLflow's exporter sends them where its global tracking URI says, and
    mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI in the process's environment, which every stage process,
    a later run in this process (tracking.uri's default) and a test after it would inherit: that is put back."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    restore("MLFLOW_TRACKING_URI", before)


def sample_rows(n_records: int, n: int) -> list[int]:
    """The records the samples table shows (and that get a training trace): n spread evenly over the batch."""
    step = max(n_records // max(n, 1), 1)
    return list(range(0, n_records, step))[:n]


def _clip(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= _TEXT_LIMIT else value[:_TEXT_LIMIT] + f"… [{len(value) - _TEXT_LIMIT} more]"
    if isinstance(value, list):
        return [_clip(v) for v in value]
    if isinstance(value, dict):
        return {k: _clip(v) for k, v in value.items()}
    return value


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in a completion mask: the model's calls, in order."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def episode_tree(r: Rollout, *, policy: str | None, call_seconds: float = 0.0) -> dict:
    """The span tree of one record, as plain data (what log_trees writes): {name, span_type, inputs, outputs,
    attributes, seconds, spans: [{name, span_type, inputs, outputs, attributes, seconds, error}], assessments}."""
    attrs = {"group": r.group, "row": r.row, "part": r.part, "truncated": r.truncated, "policy": policy,
             "prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.completion_ids)}
    assessments = {k: v for k, v in (r.rewards or {}).items() if v is not None}
    if r.reward is not None:
        assessments["reward"] = r.reward
    spans: list[dict] = []
    if r.turns is None:                                       # one completion
        n = len(r.completion_ids)
        spans.append({"name": "model call", "span_type": "LLM", "inputs": {"messages": _clip(r.prompt)},
                      "outputs": {"content": _clip(r.completion)}, "seconds": call_seconds, "error": None,
                      "attributes": {"policy": policy, "prompt_tokens": len(r.prompt_ids), "completion_tokens": n,
                                     "mean_logprob": sum(r.logprobs) / n if n else None,
                                     "truncated": r.truncated}})
        outputs: Any = {"completion": _clip(r.completion)}
    else:
        mask = r.mask if r.mask is not None else [1] * len(r.completion_ids)
        runs = _runs(mask)
        calls = [i for i, m in enumerate(r.turns) if m.get("role") == "assistant"]
        aligned = len(runs) == len(calls)            # (each reply's tokens known: one run of the mask per reply)
        timings = r.timings or []
        since, k = [], 0
        for i, message in enumerate(r.turns):
            if message.get("role") != "assistant":
                since.append(message)
                continue
            start, end = runs[k] if aligned else (0, 0)
            lps = r.logprobs[start:end]
            took = timings[k] if k < len(timings) else {}
            spans.append({"name": f"model call {k + 1}", "span_type": "LLM",
                          "inputs": {"messages": _clip(since if k else (r.prompt or []) + since)},
                          "outputs": _clip(message), "seconds": took.get("model", 0.0), "error": None,
                          "attributes": {"policy": policy, "turn": k + 1,
                                         "completion_tokens": (end - start) if aligned else None,
                                         "mean_logprob": sum(lps) / len(lps) if lps else None}})
            observation = []
            for m in r.turns[i + 1:]:
                if m.get("role") == "assistant":
                    break
                observation.append(m)
            last = k == len(calls) - 1
            reward = r.turn_rewards[k] if r.turn_rewards and k < len(r.turn_rewards) else None
            if observation or reward is not None or (last and r.env_error):
                tool = bool(message.get("tool_calls")) or any(m.get("role") == "tool" for m in observation)
                spans.append({"name": f"{'tool call' if tool else 'environment step'} {k + 1}",
                              "span_type": "TOOL" if tool else "CHAIN",
                              "inputs": {"action": _clip(message.get("tool_calls") or message.get("content"))},
                              "outputs": {"observation": _clip(observation)}, "seconds": took.get("env", 0.0),
                              "error": r.env_error if last else None,
                              "attributes": {"turn": k + 1, "reward": reward}})
            since, k = [], k + 1
        if r.env_return is not None:
            assessments["env_return"] = r.env_return
        attrs |= {"turns": len(calls), "env_return": r.env_return, "env_error": r.env_error}
        outputs = {"turns": _clip(r.turns)}
    return {"name": "episode" if r.turns is not None else "completion",
            "span_type": "AGENT" if r.turns is not None else "CHAIN", "inputs": {"prompt": _clip(r.prompt)},
            "outputs": outputs, "attributes": attrs, "seconds": sum(s["seconds"] for s in spans),
            "spans": spans, "assessments": assessments, "error": r.env_error}


def log_trees(client, experiment_id: str, run_id: str, trees: list[dict], tags: dict[str, str],
              start_ns: int | None = None, answered=None) -> list[str]:
    """Write each tree as one MLflow trace of the run (spans laid end to end from `start_ns`), its assessments
    with it; returns the trace ids, in order. Sent as each ends, `answered()` called after each."""
    # Sent as each trace ends, on the thread that makes it (the Tracker's worker, whose waits are bounded), unless
    # the user asked for MLflow's queue: it flushed them at exit with no bound, from a server that had stopped
    # answering too. Only while these are made (the exporter is made with the first): no child inherits it.
    with environment_variables({"MLFLOW_ENABLE_ASYNC_TRACE_LOGGING":
                                os.environ.get("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")}):
        return _log_trees(client, experiment_id, run_id, trees, tags, start_ns, answered)


def _log_trees(client, experiment_id, run_id, trees, tags, start_ns, answered) -> list[str]:
    import mlflow
    from mlflow.entities import AssessmentSource, Feedback

    t = start_ns or time.time_ns()
    ids = []
    for tree in trees:
        root = client.start_trace(tree["name"], span_type=tree["span_type"], inputs=tree["inputs"],
                                  attributes=_attributes(tree["attributes"]), tags=tags, experiment_id=experiment_id,
                                  start_time_ns=t, run_id=run_id)
        at = t
        for s in tree["spans"]:
            span = client.start_span(s["name"], trace_id=root.trace_id, parent_id=root.span_id,
                                     span_type=s["span_type"], inputs=s["inputs"],
                                     attributes=_attributes(s["attributes"]), start_time_ns=at)
            at += max(int(s["seconds"] * 1e9), 1000)
            client.end_span(root.trace_id, span.span_id, outputs=s["outputs"], end_time_ns=at,
                            status="ERROR" if s["error"] else "OK",
                            **({"attributes": {"error": s["error"]}} if s["error"] else {}))
        feedback = [Feedback(name=name, value=float(value), trace_id=root.trace_id,
                             source=AssessmentSource(source_type="CODE", source_id=name))
                    for name, value in tree["assessments"].items()]
        late = feedback if not _attach(root.trace_id, feedback) else []
        client.end_trace(root.trace_id, outputs=tree["outputs"], end_time_ns=max(at, t + 1000),
                         status="ERROR" if tree["error"] else "OK")
        ids.append(root.trace_id)
        if answered is not None:
            answered()
        if late:                                   # (sent one by one once the trace is on the server)
            mlflow.flush_trace_async_logging()
            for f in late:
                mlflow.log_feedback(trace_id=root.trace_id, name=f.name, value=f.value, source=f.source)
    return ids          # (exported by MLflow's async queue: tracking.py's drain waits for it)


def _attach(trace_id: str, feedback: list) -> bool:
    """The assessments put on the trace while it is still in memory, so they travel with it in its one export
    (what mlflow.log_feedback does for the active trace); False if MLflow's buffer does not have it."""
    try:
        from mlflow.tracing.trace_manager import InMemoryTraceManager

        with InMemoryTraceManager.get_instance().get_trace(trace_id) as trace:
            if trace is None:
                return False
            trace.info.assessments.extend(feedback)
            return True
    except Exception:  # noqa: BLE001 - another MLflow's internals: fall back to one call per assessment
        return False


def _attributes(attrs: dict) -> dict:
    """Span attributes MLflow keeps as they are: numbers, strings, booleans; None dropped, the rest as JSON."""
    return {k: v if isinstance(v, str | int | float | bool) else json.dumps(v, default=str)
            for k, v in attrs.items() if v is not None}


def trace_url(tracking_uri: str, experiment_id: str, trace_id: str) -> str | None:
    """The trace's page in the MLflow UI (None when tracking is not a server)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/traces?selectedEvaluationId={trace_id}"
