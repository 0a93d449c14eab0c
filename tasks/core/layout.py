"""Where each artifact of a run lives in the store (keys relative to the store root). The main ones:

    <run>/iter-000042/rollouts     generate's output
    <run>/iter-000042/rewards      reward's output (rollouts + scores): what train reads
    <run>/trainer/ckpt-000042      after iteration 42: model + optimizer + RNG + data cursor (process mode), or
                                   the policy alone (resident mode: lean)
    <run>/trainer/LATEST           pointer to the newest complete ckpt-N
    <run>/policy/v000042           published weights (+ config + tokenizer)
    <run>/policy/LATEST            pointer to the newest published policy

More: docs/internals.md (tasks/core/layout.py): the whole table (dynamic sampling's rounds, the curriculum's
state, resident full checkpoints, DeepSpeed's shards, the reward models' cache).
"""

BASE = "base"  # the policy before iteration 1: config.model.name_or_path


def rollouts(run: str, iteration: int, round: int = 0) -> str:
    """generate's output; round r > 0: dynamic sampling's r-th extra round of the iteration."""
    return f"{run}/iter-{iteration:06d}/rollouts" + (f"-r{round:02d}" if round else "")


def stream_group(run: str, iteration: int, group: int) -> str:
    """generate.streaming: one group of iteration N, committed by the streaming sampler as it completed."""
    return f"{run}/iter-{iteration:06d}/stream/group-{group:05d}"


def stream_scored(run: str, iteration: int, group: int) -> str:
    """generate.streaming: that group scored by the reward functions as it completed (the reward stage's input)."""
    return f"{run}/iter-{iteration:06d}/stream/scored-{group:05d}"


def rewards(run: str, iteration: int) -> str:
    """What the train stage reads: reward's output (with dynamic sampling, the groups it kept)."""
    return f"{run}/iter-{iteration:06d}/rewards"


def scored(run: str, iteration: int, round: int) -> str:
    """generate.dynamic_sampling: one round's scored rollouts, every group (the kept ones go to `rewards`)."""
    return f"{run}/iter-{iteration:06d}/scored-r{round:02d}"


def curriculum(run: str, iteration: int) -> str:
    """data.curriculum: the prompt sampler's state after iteration N's prompts were picked."""
    return f"{run}/curriculum/after-{iteration:06d}"


def checkpoint(run: str, iteration: int) -> str:
    """train's output for iteration N: a full checkpoint (process mode) or the policy alone (resident mode)."""
    return f"{run}/trainer/ckpt-{iteration:06d}"


def full_checkpoint(run: str, iteration: int) -> str:
    """A resident trainer's full checkpoint after iteration N (every train.checkpoint_every, and at the end)."""
    return f"{run}/trainer/full-{iteration:06d}"


def engine_state(run: str, iteration: int, attempt: str, node: int) -> str:
    """One node's deepspeed checkpoint files. `attempt` is new for every run of the stage, so a killed attempt's
    complete-but-unused folders are never confused with the ones the finished checkpoint names."""
    return f"{run}/trainer-state/ckpt-{iteration:06d}-{attempt}/node-{node:03d}"


def policy(run: str, iteration: int) -> str:
    return f"{run}/policy/v{iteration:06d}"


def behaviour_policy(run: str, iteration: int, max_staleness: int) -> str:
    """The policy iteration N's rollouts are sampled from: v(N-1-S), S = run.max_staleness (v0: the base model).
    A pure function of N and S, never of timing: with S = 1 generate(N+1) can run while train(N) does, and a
    rerun or a resume samples every iteration from the same policy as an uninterrupted run."""
    return BASE if iteration - 1 - max_staleness <= 0 else policy(run, iteration - 1 - max_staleness)


def version_of(policy_key: str) -> int:
    """The iteration that published a policy (0 for the base model)."""
    return 0 if policy_key == BASE else int(policy_key.rsplit("/v", 1)[1])


def latest(run: str, kind: str) -> str:
    """kind: 'policy' or 'trainer'."""
    return f"{run}/{kind}/LATEST"

# Inside a trainer checkpoint folder.
CKPT_MODEL = "model"            # the policy (save_pretrained, publish.dtype) + config + tokenizer: what publish ships
CKPT_WEIGHTS = "weights.safetensors"   # the trainer's exact weights, when model/ holds them in another dtype
CKPT_OPTIMIZER = "optimizer.pt"
CKPT_RNG = "rng.pt"
CKPT_CRITIC = "critic.safetensors"     # train.algorithm: ppo: the value model (head, and its trunk if separate)
CKPT_CRITIC_OPTIMIZER = "critic_optimizer.pt"   # deepspeed: the value head's optimizer (outside ZeRO)
CKPT_STATE = "state.json"       # {"iteration", "step", "data_cursor"} (+ deepspeed: engine, shards, layout)
CKPT_RNG_RANK = "rng/rank-{rank:05d}.pt"   # deepspeed: each process's RNG state, in its node's engine_state folder


def evaluation(run: str, iteration: int) -> str:
    """evaluate's output for policy vN: scored held-out completions + metrics."""
    return f"{run}/eval/v{iteration:06d}"


GREEDY = "greedy"        # in an evaluation folder: the greedy completions' records, beside the sampled ones


def judge_cache(run: str, iteration: int, stage: str = "reward", round: int = 0) -> str:
    """Answers of reward.models for one stage of one iteration (and dynamic sampling's round): a retried or
    resumed stage asks nothing twice."""
    return f"{run}/judge-cache/{'iter-' if stage == 'reward' else 'eval-v'}{iteration:06d}" + \
        (f"-r{round:02d}" if round else "")


def best(run: str) -> str:
    """Pointer to the published policy with the best evaluation metric so far."""
    return f"{run}/policy/BEST"
