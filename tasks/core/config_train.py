"""The config section of the update: `train` (the engine, where the trainer lives, the policy loss and its
off-policy correction, LoRA, DeepSpeed's settings) and `train.learner`, the settings of train.algorithm's
learner (grpo, ppo, vtrace_awr: one model each, a union tagged by the algorithm).

Learner settings written flat in `train` (the shape before issue 28) are still read: `_migrate_train` moves
them into train.learner with a warning line (TrainConfig calls it, and load_config before the overrides).
Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_train.py): the learner union and the train fingerprint's shape.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from tasks.core.config_base import HOW_NOT_WHAT, SINCE_DEFAULT, Section, moved, warn, without_effect
from tasks.core.errors import UserError

# ------------------------------------------------------------------------------------------------ learners
# Each learner's own settings (tasks/algorithms/learners/), a discriminated union tagged by train.algorithm: the
# tag is filled in from train.algorithm, so a config names the algorithm once. They sat flat in `train` before
# (train.gamma ...): those keys are still read, moved here with one warning line (LEARNER_KEYS, _migrate_train).


class LearnerConfig(Section):
    """What every learner's settings have."""

    value_model: ClassVar[bool] = False       # the trainer holds a value model beside the policy (engines/critic.py)
    implementation: ClassVar[str] = ""        # "module:Class" of the learner these settings are for (registry.py)

    def offline(self) -> list[str]:
        """Store keys of scored rollouts from elsewhere that every update adds (off-line data)."""
        return []


class SurrogateConfig(LearnerConfig):
    """What the learners with TRL's clipped surrogates share (grpo, ppo): the objective and its clip, the KL term's
    bias correction (tasks/algorithms/loss.py). In `train` before issue 41: still read there, with a warning."""

    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"] = Field(
        "dapo", description="Objective and aggregation, as TRL defines them (see tasks/algorithms/loss.py).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance weight per token, or per sequence (GSPO).")
    epsilon: float = Field(0.2, gt=0, le=1e6, description="Lower clip range of the importance ratio.")
    epsilon_high: float | None = Field(None, gt=0, le=1e6,
                                       description="Upper clip range; None = epsilon (TRL's fallback), "
                                       "or 5.0 for cispo, where it caps the weight itself.")
    use_bias_correction_kl: bool = Field(True, description="Multiply the KL term (train.beta) by the importance "
                                         "weight (TRL's default since DeepSeek-V3.2: an unbiased reverse-KL "
                                         "gradient).")
    delta: float | None = Field(None, gt=1, le=1e6,
                                description="Two-sided clipping: cap the unclipped weight at delta.")
    sapo_temperature_pos: float = Field(1.0, gt=0, le=1e6,
                                        description="sapo: gate temperature for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, le=1e6,
                                        description="sapo: gate temperature for non-positive advantages.")


# The surrogate's settings as they were fingerprinted in `train`, with every algorithm (issue 41 moved them into
# the learners that read them): a learner without them shows their defaults there, so its stored runs resume.
SURROGATE_DEFAULTS = {name: f.default for name, f in SurrogateConfig.model_fields.items()}


class GrpoConfig(SurrogateConfig):
    """grpo: advantages from the rewards alone (tasks/algorithms/learners/grpo.py)."""

    implementation: ClassVar[str] = "tasks.algorithms.learners.grpo:Grpo"

    algorithm: Literal["grpo"] = Field("grpo", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                       description="(train.algorithm, filled in)")
    advantage: Literal["group", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "group", json_schema_extra=SINCE_DEFAULT,
        description="Advantage estimator (tasks/algorithms/advantage.py): group-relative (GRPO), RLOO's leave-one-out "
        "baseline, REINFORCE++ (batch-whitened rewards) or REINFORCE++-baseline (group mean "
        "removed, then batch-whitened).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="advantage: group only: the "
                                                              "std normalisation.")


class ValueLearnerConfig(LearnerConfig):
    """What the learners with a value model share (ppo, vtrace_awr)."""

    value_model: ClassVar[bool] = True
    critic: Literal["head", "separate"] = Field(
        "head", json_schema_extra=SINCE_DEFAULT,
        description="head: a value head on the policy's own last hidden state (one forward for both); "
        "separate: a value model of its own (the base model's trunk and a head), trained beside the policy.")
    gamma: float = Field(1.0, ge=0, le=1, json_schema_extra=SINCE_DEFAULT, description="The discount (GAE's, "
                         "V-trace's).")
    lam: float = Field(0.95, ge=0, le=1, json_schema_extra=SINCE_DEFAULT, description="λ of GAE, or of V-trace's "
                       "traces.")
    vf_coef: float = Field(0.5, ge=0, le=1e6, json_schema_extra=SINCE_DEFAULT, description="The value loss's weight.")
    critic_lr: float | None = Field(None, gt=0, le=1.0, json_schema_extra=SINCE_DEFAULT,
                                    description="The critic's learning rate (None: train.lr).")


class PpoConfig(ValueLearnerConfig, SurrogateConfig):
    """ppo: a value model and GAE's per-token advantages (tasks/algorithms/learners/ppo.py)."""

    implementation: ClassVar[str] = "tasks.algorithms.learners.ppo:Ppo"

    algorithm: Literal["ppo"] = Field("ppo", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                      description="(train.algorithm, filled in)")
    value_clip: float | None = Field(0.2, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT,
                                     description="Clip of the value prediction around the old one (None: unclipped).")
    critic_warmup: int = Field(0, ge=0, le=1_000_000, json_schema_extra=SINCE_DEFAULT,
                               description="The first N iterations train the critic alone; the policy is "
                               "frozen (a value head learns on detached hidden states).")
    kl_in_reward: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                               description="The KL to the reference (train.beta) is a per-token penalty in the "
                               "reward, β·(log π_old - log π_ref), instead of a loss term.")


class VtraceAwrConfig(ValueLearnerConfig):
    """vtrace_awr: V-trace targets, AWR and a learned KL constraint (tasks/algorithms/learners/vtrace_awr.py)."""

    implementation: ClassVar[str] = "tasks.algorithms.learners.vtrace_awr:VtraceAwr"

    algorithm: Literal["vtrace_awr"] = Field("vtrace_awr", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                             description="(train.algorithm, filled in)")
    rho_bar: float = Field(1.0, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT, description="ρ̄, the truncation of the "
                           "importance weight in V-trace's TD errors and advantages.")
    c_bar: float = Field(1.0, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT,
                         description="c̄, the truncation of the trace "
                         "coefficients (times lam).")
    awr_temperature: float = Field(1.0, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT, description="τ in the weights "
                                   "exp(Â/τ) of the whitened advantages.")
    awr_max_weight: float = Field(20.0, gt=1, le=1e12, json_schema_extra=SINCE_DEFAULT, description="The weights' cap.")
    kl_target: float = Field(0.01, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT, description="ε, the soft target of "
                             "KL(behaviour ‖ policy) per token that the Lagrange multiplier holds.")
    kl_multiplier_init: float = Field(1.0, gt=0, le=1e6, json_schema_extra=SINCE_DEFAULT,
                                      description="The multiplier's "
                                      "initial value (η = softplus of a learned parameter).")
    value_epochs: int = Field(2, ge=0, le=1000, json_schema_extra=SINCE_DEFAULT, description="Value pre-training "
                              "steps each iteration on the detached hidden states of one forward (the head alone "
                              "learns: no extra full forward per epoch).")
    replay_iterations: int = Field(2, ge=1, le=1000, json_schema_extra=SINCE_DEFAULT, description="Train on the "
                                   "rollouts of the last K iterations (this one included): off-policy data, "
                                   "corrected by V-trace's truncated importance weights.")
    offline_rollouts: list[str] = Field(
        [], json_schema_extra=SINCE_DEFAULT,
        description="Scored rollouts from elsewhere in the store (keys of rewards folders, e.g. another run's "
        "<run>/iter-000003/rewards), added to every update: off-line data, its behaviour logprobs its own "
        "generator's, corrected by V-trace's truncated weights.")

    @field_validator("offline_rollouts")
    @classmethod
    def _store_keys(cls, v: list[str]) -> list[str]:
        for key in v:
            if "://" in key or key.startswith("/") or any(p in ("", ".", "..") for p in key.rstrip("/").split("/")):
                raise ValueError(f"{key!r}: expected a key in this run's store (<run>/iter-000003/rewards), not a "
                                 f"URI, an absolute path or one with an empty, '.' or '..' part")
        return v

    def offline(self) -> list[str]:
        return self.offline_rollouts


# train.algorithm -> its learner's settings (whose `implementation` names the learner): the built-ins, and any
# that register_learner adds, so train.algorithm is any registered name.
LEARNER_CONFIGS: dict[str, type[LearnerConfig]] = {"grpo": GrpoConfig, "ppo": PpoConfig, "vtrace_awr": VtraceAwrConfig}
BUILT_IN_LEARNERS = tuple(LEARNER_CONFIGS)


def register_learner(settings: type[LearnerConfig]) -> None:
    """Make a learner written elsewhere a train.algorithm: `settings` is its section of the config, a LearnerConfig
    whose `algorithm` tag defaults to its name and whose `implementation` is the learner's "module:Class" (rows,
    stats, trains, signal, prepare, loss, metrics: as tasks/algorithms/learners/grpo.py's). Configs naming it load
    in the processes that registered it; its trainer imports the learner by that name."""
    tag = settings.model_fields.get("algorithm")
    if tag is None or not isinstance(tag.default, str) or ":" not in settings.implementation:
        raise ValueError(f"register_learner: {settings.__name__} needs an `algorithm` tag (its name, the default) "
                         "and an `implementation` (\"module:Class\")")
    LEARNER_CONFIGS[tag.default] = settings


# The keys that moved from `train` into `train.learner` (issues 28 and 41): the built-ins' settings but the tag.
LEARNER_KEYS = frozenset(name for c in LEARNER_CONFIGS.values() for name in c.model_fields if name != "algorithm")
# `learner` enters the train fingerprint flat, as its keys did before they moved, so stored runs resume.
FLAT_IN_FINGERPRINT = {"fingerprint": "flat"}


def _fits(settings: type[LearnerConfig], key: str, value: Any) -> None:
    """Another learner's setting, ignored under this algorithm, still checked as its own learner checks it: a
    value no learner takes (`-o train.gamma=abc` under grpo) is a mistake, not a warning."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    field = settings.model_fields[key]
    try:
        kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        TypeAdapter(kind).validate_python(value)
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"learner.{key}: {msg[:1].lower()}{msg[1:]}, got {value!r} (a setting of "
                         f"{settings.model_fields['algorithm'].default}, ignored here)") from None


def _migrate_train(train: Any, where: str = "train") -> Any:
    """A `train` mapping with the learner's settings flat in it (the shape before issue 28): them moved into
    train.learner, each named once on stderr. A key in both places is an error (which one would win?)."""
    if not isinstance(train, dict) or not LEARNER_KEYS & train.keys():
        return train
    train = dict(train)
    learner = train.get("learner")
    learner = dict(learner) if isinstance(learner, dict) else {} if learner is None else learner
    if not isinstance(learner, dict):
        return train                    # (a model instance: validation says what is wrong)
    for key in [k for k in train if k in LEARNER_KEYS]:
        if key in learner:
            raise UserError(f"config: {where}.{key} and {where}.learner.{key} are both set; keep "
                            f"{where}.learner.{key}")
        moved(f"{where}.{key}", f"{where}.learner.{key}")
        learner[key] = train.pop(key)
    train["learner"] = learner
    return train


class TrainConfig(Section):
    """The update: the optimiser, the policy loss, and the learner (train.algorithm, train.learner)."""

    # The train fingerprint keeps the flat shape it had before the learners' settings moved into train.learner
    # (FLAT_IN_FINGERPRINT); scale_rewards and the surrogate's settings were fingerprinted always then, with every
    # algorithm, so the learners without them still show their defaults there: stored runs of every learner resume.
    _fingerprint_always: ClassVar[dict] = {"scale_rewards": "group", **SURROGATE_DEFAULTS}

    engine: Literal["torch", "deepspeed"] = Field(
        "torch", description="Training engine: torch (one process, one device) or deepspeed (ZeRO 1-3 over "
                             "several processes, GPUs or nodes; pip install -e '.[deepspeed]').")
    mode: Literal["auto", "process", "resident"] = Field(
        "auto", json_schema_extra=HOW_NOT_WHAT,
        description="process: each train stage run loads the newest full checkpoint and writes a full one; "
                    "resident: one trainer process per run keeps model, optimizer and RNG in memory across "
                    "iterations, writes the policy every iteration and a full checkpoint every checkpoint_every "
                    "iterations (and when the flow ends); a lost trainer resumes exactly by replaying the stored "
                    "iterations after the newest full checkpoint (deepspeed: one resident torchrun group of "
                    "train.num_processes per node, spanning every node of the train cluster (NNODES); losing any "
                    "node ends the group, and the next train stage starts a new one, which replays). auto: "
                    "resident, except inside a torchrun started by hand and with launcher.managed_jobs for a sky "
                    "train stage. Both give the same weights.")
    host: Literal["auto", "caller", "detached"] = Field(
        "auto", json_schema_extra=HOW_NOT_WHAT,
        description="resident: where the trainer lives. caller: in the process that calls the train stage (the "
                    "flow's own with the inline launcher), ending with it: no process to start, no second copy of "
                    "torch in memory. detached: a process of its own on the train machine that outlives the stage "
                    "processes and is found again by later ones. auto: caller when the train stage is a function "
                    "call in a longer-lived process (the inline launcher, Python code) and the engine is torch; "
                    "detached for a stage process of its own (`python -m tasks.train`: the local and sky "
                    "launchers) and for deepspeed (a torchrun group).")
    checkpoint_every: int = Field(10, ge=1, le=1_000_000, json_schema_extra=HOW_NOT_WHAT,
                                  description="resident: a full checkpoint (model + optimizer + RNG + data "
                                  "cursor) every N iterations, written in the background; a resume replays at "
                                  "most N - 1 iterations.")
    idle_timeout: float = Field(7200.0, ge=0, le=7 * 86400, json_schema_extra=HOW_NOT_WHAT,
                                description="resident: a trainer no train stage has used for this many seconds "
                                "writes a full checkpoint and exits (0 = never), so a flow killed before its "
                                "teardown does not leave it holding the machine. A train stage typed by hand that "
                                "starts one gives it 600 s unless this is set (tasks/train.py: HAND_RUN_IDLE).")
    lr: float = Field(1e-6, gt=0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1e6, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    max_grad_norm: float = Field(1.0, gt=0, le=1e12, description="Gradient clipping norm.")
    beta: float = Field(0.0, ge=0, le=1e6,
                        description="KL coefficient against the starting policy (k3 estimator); 0 = none.")
    importance_sampling_correction: bool = Field(
        True, description="Weight the loss by π_old/μ against the generator's behaviour logprobs (truncated IS).")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate", description="Per token or per sequence; truncate caps the weight, mask drops it.")
    importance_sampling_cap: float = Field(3.0, gt=0, le=1e12, description="Cap on the behaviour importance weight.")
    off_policy_loss: Literal["tis", "decoupled"] = Field(
        "tis", description="How the behaviour logprobs (μ: the policy that sampled, run.max_staleness updates "
        "behind) enter the loss. tis: TRL's truncated importance sampling, ρ = π_old/μ by importance_sampling_mode. "
        "decoupled: AReaL's decoupled PPO, the clip against the proximal policy π_old (the trainer's weights before "
        "the update), each token weighted by π_old/μ and dropped where that exceeds importance_sampling_cap "
        "(importance_sampling_mode ignored). Needs importance_sampling_correction.")
    mismatch_kl_warn: float = Field(
        1e-2, gt=0, le=1e6, json_schema_extra=HOW_NOT_WHAT,
        description="The console warns when train/mismatch_kl (the sampler's logprobs against the trainer's, k3 per "
        "token) passes this (prime-rl's CI gate is 1e-2), or jumps above 10x its median so far (and above 1e-4): "
        "a policy that never reached the sampler, an engine that samples other weights. With run.max_staleness "
        "> 0 it also holds the S updates since the sampler's policy: the console then looks at the iterations "
        "whose samples are of the policy trained (generate/staleness 0: iteration 1) only.")
    mask_truncated_completions: bool = Field(False, description="Exclude completions that hit the length limit "
                                             "from the loss.")
    num_iterations: int = Field(1, ge=1, le=1000, description="Optimiser passes over each generated batch (TRL's μ).")
    algorithm: str = Field(
        "grpo", json_schema_extra=SINCE_DEFAULT,
        description="The learner (tasks/algorithms/learners/), its own settings in train.learner. grpo: advantages "
        "from the rewards alone (train.learner.advantage; the GRPO family by train.learner.loss_type). ppo: a value "
        "model (train.learner.critic) and GAE (gamma, lam) give per-token advantages, whitened over the batch; the "
        "policy loss is loss_type's clipped surrogate, plus vf_coef times the clipped value loss. vtrace_awr: V-trace "
        "targets and advantages (rho_bar, c_bar, lam) from the behaviour logprobs, an advantage-weighted "
        "log-likelihood (awr_temperature), a KL to the behaviour policy held near kl_target by a learned Lagrange "
        "multiplier, value pre-training on detached hidden states (value_epochs) and a replay of the last "
        "replay_iterations iterations' rollouts. Both on the torch engine (tasks/algorithms/ppo.py, vtrace.py). "
        "Or a learner of your own, its settings registered by register_learner (this module).")
    learner: SerializeAsAny[LearnerConfig] = Field(
        GrpoConfig(), json_schema_extra=FLAT_IN_FINGERPRINT,
        description="The settings of train.algorithm's learner (one section per learner; the algorithm picks it).")
    lora_r: int = Field(0, ge=0, le=65_536,
                        description="LoRA rank; 0 = full fine-tuning. With LoRA only the adapter is "
                        "trained, checkpointed and published.")
    lora_alpha: int = Field(16, ge=1, le=1_000_000, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_target_modules: list[str] | str = Field("all-linear", description="Modules that get adapters (peft syntax).")
    share_prompts: bool = Field(True, json_schema_extra=SINCE_DEFAULT,
                                description="Run each distinct prompt of a micro-batch once, its keys and values "
                                "shared by its completions (a GRPO group's num_generations), instead of once per "
                                "completion: the same logprobs and gradients up to float rounding, ~3x less work "
                                "for prompts 4x as long as the completions (tasks/algorithms/logprobs.py).")
    gradient_checkpointing: bool = Field(
        False, json_schema_extra=HOW_NOT_WHAT,
        description="Keep only each decoder layer's input through the forward and recompute the layer in the "
                    "backward (transformers' gradient checkpointing, non-reentrant): activation memory ~1/layers for "
                    "~1.3x the compute. For long sequences, such as multi-turn episodes: one 4000-token SmolLM2-135M "
                    "sequence's forward and backward peaks at ~9 GB without it, ~4.6 GB with it. The same weights.")
    micro_batch_size: int = Field(32, ge=1, le=1_000_000,
                                  description="Sequences per forward/backward in each process (gradient "
                                  "accumulation): a memory knob, the update is the whole batch's.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    zero_stage: int = Field(2, ge=1, le=3, description="deepspeed: ZeRO stage; 1 shards the optimizer states over "
                            "the processes, 2 also the gradients, 3 also the weights.")
    num_processes: int = Field(0, ge=0, le=1024, description="deepspeed: worker processes per node that the stage "
                               "starts; 0 = one per visible GPU (1 on CPU). Not used when started by torchrun.")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="deepspeed: bf16 computes in bf16 with fp32 master weights and optimizer states; "
                            "auto = bf16 on CUDA, fp32 on CPU. (The torch engine computes in model.dtype.)")
    offload_optimizer: bool = Field(False, description="deepspeed: keep the optimizer states in CPU memory and step "
                                    "them there (ZeRO-Offload, DeepSpeedCPUAdam; built on first use).")

    @model_validator(mode="before")
    @classmethod
    def _the_algorithms_learner(cls, data: Any) -> Any:
        """train.learner tagged with train.algorithm; settings flat in `train` moved into it (_migrate_train);
        another learner's settings (a config written for ppo, run with algorithm grpo) ignored with a line."""
        if not isinstance(data, dict):
            return data
        data = _migrate_train(data)
        algorithm = data.get("algorithm", "grpo")
        learner = data.get("learner")
        learner = {} if learner is None else learner
        if not isinstance(learner, dict) or not isinstance(algorithm, str) or algorithm not in LEARNER_CONFIGS:
            return data                 # (a model instance, or a bad algorithm: validation says what is wrong)
        learner = dict(learner)
        if learner.setdefault("algorithm", algorithm) != algorithm:
            raise ValueError(f"learner.algorithm: {learner['algorithm']!r} is not train.algorithm "
                             f"({algorithm!r}); leave it out")
        own = LEARNER_CONFIGS[algorithm].model_fields
        for key in [k for k in learner if k not in own and k in LEARNER_KEYS]:
            if key == "offline_rollouts" and learner[key]:
                raise ValueError("offline_rollouts: off-line data needs an off-policy learner: algorithm: vtrace_awr")
            owners = [c for c in LEARNER_CONFIGS.values() if key in c.model_fields]
            others = ", ".join(a for a, c in LEARNER_CONFIGS.items() if key in c.model_fields)
            _fits(owners[0], key, learner[key])         # (ignored here, yet what it would be under its own)
            warn(f"warning: config: train.learner.{key} is a setting of {others}; train.algorithm is "
                 f"{algorithm}: ignored")
            del learner[key]
        return {**data, "learner": learner}

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("expected two numbers in [0, 1)")
        return betas

    @field_validator("algorithm")
    @classmethod
    def _a_registered_learner(cls, algorithm: str) -> str:
        if algorithm not in LEARNER_CONFIGS:
            raise ValueError(f"expected one of {', '.join(LEARNER_CONFIGS)} (a learner of your own: register_learner)")
        return algorithm

    @field_validator("learner", mode="before")
    @classmethod
    def _the_learners_own_settings(cls, learner: Any, info: ValidationInfo) -> Any:
        """train.learner validated as the settings of train.algorithm's learner (a union of whatever is
        registered: its errors keep their place, train.learner.<key>)."""
        settings = LEARNER_CONFIGS.get(info.data.get("algorithm"))
        if settings is None or isinstance(learner, settings):
            return learner              # (no valid algorithm: its own error says so)
        return settings.model_validate(learner)

    @model_validator(mode="after")
    def _settings_without_effect(self):
        """A value the rest of `train` never reads (another loss type's, a KL setting without train.beta, LoRA's
        without a rank, DeepSpeed's under torch, the resident trainer's under mode process): a warning line."""
        lc, clipped = self.learner, ("grpo", "dapo", "bnpo", "dr_grpo")      # tasks/algorithms/loss.py's
        loss, L = getattr(lc, "loss_type", None), "train.learner"
        tis = self.importance_sampling_correction and self.off_policy_loss == "tis"
        without_effect([
            (lc, L, "sapo_temperature_pos", loss == "sapo", f"only loss_type sapo uses it (it is {loss})"),
            (lc, L, "sapo_temperature_neg", loss == "sapo", f"only loss_type sapo uses it (it is {loss})"),
            (lc, L, "delta", loss in clipped, f"the clipped losses ({', '.join(clipped)}) use it, not {loss}"),
            (lc, L, "epsilon", loss not in ("cispo", "sapo"), f"loss_type {loss} does not clip at 1 - epsilon"),
            (lc, L, "epsilon_high", loss != "sapo", "loss_type sapo gates instead of clipping"),
            (lc, L, "scale_rewards", getattr(lc, "advantage", "group") == "group",
             f"only advantage group uses it (it is {getattr(lc, 'advantage', None)})"),
            (lc, L, "use_bias_correction_kl", self.beta > 0, "it weights the KL term, and train.beta is 0"),
            (lc, L, "kl_in_reward", self.beta > 0, "it moves the KL term, and train.beta is 0"),
            *[(self, "train", k, self.lora_r > 0, "train.lora_r is 0 (full fine-tuning)")
              for k in ("lora_alpha", "lora_dropout", "lora_target_modules")],
            (self, "train", "importance_sampling_mode", tis, "train.importance_sampling_correction is false"
             if not self.importance_sampling_correction else "off_policy_loss decoupled drops by the cap alone"),
            (self, "train", "importance_sampling_cap", self.importance_sampling_correction,
             "train.importance_sampling_correction is false"),
            *[(self, "train", k, self.engine == "deepspeed", "train.engine is torch")
              for k in ("zero_stage", "num_processes", "mixed_precision", "offload_optimizer")],
            *[(self, "train", k, self.mode != "process", "train.mode process writes a full checkpoint each "
               "iteration and keeps no trainer") for k in ("checkpoint_every", "idle_timeout", "host")]])
        return self

    @model_validator(mode="after")
    def _engine_supports(self):
        if self.learner.algorithm != self.algorithm:
            raise ValueError(f"learner: the settings of {self.learner.algorithm}, but algorithm is {self.algorithm}")
        if self.off_policy_loss == "decoupled" and not self.importance_sampling_correction:
            raise ValueError("off_policy_loss: decoupled weights by π_old/μ; it needs importance_sampling_correction")
        if self.host == "caller" and self.engine == "deepspeed":
            raise ValueError("host: caller holds the trainer in the calling process; the deepspeed engine needs a "
                             "torchrun group of its own: use host detached (or auto)")
        return self
