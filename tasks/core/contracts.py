"""The contracts, in one place: the records the stages, engines and learners exchange, and the Protocols each
family of implementations keeps. Every implementation imports its contract from here, and this module imports
nothing of theirs, so there are no import cycles (tests/test_layout.py checks that, and the Protocols' methods).

    records       Rollout, SamplingParams / Sample / Sampled, Step, MicroBatch / Forward / Totals
    sampling      SamplingEngine (tasks/engines/hf.py, vllm_offline.py, vllm_server.py) and its SamplingSession
    training      TrainingEngine (tasks/engines/torch_engine.py, deepspeed_engine.py); TrainerHandle
                  (tasks/engines/trainer.py, detached.py); Learner (tasks/algorithms/learners/)
    environments  Environment and EnvironmentHandle (tasks/envs/runtime/isolation.py, server.py)
    store         ArtifactStore (tasks/core/store.py: FileStore, S3Store)

More: docs/internals.md (tasks/core/contracts.py): what each record and Protocol is for, and the factories.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tasks.core.config import Config



# ------------------------------------------------------------------------------------------------- records

@dataclass
class Rollout:
    group: int                  # prompt's position in this iteration's batch; completions of a group share it
    row: int                    # dataset row index
    prompt: Any                 # the prompt as in the dataset (string or chat messages)
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]   # includes the EOS token when the completion stopped on its own
    logprobs: list[float]       # behaviour logprob of each completion token (after temperature)
    truncated: bool             # hit max_completion_length without EOS
    columns: dict[str, Any] = field(default_factory=dict)   # the dataset row's other columns (reward kwargs)
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)     # columns reward functions logged (TRL's log_extra)
    mask: list[int] | None = None         # per completion token: 1 the model's, 0 an observation's (None: all 1)
    turns: list[dict] | None = None       # the messages after the prompt (multi-turn)
    turn_rewards: list[float] | None = None
    env_return: float | None = None
    env_error: str | None = None
    env_state: dict[str, Any] | None = None   # the environment's public attributes when the episode ended
    part: int = 0               # an agent's episode split step-wise: 0 its first sample, k > 0 the k-th after it,
                                # sharing its return and advantage (tasks/envs/runtime/agents.py)
    timings: list[dict] | None = None     # multi-turn: per model turn {"model": s, "env": s}, the batched call
                                          # that made it and the environment's step (for traces: tasks/core/traces.py)
    versions: list[int] | None = None     # per completion token, the policy version that drew it (generate.streaming;
                                          # None: every token the stage's one policy's)
    env_server: str | None = None         # env.servers > 1: the pool's server (its index) that ran the episode
    temperatures: list[float] | None = None   # per completion token, the temperature it was drawn at, and the top_p
    top_ps: list[float] | None = None         # (an agent's call may ask for its own within env.endpoint's bounds;
                                              # None: generate.temperature / generate.top_p for every token)


def content_text(content: Any) -> str:
    """A message's content as text (a prompt's, a turn's, a judge's answer): a string as it is; a list of parts
    (OpenAI's chat `text`, the Responses API's `input_text` / `output_text`) as their text joined, parts without
    text (an image, a refusal) adding nothing; a number as written; anything else "". The one reader of message
    content on the scoring side."""
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p["text"] for p in content
                       if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str)))
    return content if isinstance(content, str) else str(content) if isinstance(content, int | float) else ""


@dataclass
class Scored:
    """What scoring a batch gives, for reward functions and reward models alike."""

    scores: dict[str, list[float | None]] = field(default_factory=dict)   # function or model name -> a score
    #                                                      per completion (None = missing)
    errors: dict[str, str] = field(default_factory=dict)     # function or model name -> what went wrong
    nan: dict[str, int] = field(default_factory=dict)        # function name -> NaN/inf/huge scores made missing
    extra: dict[str, list] = field(default_factory=dict)     # log_extra columns, one value per completion
    metrics: dict[str, float] = field(default_factory=dict)  # log_metric means


@dataclass(frozen=True)
class SamplingParams:
    n: int                  # completions per prompt
    max_new_tokens: int
    temperature: float      # 0: greedy (the most likely token; evaluation's greedy pass@1)
    top_p: float
    seed: int               # the whole request's seed: a rerun samples the same tokens
    top_k: int = 0          # sample among the k most likely tokens (0: all), before top_p


@dataclass(frozen=True)
class Sample:
    """One completion."""

    prompt: int                 # index of its prompt in the request
    completion_ids: list[int]   # includes the EOS token when it stopped on its own
    logprobs: list[float]       # behaviour logprob of each completion token (after temperature / top-p)
    truncated: bool             # hit max_new_tokens without EOS
    versions: list[int] | None = None   # per completion token, the policy version that drew it (None: the
    #                                     session's one; set when a newer policy may interrupt: tasks/engines/hf.py)


@dataclass(frozen=True)
class Sampled:
    samples: list[Sample]       # n per prompt, prompt by prompt
    load_seconds: float         # model load, engine start or weight reload
    sampling_seconds: float     # sampling alone


@dataclass
class Step:
    observation: list[dict]                 # messages the environment answers with (user or tool roles)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class MicroBatch:
    """One forward/backward's worth of completions."""

    ids: torch.Tensor                  # (b, Lp+Lc) long: [left-padded prompt | right-padded completion]
    attention: torch.Tensor            # (b, Lp+Lc) long
    positions: torch.Tensor            # (b, Lp+Lc) long: real tokens counted only, as the generator saw them
    mask: torch.Tensor                 # (b, Lc) float: 1 on completion tokens that enter the loss
    behaviour: torch.Tensor            # (b, Lc) float: the generator's logprob of each token (μ), 0 on padding
    signal: torch.Tensor               # (b,) what the learner made of the rows' rewards before the batch was
                                       # split (Learner.signal: GRPO's advantages, the value learners' rewards)
    rows: int                          # completions in it (0: a weightless micro-batch, see shard_batches)
    advantages: torch.Tensor | None = None     # (b,), or (b, Lc) per token: set by the learner's prepare
    ref: torch.Tensor | None = None    # (b, Lc) the reference policy's logprobs (beta > 0)
    old: torch.Tensor | None = None    # (b, Lc) π_old: the logprobs before this iteration's first step
    own: Any = None                    # the learner's own fields (an instance of its Learner.rows), set by its
                                       # prepare, read by its loss: nothing else reads them
    share_prompts: bool = True             # run each distinct prompt once (train.share_prompts; logprobs.py)
    temperature: torch.Tensor | None = None    # (b, Lc) each token's own temperature, NaN: generate.temperature
    top_p: torch.Tensor | None = None          # (b, Lc) each token's own top_p, NaN: generate.top_p (None: the run's)

    @property
    def width(self) -> int:
        """Lc: completion tokens per row, padding included."""
        return self.mask.shape[1]


@dataclass
class Forward:
    """One micro-batch's forward in a pass, with gradients: what every learner's loss starts from."""

    logp: torch.Tensor                  # (b, Lc) the completion tokens' logprobs under the policy
    entropy: torch.Tensor               # (b, Lc)
    hidden: torch.Tensor | None         # (b, Lc, H) the last hidden states (a value model's input), if asked for


@dataclass
class Totals:
    """The whole batch's counts, over every micro-batch and process: the losses' normalisers."""

    num_tokens: float                   # completion tokens in the loss
    num_sequences: int

# ------------------------------------------------------------------------------------------------ sampling

class SamplingSession(Protocol):
    """One policy held by an engine, sampled from as often as the stage needs, then closed (a context manager:
    `with engine.session(...) as s`). Its `load_seconds` is what opening it took (model load, engine start or
    weight reload); a `sample` reports its own (a reload it needed: another session of the process took the
    model meanwhile, a server restarted)."""

    tokenizer: object = None    # the policy's tokenizer (what the stage encodes prompts and decodes completions with)
    load_seconds: float = 0.0

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams,
               keys: list[str] | None = None) -> Sampled:
        """Sample `params.n` completions of each prompt (token ids). `keys`: each prompt's episode, where the
        prompts are turns of episodes (generate replicas keep an episode on one replica: its prefix cache);
        an engine that has one cache ignores them."""

    def close(self) -> None:
        """Release what the session holds (not what the engine keeps across stages). Never raises."""

    def metrics(self, prefix: str) -> dict[str, float]:
        """What the engine measured for this session beyond each Sampled, as `prefix`/* metrics (generate
        replicas: the router's counts per replica); none by default."""
        return {}

    def __enter__(self) -> SamplingSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SamplingEngine(Protocol):
    """Samples completions from a policy: tasks/engines/hf.py, vllm_offline.py, vllm_server.py."""

    def __init__(self, cfg: Config) -> None: ...

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """One UserError line if this machine cannot run the engine (vllm missing)."""

    def session(self, policy: str, path: str, tokenizer) -> SamplingSession:
        """Open `policy` (its name: `base` or a store key; `path`: its local folder or hub id) for sampling."""

    def stop(self, log=print) -> None:
        """Release what the engine keeps alive across stage runs (server mode: the vLLM server; hf: the resident
        model); the flow calls it at its end. Never raises."""

# ------------------------------------------------------------------------------------------------ training

class TrainingEngine(Protocol):
    """One training process holding the policy, its optimizer and RNG (one of `world_size` processes)."""

    rank: int                       # this process, 0 .. world_size - 1; process 0 writes the checkpoint
    world_size: int
    device: torch.device
    model: torch.nn.Module          # what runs forward (a DeepSpeed engine wraps the module)
    ref_model: torch.nn.Module | None   # the starting weights for the KL term (None: beta 0, or LoRA)
    tokenizer: object
    lora: bool                      # the model is a peft model (the reference = its adapter disabled)
    global_step: int                # optimizer steps so far, over the whole run

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """One UserError line if this machine cannot run the engine (a package missing)."""

    @classmethod
    def open(cls, cfg: Config, store: ArtifactStore, previous: str | None) -> TrainingEngine:
        """The policy, optimizer and RNG from checkpoint `previous` (a store key; None: the base model,
        freshly seeded)."""

    @staticmethod
    def clean(store: ArtifactStore, run: str) -> int:
        """Remove what killed attempts of this engine left in the run's store folder; the lease holder calls
        it. Returns how many folders went."""

    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    critic: torch.nn.Module | None   # ppo, vtrace_awr: the value model (tasks/engines/critic.py), else None

    def step(self) -> float:
        """Clip the accumulated gradient to train.max_grad_norm and step; the norm before clipping."""
    def critic_step(self, loss: torch.Tensor) -> None:
        """Backward `loss` and step the value model alone (the policy untouched)."""
    def sum(self, values: list[float]) -> list[float]: ...
    def max(self, values: list[float]) -> list[float]: ...
    def min(self, values: list[float]) -> list[float]: ...
    def barrier(self) -> None: ...
    def save(self, out: Path, iteration: int) -> dict:
        """Write a full checkpoint's files into `out`: model/ (the policy as publish ships it, publish.dtype),
        the exact weights where those differ, optimizer and RNG state; returns what state.json adds."""
    def save_policy(self, out: Path) -> None:
        """Write the policy alone into folder `out` (what a checkpoint's model/ holds): a lean checkpoint."""
    def loading_whole(self) -> AbstractContextManager[None]:
        """A context where models loaded are whole, not partitioned as the engine's own (ZeRO-3) may be."""
    def snapshot(self, iteration: int) -> Callable[[Path], dict]:
        """Take what a full checkpoint holds now; the returned function writes it into a folder later, on
        another thread, while training goes on (the resident trainer's background checkpoints)."""
    def close(self) -> None: ...


class TrainerHandle(Protocol):
    """What the train stage and the flow hold: the run's trainer, wherever it lives."""

    def train(self, iteration: int, fingerprint: str) -> dict:
        """Train iteration `iteration` on its stored scored rollouts; ckpt-N is committed on return."""
    def preload(self, iteration: int) -> int:
        """Hold the state after `iteration` now (restore and replay ahead of the train request); writes nothing.
        Returns the iteration held."""
    def finish(self, catch_up: bool = False) -> int | None:
        """A full checkpoint of the last iteration trained, then the trainer goes; its iteration, or None when
        there was nothing to finish (`catch_up`: also when the run's newest iteration lacks a full checkpoint,
        one is made by replay)."""
    def close(self) -> None:
        """The stage is done with the handle: a trainer of its own goes; the run's trainer stays for the next."""


class Learner(Protocol):
    """One algorithm's side of an update; made for one iteration by registry.make(cfg, iteration)."""

    uses_hidden: bool        # the passes' forward also returns the last hidden states (a value model's input)
    off_policy: bool         # trains on replayed and off-line rows too (train/rows reports how many)
    reports_kl_ref: bool     # train/kl_ref with train.beta > 0 (ppo's KL in the reward: not a loss term)
    behaviour_weighted: bool     # the loss is weighted by π_old/μ (train.importance_sampling_correction)
    rows: type | None        # its fields on each micro-batch (MicroBatch.own), or None
    stats: type | None       # its statistics (UpdateStats.own: a tasks/algorithms/stats.py LearnerStats), or None
    trains: tuple[str, ...]  # what it trains beside the policy, by name ("critic": tasks/engines/critic.py): the
                             # engines make, optimise, checkpoint and restore it (TrainingEngine.critic)
    # Optional: `inert_at_zero = True` in the learner's own class says a row of advantage 0 has loss 0 with
    # train.beta 0: tasks/algorithms/update.py then skips its backward and calls `loss` under torch.no_grad() on
    # such rows (for the statistics); a learner without it (a subclass too, unless it says so again) trains every row.

    def replay(self, iteration: int) -> list[int]:
        """The earlier iterations whose scored rollouts this update trains on too (loaded by the engines side,
        with the section's off-line ones before them: train.learner.offline())."""

    def signal(self, rewards: torch.Tensor) -> torch.Tensor:
        """What the learner makes of the rows' rewards (N,) (NaN: none) before the batch is split: one value per
        row, carried by MicroBatch.signal (GRPO's advantages need the whole batch's groups)."""

    def prepare(self, engine: TrainingEngine, batches: list[MicroBatch]) -> None:
        """Before the passes, after the fixed logprobs (reference, π_old): each micro-batch's `advantages`, and
        whatever else the loss reads (values, returns)."""

    def loss(self, engine: TrainingEngine, b: MicroBatch, fwd: Forward, totals: Totals, stats: Any,
             first_pass: bool) -> torch.Tensor:
        """The micro-batch's share of the whole batch's loss (its statistics recorded in `stats`)."""

    def metrics(self, stats: Any, metrics: dict[str, float], denom: float) -> None:
        """The learner's own train/* metrics, added to `metrics` (denom: the batch's tokens, at least 1)."""

# -------------------------------------------------------------------------------------------- environments

class Environment(Protocol):
    tools: list[Callable]

    def reset(self, row: dict) -> list[dict]: ...

    def step(self, message: dict) -> Step: ...


class EnvironmentHandle(Protocol):
    """One episode's environment wherever it runs: in this process, in a process of its own (isolation.py) or on
    the environment server (server.py). The episode loop calls every handle alike (from the threads of its
    isolation.Caller, which also runs what an in-process `async def` method returns on its event loop)."""

    tool_schemas: list[dict]         # its tools' JSON schemas, as the prompt declares them
    state: dict | None               # its env_state, once closed (None: killed, or its close failed)

    def reset(self, row: dict) -> Any: ...

    def step(self, message: dict) -> Any: ...

    def close(self, failed: bool = False) -> Any:
        """Keep its state, then close it; after a failed episode (`failed`) an environment in a process of its
        own is killed instead, with no state (it may be hung or gone)."""

    def kill(self) -> None:
        """End it now (a call past its deadline); nothing to do for one in this process."""

# --------------------------------------------------------------------------------------------------- store

class ArtifactStore(Protocol):
    """What the stages ask of a store: folders that become visible whole by a manifest written last, verified
    on read, and pointers (LATEST, BEST) moved atomically. tasks/core/store.py: FileStore (a local folder),
    S3Store (boto3); `open_store(cfg)` picks one."""

    root: str                   # URI of the store root, e.g. file:///abs/path or s3://bucket/prefix
    remote: bool                # readers elsewhere download what it holds (S3); a file store is read in place

    def check(self) -> None:
        """Raise UserError if the store cannot be reached."""
    def uri(self, key: str) -> str: ...
    def manifest(self, key: str) -> dict | None:
        """The folder's manifest (files, sha256, meta), or None while it is not (completely) written."""
    def put_folder(self, key: str, folder: Path, meta: dict[str, Any] | None = None,
                   keep_local: Callable[[str], bool] | None = None, give_up: bool = False) -> dict:
        """Upload a local folder's files, then its manifest (the folder is visible from then on)."""
    def get_folder(self, key: str, dest: Path) -> dict:
        """Download a committed folder into `dest`, each file verified against the manifest."""
    def local(self, key: str) -> Path:
        """A committed folder's local path, verified (a remote store's: a cached copy)."""
    def set_pointer(self, key: str, target: str) -> None: ...
    def advance_pointer(self, key: str, target: str) -> None:
        """Move a pointer forward only (never to an older iteration's folder)."""
    def get_pointer(self, key: str) -> str | None: ...
    def delete_folder(self, key: str) -> None: ...
    def list_folders(self, prefix: str) -> list[str]: ...
