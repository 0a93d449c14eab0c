"""Where each artifact of a run lives in the store (keys relative to the store root).

    <run>/iter-000042/rollouts     generate's output
    <run>/iter-000042/rewards      reward's output (rollouts + scores)
    <run>/trainer/ckpt-000042      model + optimizer + RNG + data cursor after iteration 42
    <run>/trainer/LATEST           pointer to the newest complete checkpoint
    <run>/policy/v000042           published weights (+ config + tokenizer)
    <run>/policy/LATEST            pointer to the newest published policy
"""

BASE = "base"  # the policy before iteration 1: config.model.name_or_path


def rollouts(run: str, iteration: int) -> str:
    return f"{run}/iter-{iteration:06d}/rollouts"


def rewards(run: str, iteration: int) -> str:
    return f"{run}/iter-{iteration:06d}/rewards"


def checkpoint(run: str, iteration: int) -> str:
    return f"{run}/trainer/ckpt-{iteration:06d}"


def policy(run: str, iteration: int) -> str:
    return f"{run}/policy/v{iteration:06d}"


def latest(run: str, kind: str) -> str:
    """kind: 'policy' or 'trainer'."""
    return f"{run}/{kind}/LATEST"

# Inside a trainer checkpoint folder.
CKPT_MODEL = "model"            # save_pretrained weights + config + tokenizer: what publish ships
CKPT_OPTIMIZER = "optimizer.pt"
CKPT_RNG = "rng.pt"
CKPT_STATE = "state.json"       # {"iteration", "step", "data_cursor"}


def evaluation(run: str, iteration: int) -> str:
    """evaluate's output for policy vN: scored held-out completions + metrics."""
    return f"{run}/eval/v{iteration:06d}"


def best(run: str) -> str:
    """Pointer to the published policy with the best evaluation metric so far."""
    return f"{run}/policy/BEST"
