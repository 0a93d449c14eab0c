"""Where each stage and service of a run runs, and how a stage finds its services: computed once.

`Placement` is read from the config alone (`placement_of(cfg)`): each stage's launcher, which stages only route
to generate replicas and where those run, the environment server, each reward model's server. The plan, the
preflight, the services, the loop, the episodes and the judges ask it instead of the config's keys.
`Services` is a stage's context: the URLs and tokens of the servers the flow started for this run, and how the
generate router launches replicas on sky. The flow hands it to an inline stage as an argument and to a stage
process as environment variables (`variables()`), read back once where that process starts its stage
(`from_environment()`, tasks/core/stage.py: stage_cli). Nothing here writes the environment.
More: docs/internals.md (tasks/core/placement.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tasks.core.config import Config

# The variables a stage process finds its services in (the only channel across a process boundary)
ENV_URL_VAR, ENV_TOKEN_VAR = "RLFLOW_ENV_SERVER", "RLFLOW_ENV_TOKEN"
JUDGES_VAR, JUDGE_TOKEN_VAR = "RLFLOW_REWARD_MODELS", "RLFLOW_JUDGE_TOKEN"
REPLICA_LAUNCH_VAR = "RLFLOW_REPLICA_LAUNCH"      # JSON {"start": argv, "port_base": n, "clusters": [...]} (sky)

Where = Literal["inline", "local", "sky"]          # a stage's launcher (launcher.where / launcher.stages)
ServiceWhere = Literal["none", "yours", "stage", "local", "sky"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where everything of one run runs (from the config: no server started, nothing asked)."""

    stages: Mapping[str, Where]               # stage -> where its launcher runs it
    replicas: int                             # generate.replicas: 0 = the stage samples with its own engine
    replicas_where: ServiceWhere              # none | local (processes beside the flow) | sky (a cluster each)
    env: ServiceWhere                         # none (no env.factory) | yours | stage (no server) | local | sky
    env_servers: int                          # servers behind the environment URL (a pool when > 1)
    judges: Mapping[str, ServiceWhere]        # reward.models name -> yours (url) | stage | local | sky
    streaming: bool = False                   # generate.streaming: one sampler in the flow's process

    def where(self, stage: str) -> Where:
        return self.stages[stage]

    def routes(self, stage: str) -> bool:
        """`stage` runs in the flow's process and only routes to the generate replicas (they sample)."""
        return bool(self.replicas) and stage in ("generate", "evaluate")

    def launched(self, stage: str) -> bool:
        """`stage` runs outside the flow's process (a local subprocess or SkyPilot), on its own launcher."""
        return self.stages[stage] != "inline" and not self.routes(stage)

    def on_sky(self) -> list[str]:
        """Stages launched on SkyPilot (routed ones are not: their replicas are)."""
        return [s for s in self.stages if self.stages[s] == "sky" and not self.routes(s)]

    def served_judges(self) -> dict[str, ServiceWhere]:
        """Reward models the flow serves (where: local | sky), by name."""
        return {n: w for n, w in self.judges.items() if w in ("local", "sky")}

    def judges_at(self, where: ServiceWhere) -> list[str]:
        """Reward models at `where` (e.g. sky: a cluster each), by name, in the config's order."""
        return [n for n, w in self.judges.items() if w == where]

    def env_remote(self) -> bool:
        """The episodes talk to an environment server (yours, or the flow's), not to environments in the stage."""
        return self.env in ("yours", "local", "sky")

    def serves_env(self) -> bool:
        """The flow starts the environment server(s): on this machine (local) or on SkyPilot (sky)."""
        return self.env in ("local", "sky")

    def scores_as_groups_complete(self) -> bool:
        """Streamed groups are scored as they complete, in the flow's process: generate.streaming, reward
        functions only (no reward.models), the reward stage inline (tasks/scoring/streamed.py)."""
        return self.streaming and not self.judges and self.stages["reward"] == "inline"

    def services_on_sky(self) -> list[str]:
        """The servers the flow starts on SkyPilot beside the stages, by recipe: env, replica, judge."""
        return [role for role, on_sky in (("env", self.env == "sky"), ("replica", self.replicas_where == "sky"),
                                          ("judge", bool(self.judges_at("sky")))) if on_sky]


def placement_of(cfg: Config) -> Placement:
    """The run's placement, from its config."""
    from tasks.core.config_infra import STAGES

    lc, gc, ec = cfg.launcher, cfg.generate, cfg.env
    stages = {s: lc.where_of(s) for s in STAGES}
    replicas_where: ServiceWhere = "none" if not gc.replicas else ("sky" if stages["generate"] == "sky" else "local")
    env: ServiceWhere = "none" if not ec.factory else "yours" if ec.url is not None else ec.where
    judges = {m.name: ("yours" if m.url is not None else m.where) for m in cfg.reward.models}
    return Placement(stages, gc.replicas, replicas_where, env, ec.servers, judges, gc.streaming is not None)


@dataclasses.dataclass(frozen=True)
class Services:
    """A stage's context: the servers the flow started for it (empty: none; the stage uses what the config says,
    e.g. an env.where URL, or loads a reward model itself)."""

    env_url: str | None = None
    env_token: str = ""
    judges: Mapping[str, str] = dataclasses.field(default_factory=dict)     # reward model name -> URL
    judge_token: str | None = None
    replica_launch: Mapping | None = None      # how the router starts replica i on sky (None: a process here)

    def __or__(self, other: Services) -> Services:
        """`other`'s services added to these (its given fields win)."""
        given = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                 if getattr(other, f.name) not in (None, "", {})}
        return dataclasses.replace(self, **given)

    def variables(self) -> dict[str, str]:
        """These services as a stage process reads them (its environment): only the given ones."""
        out = {}
        if self.env_url:
            out.update({ENV_URL_VAR: self.env_url, ENV_TOKEN_VAR: self.env_token})
        if self.judges:
            out[JUDGES_VAR] = json.dumps(dict(self.judges))
            if self.judge_token:
                out[JUDGE_TOKEN_VAR] = self.judge_token
        if self.replica_launch is not None:
            out[REPLICA_LAUNCH_VAR] = json.dumps(dict(self.replica_launch))
        return out

    @classmethod
    def given(cls, services: Services | None) -> Services:
        """A stage's context: `services` where the caller passed one, else its process's environment's (a stage
        function called without a context, by a test or a script, finds them where a stage process does)."""
        return services if services is not None else cls.from_environment()

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Services:
        """The services the flow gave this process (read where a stage process starts its stage; a stage called
        as a function without a context reads them here too)."""
        env = os.environ if env is None else env
        launch = env.get(REPLICA_LAUNCH_VAR)
        return cls(env.get(ENV_URL_VAR) or None, env.get(ENV_TOKEN_VAR, ""),
                   json.loads(env.get(JUDGES_VAR) or "{}"), env.get(JUDGE_TOKEN_VAR) or None,
                   json.loads(launch) if launch else None)
