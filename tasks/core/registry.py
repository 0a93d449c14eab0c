"""The MLflow model registry: a run's published policies as versions of one registered model
(`publish.registered_model_name`, the run's name unless set), each naming its store URI, and the alias `champion`
on the version that evaluated best (what `model.start_from: champion` and `rlflow export` read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.core.tracking_db import tracking_client

if TYPE_CHECKING:
    from tasks.core.config import Config


def registered_model_name(cfg: Config) -> str:
    """The MLflow registered model a run's policies become versions of."""
    return cfg.publish.registered_model_name or cfg.run.name


def ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise


def register_policy(cfg: Config, run_id: str, policy_uri: str, iteration: int, client=None,
                    checked: bool = False) -> str:
    """Register `policy_uri` as a model version of `publish.registered_model_name`, once per URI and MLflow run.
    `checked=True`: the caller knows this URI is not registered (the Tracker reads the run's versions at start)."""
    name = registered_model_name(cfg)
    if client is None:          # standalone (stage CLI): make sure the registered model exists
        client = tracking_client(cfg.tracking.uri)
        ensure_registered_model(client, name)
    version = None if checked else _find_version(client, name, policy_uri, run_id)
    if version is None:
        source = policy_uri
        if cfg.tracking.uri.startswith(("http://", "https://")) and policy_uri.startswith("file://"):
            # A tracking server accepts a local path as a source only inside the run's artifacts (it cannot see
            # this machine's disk): the version's source is a small artifact of the run naming the policy.
            folder = f"policies/{policy_uri.rstrip('/').rsplit('/', 1)[-1]}"
            client.log_dict(run_id, {"policy_uri": policy_uri, "iteration": iteration}, f"{folder}/policy.json")
            source = f"runs:/{run_id}/{folder}"
        # (the description names the policy's store URI: what leads a version's page back to the store)
        version = client.create_model_version(
            name, source=source, run_id=run_id,
            tags={"rlflow.policy_uri": policy_uri, "rlflow.iteration": str(iteration)},
            description=f"Policy of rlflow run {cfg.run.name} after iteration {iteration}: {policy_uri}").version
    # No `latest` alias: MLflow reserves it, `models:/<name>/latest` is the newest. promote_if_better moves champion
    return str(version)


CHAMPION = "champion"


def promote_if_better(client, name: str, version: str, metric: str, value: float) -> bool:
    """Tag the version with its evaluation; move alias `champion` to it if it beats the current champion on
    the same metric (or there is none). Ties keep the champion. Returns whether it moved."""
    client.set_model_version_tag(name, version, f"rlflow.{metric}", repr(float(value)))
    if (champ := champion(client, name)) is not None:
        if str(champ.version) == str(version):
            return False
        theirs = champ.tags.get(f"rlflow.{metric}")
        if theirs is not None and float(theirs) >= float(value):
            return False
    client.set_registered_model_alias(name, CHAMPION, version)
    return True


def champion_policy_uri(cfg: Config) -> str | None:
    """Store URI of the policy behind `models:/<name>@champion`, or None when there is no champion."""
    if (mv := champion(tracking_client(cfg.tracking.uri), registered_model_name(cfg))) is None:
        return None
    return mv.tags.get("rlflow.policy_uri") or mv.source


def champion(client, name: str):        # the model version alias `champion` names, or None
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def _find_version(client, name: str, policy_uri: str, run_id: str | None = None) -> str | None:
    """The newest version of `policy_uri` (MLflow run `run_id`'s: a run started over has the same URIs)."""
    found = client.search_model_versions(f"name = '{name}' and tags.`rlflow.policy_uri` = '{policy_uri}'"
                                         + (f" and run_id = '{run_id}'" if run_id else ""))
    return str(max(int(mv.version) for mv in found)) if found else None
