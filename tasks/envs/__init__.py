"""Environments for multi-turn episodes, in three rooms (docs/environments.md):

    runtime/   how episodes run: the protocol, tool calls, rendering, the episode loop, isolation, the environment
               server and its pool, the agents' endpoint and the agents
    adapters/  environments written for other ecosystems (TRL, gymnasium, verifiers, OpenEnv), driven unchanged
    builtin/   the environments rlflow ships: the demo's game, a browser and the shop it is tested on
"""
