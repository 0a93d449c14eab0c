"""Scoring completions: reward functions imported by path and called in a killable worker process
(functions.py, worker.py), and the sandbox that runs model-written code for code rewards (sandbox.py and the
harness it runs, harness.py). The reward functions themselves are in tasks/rewards/."""
