"""Where a stage's rollouts come from: one source of three, chosen once from the config (`source_of`).

    Prompts        one completion per prompt (tasks/engines/sampling.py: sample_rollouts)
    Environments   env.factory: multi-turn episodes against environments (episodes.py: run_episodes)
    Agents         env.agent: an agent's episodes through an endpoint serving the policy (agents.py: run_agents)

Each has `check` (preflight, with the data's splits, the model's path and tokenizer: what it needs, one line and exit
2 when it is not there), `run` (generate and evaluate: the rollouts and what sampling them took), `streamed`
(generate.streaming's group source), `require_some` (a stage whose every episode failed stops) and `metrics`
(generate's source-specific ones); the stages and the preflight call them without asking which source runs.
More: docs/internals.md (tasks/envs/runtime/sources.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Rollout, Sampled, SamplingParams, SamplingSession
    from tasks.core.placement import Services


class Prompts:
    """One completion per prompt: the rollout is the completion."""

    name: ClassVar[str] = "prompts"

    def check(self, cfg: Config, datasets: list, model_path: str, tokenizer) -> None:
        """Nothing beyond the data and the model, which the preflight checks for every source."""

    def run(self, cfg: Config, session: SamplingSession, ds, rows: list[int], params: SamplingParams,
            policy: str, services: Services | None = None) -> tuple[list[Rollout], Sampled]:
        from tasks.engines.sampling import sample_rollouts

        return sample_rollouts(cfg, session, ds, rows, params)

    def streamed(self, services: Services | None = None):
        """generate.streaming's group source (tasks/engines/streaming.py): a group, its prompt's rows."""
        from tasks.engines.streaming import PromptGroups

        return PromptGroups

    def metrics(self, cfg: Config, records: list[Rollout], services: Services | None = None) -> dict[str, float]:
        return {}

    def require_some(self, cfg: Config, records: list[Rollout], what: str) -> None:
        """A completion never fails as a whole: nothing to require."""


class Environments:
    """env.factory: each rollout a multi-turn episode, the environments here (env.isolation) or on the
    environment server (env.where: local, sky or a URL; the stage's context names the flow's)."""

    name: ClassVar[str] = "env.factory"

    def check(self, cfg: Config, datasets: list, model_path: str, tokenizer) -> None:
        """The factory imports and builds one environment with env.kwargs where it runs on this machine (a dict of
        factories by name: each row names one, and each is built with its first row), in a process of its own
        where the episodes' environments run in theirs (env.isolation: process, probe.py); a server
        of your own (env.where a URL) answers as an rlflow environment server. (An environment server on sky
        checks its own factory as it starts.)"""
        from tasks.core.placement import placement_of
        from tasks.envs.runtime.probe import check_in_process
        from tasks.envs.runtime.protocol import check_here, require_env_server

        env = placement_of(cfg).env
        if env in ("stage", "local") and cfg.env.isolation == "process":
            check_in_process(cfg, datasets)     # (as below, in a process of its own: as the episodes' will run)
        elif env in ("stage", "local"):
            check_here(cfg, datasets)   # one built with env.kwargs, adapter, tools (the server checks its own too)
        elif env == "yours":
            require_env_server(cfg.env.url)    # an rlflow environment server (its /health's shape)

    def run(self, cfg: Config, session: SamplingSession, ds, rows: list[int], params: SamplingParams,
            policy: str, services: Services | None = None) -> tuple[list[Rollout], Sampled]:
        from tasks.envs.runtime.episodes import run_episodes

        return run_episodes(cfg, {r: ds[r] for r in set(rows)}, rows, session, params, services)

    def streamed(self, services: Services | None = None):
        """generate.streaming's group source: each turn a row (tasks/envs/runtime/streamed.py)."""
        from tasks.envs.runtime.streamed import StreamedEpisodes

        return StreamedEpisodes.given(services)

    def metrics(self, cfg: Config, records: list[Rollout], services: Services | None = None) -> dict[str, float]:
        """env/*, and env/pool_* where the environments are a pool's (the stage's episodes, or an iteration's
        streamed groups: each record says which server ran it)."""
        from tasks.core.placement import placement_of
        from tasks.envs.runtime.episodes import episode_metrics, pool_metrics
        from tasks.envs.runtime.server import server_of

        pool = pool_metrics(server_of(cfg, services), records) if placement_of(cfg).env_remote() else {}
        return {**episode_metrics(records), **pool}

    def require_some(self, cfg: Config, records: list[Rollout], what: str) -> None:
        """Stop a stage whose every episode failed (episodes.py: require_some_episode)."""
        from tasks.envs.runtime.episodes import require_some_episode

        require_some_episode(cfg, records, what)


class Agents:
    """env.agent: an agent drives each episode, calling the policy through the stage's OpenAI-compatible
    endpoint."""

    name: ClassVar[str] = "env.agent"

    def check(self, cfg: Config, datasets: list, model_path: str, tokenizer) -> None:
        from tasks.core.errors import UserError
        from tasks.envs.runtime.agents import agent_of

        agent_of(cfg)                   # env.agent cannot be imported or called so: one line, exit 2
        if not tokenizer.chat_template:
            raise UserError(f"env.agent: model.name_or_path {model_path}: its tokenizer has no chat template, which "
                            "the agents' endpoint renders their chat calls with")

    def run(self, cfg: Config, session: SamplingSession, ds, rows: list[int], params: SamplingParams,
            policy: str, services: Services | None = None) -> tuple[list[Rollout], Sampled]:
        from tasks.envs.runtime.agents import run_agents

        return run_agents(cfg, {r: ds[r] for r in set(rows)}, rows, session, params, policy)

    def streamed(self, services: Services | None = None):
        """generate.streaming's group source: each call a row (tasks/envs/runtime/streamed.py)."""
        from tasks.envs.runtime.streamed import StreamedAgents

        return StreamedAgents.given(services)

    def metrics(self, cfg: Config, records: list[Rollout], services: Services | None = None) -> dict[str, float]:
        from tasks.envs.runtime.agents import agent_metrics
        from tasks.envs.runtime.episodes import episode_metrics

        return {**episode_metrics(records), **agent_metrics(records)}

    require_some = Environments.require_some


def source_of(cfg: Config) -> Prompts | Environments | Agents:
    """The source the config names: env.agent, else env.factory, else the prompts."""
    if cfg.env.agent:
        return Agents()
    if cfg.env.factory:
        return Environments()
    return Prompts()
