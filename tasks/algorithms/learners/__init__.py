"""The learners `train.algorithm` selects: each owns what it trains on (its inputs: which iterations' rollouts,
what it makes of their rewards), its preparation before the optimiser passes (advantages, values, value
pre-training) and its loss; its settings are its own section of the config (train.learner,
tasks/core/config_train.py).

    grpo.py        advantages from the rewards alone (train.learner.advantage: group, RLOO, REINFORCE++)
    ppo.py         a value model, GAE's per-token advantages, the clipped surrogate + the value loss
    vtrace_awr.py  replay, V-trace's targets, an advantage-weighted log-likelihood, a learned KL constraint

A learner declares what it owns: `rows` (its fields on each micro-batch, MicroBatch.own), `stats` (its
statistics, UpdateStats.own, reduced over processes with the rest) and `trains` (what it trains beside the
policy: "critic", made, optimised and checkpointed by the engines). The update loop (tasks/algorithms/update.py:
optimise) is the same for all of them and never asks which one runs. registry.py finds the learner that
train.learner's settings name; register_learner (tasks/core/config_train.py) adds one (tests/test_learner_plugin.py:
one in a test file alone, chosen by train.algorithm, trained by the train stage).
"""
