"""rlflow's stages and what they are built from.

    generate.py reward.py train.py publish.py evaluate.py   the stages: `python -m tasks.<stage>` runs one alone
    core/          the contracts, config, store, layout, rollout records, data, models, tracking, lease, errors,
                   processes, daemons
    algorithms/    the learners (grpo, ppo, vtrace_awr), losses, advantages, micro-batching, logprobs, the update
                   loop: pure torch
    engines/       sampling (hf, vLLM offline, vLLM server, replicas behind a router) and training (torch,
                   DeepSpeed) engines; the trainer, in the stage's process or resident
    scoring/       calling reward functions in a worker process; the code sandbox; reward models and LLM judges
    rewards/       reward functions users name in their configs (tasks.rewards.<module>:<function>)
    envs/          environments in three rooms: runtime/ (episodes, the protocol, isolation, servers and pools,
                   agents and their endpoint), adapters/ (other ecosystems'), builtin/ (ours; docs/environments.md)

Stages never import each other; they meet in the store (tasks/core/store.py, tasks/core/layout.py).
"""

import os as _os

# A child rlflow started with rlflow_first (tasks/core/processes.py) has PYTHONSAFEPATH set so that `-m` does not
# import a working directory's own tasks/ or flows/; it has done its work once this package is found, and left in
# os.environ it would reach what user code here starts (`python script.py` would lose its folder on sys.path). This
# package is imported first in every rlflow process, before any user code, so it is dropped here (two dictionary
# look-ups: nothing imported). A user's own PYTHONSAFEPATH carries no marker and is kept.
if _os.environ.get("RLFLOW_SAFEPATH") == "1":
    _os.environ.pop("PYTHONSAFEPATH", None)
    del _os.environ["RLFLOW_SAFEPATH"]

# A stage process the local launcher watches (flows/launch.py: Local) beats from its first moment, its imports
# included: a thread of its own touches the file RLFLOW_HEARTBEAT names every 5 s for the process's whole life, so
# the beats stop only when the whole process does (stopped by a signal, wedged), never for a long step of its own.
# Taken out of os.environ here: what the stage starts (its reward worker, a trainer) does not beat for it.
if _beat := _os.environ.pop("RLFLOW_HEARTBEAT", None):
    import threading as _threading
    import time as _time

    def _beating(path: str) -> None:
        while True:
            try:
                _os.utime(path)
            except OSError:
                return                  # (the launcher is gone, and its file with it)
            _time.sleep(5.0)

    _threading.Thread(target=_beating, args=(_beat,), daemon=True, name="rlflow-heartbeat").start()
