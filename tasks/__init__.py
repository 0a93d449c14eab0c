"""rlflow's stages and what they are built from.

    generate.py reward.py train.py publish.py evaluate.py   the stages: `python -m tasks.<stage>` runs one alone
    core/          config, store, layout, rollout records, data, models, tracking, lease, errors, processes
    algorithms/    losses, advantages, micro-batching, logprobs, update statistics: pure torch
    engines/       sampling (hf, vLLM offline, vLLM server) and training (torch, DeepSpeed) engines
    scoring/       calling reward functions in a worker process; the code sandbox
    rewards/       reward functions users name in their configs (tasks.rewards.<module>:<function>)

Stages never import each other; they meet in the store (tasks/core/store.py, tasks/core/layout.py).
"""
