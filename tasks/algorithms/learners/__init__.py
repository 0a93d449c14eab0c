"""The learners `train.algorithm` selects: each owns what it trains on (its inputs: which iterations' rollouts,
what it makes of their rewards), its preparation before the optimiser passes (advantages, values, value
pre-training) and its loss; its settings are its own section of the config (train.learner,
tasks/core/config_train.py).

    grpo.py        advantages from the rewards alone (train.learner.advantage: group, RLOO, REINFORCE++)
    ppo.py         a value model, GAE's per-token advantages, the clipped surrogate + the value loss
    vtrace_awr.py  replay, V-trace's targets, an advantage-weighted log-likelihood, a learned KL constraint

The update loop (tasks/algorithms/update.py: optimise) is the same for all of them and never asks which one
runs; the train stage (tasks/engines/training.py: update) loads the rollouts a learner asks for from the store.
What they share (the Learner contract, a forward's outputs, the batch's totals) is tasks/core/contracts.py's;
registry.py maps train.algorithm to its learner.
"""
