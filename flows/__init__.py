"""Prefect flows: the training loop (flows/training.py) and the `rlflow` CLI (flows/cli.py)."""
