"""The config section of scoring rollouts: `reward` (the reward functions and their weights, the sandbox that
runs model-written code, reward models and LLM judges, DAPO's soft overlong punishment).

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_reward.py): the checks this section makes.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config_base import HOW_NOT_WHAT, SINCE_DEFAULT, Section, ServedSection, plain_json, without_effect
from tasks.core.errors import redact


class RewardFunction(Section):
    """One reward function `module:function`, called as TRL calls them (every argument by keyword)."""

    fn: str = Field(..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="Import path module:function.")
    weight: float = Field(1.0, ge=-1e6, le=1e6,
                          description="Weight in the combined reward (0: scored and logged, not paid: "
                          "e.g. a format check that eval.format_reward reports).")
    kwargs: dict[str, Any] = Field({}, description="Extra keyword arguments for this function (like "
                                   "functools.partial), e.g. {mode: all} for the code reward.")


    @field_validator("kwargs")
    @classmethod
    def _plain(cls, v):
        return plain_json(v)


class SandboxConfig(Section):
    """Running model-written code for code rewards (tasks/scoring/sandbox.py; threat model in docs/sandbox.md)."""

    isolation: Literal["auto", "bubblewrap", "rlimits"] = Field(
        "auto", description="auto: bubblewrap namespaces when they work here, else rlimits with a warning; "
                            "bubblewrap: required (an error if unusable); rlimits: limits, empty env, private dir "
                            "only.")
    bwrap: str = Field("bwrap", description="The bubblewrap binary: a name on PATH or a path.")
    python: str | None = Field(None, description="Interpreter that runs the code; None = /usr/bin/python3 when it "
                               "exists, else this Python. It must be readable by an unprivileged user.")
    timeout_seconds: float = Field(10.0, gt=0, le=600, description="Wall clock per completion, all its tests "
                                   "together (s); then everything it started is killed.")
    cpu_seconds: int = Field(10, ge=1, le=600,
                             description="CPU time per test process, all its threads (RLIMIT_CPU, s).")
    memory_mb: int = Field(1024, ge=64, le=65536, description="Address space per process (RLIMIT_AS, MiB).")
    file_size_mb: int = Field(16, ge=0, le=65536, description="Largest file the code may write (RLIMIT_FSIZE, MiB).")
    max_processes: int = Field(32, ge=1, le=4096, description="Processes + threads the code may have at once "
                               "(RLIMIT_NPROC).")
    max_open_files: int = Field(64, ge=8, le=65536, description="Open file descriptors per process (RLIMIT_NOFILE).")
    max_output_kb: int = Field(256, ge=1, le=65536, description="stdout (and stderr) kept per test (KiB); a test "
                               "that writes more is killed (output limit).")
    tmpfs_mb: int = Field(64, ge=1, le=65536, description="Size of the private /tmp, the only writable place "
                          "(bubblewrap; MiB).")
    workers: int = Field(0, ge=0, le=256, description="Sandboxes run in parallel; 0 = os.cpu_count().")
    cpus: float = Field(1.0, ge=0, le=256, json_schema_extra=SINCE_DEFAULT,
                        description="CPU quota of each sandbox, all its processes together "
                        "(its cgroup's cpu.max / cfs quota); 0 = no quota.")
    cgroup: Literal["auto", "required", "off"] = Field(
        "auto", json_schema_extra=SINCE_DEFAULT,
        description="A cgroup per sandbox: one memory limit for all its processes, kernel memory and tmpfs "
        "included (memory_mb + 2 x tmpfs_mb + 64 MiB), pids.max, the cpus quota, and killing by cgroup. "
        "auto: where the host allows (root, or a delegated cgroup v2), else a warning; required: an error "
        "where it does not; off: none.")
    uid_range: tuple[int, int] = Field(
        (1_900_000_000, 65_536), description="As root, each sandbox slot runs under a uid of its own from "
        "[first, first + count), claimed with a lock file (/run/lock/rlflow-sandbox-uids) for the process's "
        "life: never shared by two processes. The default lies above the subordinate-uid ranges of rootless "
        "containers (/etc/subuid, from 100000) and systemd's container ranges, below 2^31.")

    @field_validator("uid_range")
    @classmethod
    def _uid_range(cls, v: tuple[int, int]) -> tuple[int, int]:
        first, count = v
        if first < 65_536 or count < 256 or first + count > 2**31 - 1:
            raise ValueError("expected [first, count] with first >= 65536, count >= 256 (one uid per worker) and "
                             "first + count <= 2147483647")
        return v


class RewardModel(ServedSection):
    """A reward from a model (tasks/scoring/judges.py; docs/reward-models.md): a scoring model or an LLM judge,
    combined with the functions by weight and logged as reward/<name>/... like them."""

    OLD_URL_KEY = ("reward.models[]", "url")

    name: str = Field(..., pattern=r"^[A-Za-z_][\w-]{0,63}$", description="Names its scores (reward/<name>/...), "
                      "as a function's name does; unique among functions and models.")
    kind: Literal["classifier", "verdict", "judge"] = Field(
        ..., description="classifier: an AutoModelForSequenceClassification; the prompt and completion (through "
        "its chat template when it has one) score as `label`'s logit (or probability). verdict: a causal LM asked "
        "`template`; the score is P(first verdict token) / P(both verdict tokens) at its first answer token. "
        "judge: a causal LM asked `template`, its answer read by `parser` (mode pointwise, pairwise or group).")
    model: str = Field(..., min_length=1, description="The model: a local folder, a .gguf file, builtin:NAME, a hub "
                       "id, a store URI, or models:/<registered name>/<version> (MLflow; a number, never latest or "
                       "an alias). At a URL (where): the served model's name.")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="The pin of a model rlflow loads: the "
                               "sha256 of its weights file (a .gguf, a model.safetensors), or for sharded weights "
                               "of the lines '<file> <sha256>' of each, sorted. Required unless `model` is a "
                               "models:/<name>/<version> (the version pins it) or served at a URL (where).")
    weight: float = Field(1.0, ge=-1e6, le=1e6, description="Weight in the combined reward.")
    mode: Literal["pointwise", "pairwise", "group"] = Field(
        "pointwise", description="judge: pointwise: one answer per completion; pairwise: each completion against "
        "the next of its prompt's group, both orders over the group (score = share of its comparisons won, a tie "
        "half); group: the whole group in one request, one score each (as ART's RULER ranks trajectories).")
    template: str | None = Field(None, description="verdict, judge: the judge's user message, a Python format "
                                 "string. Fields: {prompt}, {completion} (pointwise), {completion_a} / "
                                 "{completion_b} (pairwise), {completions} (group: numbered) and {n}, and any "
                                 "dataset column (a column named like one of those fields is shadowed: "
                                 "{completion} is the policy's). Literal braces doubled.")
    system: str | None = Field(None, description="verdict, judge: a system message before the template's.")
    parser: str = Field("auto", description="judge: how an answer becomes a score. auto: the mode's built-in "
                        "parser: pointwise 'number' (the last 'Score: x', else the last number; '8/10' reads 8), "
                        "pairwise 'choice' (the last [[A]], 'Answer: A' or 'A is better', else the one capital A or "
                        "B named, or 'tie'), group 'scores' (the last JSON list of n numbers, or lines 'k: x' for "
                        "k = 1..n), each also named as such; or module:function taking "
                        "(answer, n) and returning a float (pointwise), 'A' | 'B' | 'tie' (pairwise) or n floats "
                        "(group). An answer that does not parse is an error (the score is missing), not a zero.")
    scale: tuple[float, float] | None = Field(None, description="judge pointwise / group (pairwise: no effect): "
                                              "[low, high] of the "
                                              "judge's scale; scores map to [0, 1] and an answer outside it is an "
                                              "error.")
    verdict_tokens: tuple[str, str] = Field(("Yes", "No"), description="verdict: the answer tokens for a good "
                                            "and a bad completion (each must be one token; matched with spaces "
                                            "stripped).")
    label: int = Field(0, ge=0, le=1_000_000,
                       description="classifier: the output whose value is the score (0 for a one-logit "
                       "reward model).")
    score: Literal["logit", "probability"] = Field("logit", description="classifier: the label's logit (reward "
                                                   "models) or its softmax probability (sigmoid for one logit).")
    max_tokens: int = Field(64, ge=1, le=8192, description="judge: tokens the judge may answer with.")
    max_length: int = Field(2048, ge=16, le=10_000_000,
                            description="Prompt tokens a request may have; a longer one loses its "
                            "middle (its first 8 tokens and its end kept; counted in reward/<name>/truncated).")
    where: str = Field(
        "stage", json_schema_extra=HOW_NOT_WHAT,
        description="Where it is served. stage: loaded in the reward (and evaluate) stage's process; local: a judge "
        "server (python -m tasks.scoring.judge_server) the flow starts on its machine, once for the run; sky: one on "
        "a spot cluster of its own (sky/judge.yaml, launcher.accelerators.judge): the flow checks those before each "
        "stage and starts them again when they stopped answering; an http(s):// URL: an OpenAI-compatible server "
        "you run (vLLM, SGLang, a provider): /v1/chat/completions for judge and verdict, /classify for a "
        "classifier, and rlflow serves nothing. (url, before: read as where.)")
    engine: Literal["hf", "vllm"] = Field("hf", json_schema_extra=HOW_NOT_WHAT,
                                          description="where local | sky: the judge server's engine: hf "
                                          "(transformers; CPU or GPU) or vllm (vLLM in the vLLM environment: "
                                          "generate.vllm_python, .venv-vllm).")
    port: int = Field(8350, ge=1, le=65535, json_schema_extra=HOW_NOT_WHAT,
                      description="where: sky: the judge server's port on its cluster.")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", json_schema_extra=HOW_NOT_WHAT,
                                    description="where a URL: the environment variable that holds its API key (the key "
                                    "itself never goes in a config).")
    batch_size: int = Field(16, ge=1, le=4096, json_schema_extra=HOW_NOT_WHAT,
                            description="Requests in flight at once; a server batches what arrives together "
                            "(the hf engine up to this many per forward pass).")
    timeout_seconds: float = Field(120.0, gt=0, le=7 * 86400, json_schema_extra=HOW_NOT_WHAT,
                                   description="Per try of a request, its whole answer (a server that drips it "
                                   "is cut off); a try that passes it is retried, then an error.")
    retries: int = Field(2, ge=0, le=20, json_schema_extra=HOW_NOT_WHAT,
                         description="Retries of a request that failed in transport (refused, reset, 408, 409, "
                         "429, 5xx, timeout), each after the server's Retry-After (0-60 s) or a back-off of 0.5 s, "
                         "doubling.")

    @field_validator("scale")
    @classmethod
    def _scale_ordered(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError("expected [low, high] with low below high (scores map to [0, 1] over it)")
        return v

    @field_validator("verdict_tokens")
    @classmethod
    def _two_verdicts(cls, v):
        # (an answer's tokens are matched with their spaces stripped: " Yes" and "Yes" are one verdict)
        if not v[0].strip() or not v[1].strip():
            raise ValueError("an empty verdict token (or only spaces): expected two tokens, such as Yes and No")
        if v[0].strip() == v[1].strip():
            raise ValueError(f"the good and the bad verdict are the same token ({v[0].strip()!r}, spaces aside): "
                             f"expected two")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _a_name_not_a_key(cls, v: str | None) -> str | None:
        if v is not None and redact(v) != v:
            raise ValueError("expected the name of an environment variable that holds the key (e.g. "
                             "JUDGE_API_KEY), not what looks like a key itself: put the key in a variable "
                             "and name the variable here")
        return v

    @field_validator("template")
    @classmethod
    def _plain_fields(cls, v: str | None) -> str | None:
        """Its fields are filled with text (n with the group's size): a field's attribute or index, or a format
        spec on text (`{completion:d}`, a width of gigabytes), would fail or mislead at the reward stage."""
        try:
            parsed = list(string.Formatter().parse(v or ""))
        except ValueError:
            return v                    # (not a format string: tasks/scoring/judges.py says so, with its fix)
        for _, field, fmt, conversion in parsed:
            if field is None:
                continue
            name = field.split(".")[0].split("[")[0]
            said = "{" + field + (f"!{conversion}" if conversion else "") + (f":{fmt}" if fmt else "") + "}"
            if field != name or (fmt and name != "n"):
                raise ValueError(f"field {said}: expected a plain {{{name}}} (filled with text: no attribute, index "
                                 f"or format spec)")
            try:
                said.format(**{name: 1 if name == "n" else "text"})
            except Exception as e:  # noqa: BLE001 - the field's own spec or conversion: one line
                raise ValueError(f"field {said}: {e}") from None
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind != "classifier" and not self.template:
            raise ValueError(f"template: a {self.kind} needs a template (the judge's user message)")
        if self.kind == "classifier" and self.template:
            raise ValueError("template: a classifier scores the prompt and completion themselves; remove template")
        if self.kind != "judge" and self.mode != "pointwise":
            raise ValueError(f"mode: {self.mode} is for kind: judge")
        # (a warning, not a refusal: a stored run whose config has one still resumes; max_tokens is every kind's:
        # a vLLM judge server's max_model_len counts it)
        without_effect([(self, f"reward.models ({self.name})", key, self.kind in kinds,
                         f"a {self.kind} does not read it (a setting of kind {' or '.join(kinds)})")
                        for key, kinds in (("verdict_tokens", ("verdict",)), ("label", ("classifier",)),
                                           ("score", ("classifier",)), ("scale", ("judge",)),
                                           ("system", ("verdict", "judge")))])
        without_effect([(self, f"reward.models ({self.name})", "scale", self.kind != "judge" or self.mode != "pairwise",
                         "a pairwise judge's answers are A, B or tie, its score the share of comparisons won")])
        if self.url is None and self.api_key_env is not None:
            raise ValueError("api_key_env: only with where a URL, a server of yours (rlflow's own servers use the "
                             "run's token)")
        if self.url is None and self.sha256 is None and self.model.startswith(("/", "./", "../", "~")) and \
                not Path(self.model).expanduser().exists():       # (said before the pin that cannot be made)
            raise ValueError(f"model: {self.model}: no such file or folder (a judge's weights: a file or folder "
                             f"here, a builtin: name, a hub id or models:/<name>/<version>)")
        if self.url is None and self.sha256 is None and not self.model.startswith("models:/"):
            raise ValueError(f"sha256: {self.model} must be pinned: its weights file's sha256 (rlflow prints it "
                             f"when it is missing: run `python -m tasks.scoring.judges pin {self.model}`), or "
                             f"use a registered MLflow version (models:/<name>/<version>)")
        if self.url is not None and (self.model == "latest" or self.model.endswith((":latest", "-latest"))):
            raise ValueError(f"model: {self.model} moves; name a fixed model version")
        return self


class OverlongConfig(Section):
    """DAPO's soft overlong punishment: a completion of L tokens, with limit L_max (generate.max_completion_length,
    or env.max_tokens for episodes), gets -penalty * (L - (L_max - buffer)) / buffer when it reaches into the last
    `buffer` tokens before the limit (so -penalty at the limit), 0 before; logged as reward/overlong/*, apart
    from the task's rewards (tasks/scoring/shaping.py)."""

    buffer: int = Field(..., ge=1, le=10_000_000, description="Tokens before the limit where the punishment grows.")
    penalty: float = Field(1.0, gt=0, le=1000, description="The punishment at the limit.")


class RewardConfig(Section):
    """Scoring completions."""

    functions: list[RewardFunction] = Field([], description="Reward functions and their weights (at least one, "
                                            "unless env.factory is set: the environment's return is then a reward).")
    aggregate: Literal["sum", "mean"] = Field("sum", description="Combine weighted scores by sum (TRL) or mean "
                                              "over the functions that scored the completion.")
    timeout_seconds: float = Field(300.0, gt=0, le=7 * 86400,
                                   description="Per function and batch: a function still running "
                                   "after this is killed (it runs in a worker process) and its scores are missing.")
    strict: bool = Field(False, description="A function that raises, hangs, returns the wrong count or a NaN fails "
                         "the stage (exit 2). False: its scores for that batch are missing (advantage 0, as in "
                         "TRL) and the error is counted in reward/<fn>/errors.")
    sandbox: SandboxConfig = Field(SandboxConfig(), description="Isolation and limits for code rewards.")
    models: list[RewardModel] = Field([], json_schema_extra=SINCE_DEFAULT,
                                      description="Rewards from models: reward models and LLM judges "
                                      "(docs/reward-models.md), beside the functions.")
    overlong: OverlongConfig | None = Field(None, json_schema_extra=SINCE_DEFAULT,
                                            description="DAPO's soft overlong punishment, added to the reward "
                                            "(None: none; train.mask_truncated_completions drops them instead).")
