"""Environments written for other ecosystems, trained unchanged: TRL, gymnasium and verifiers classes
(kinds.py: env.adapter), verifiers 0.4 environments as an agent (verifiers_v04.py) and OpenEnv servers
(openenv_adapter.py); the last two run in a Python of their own, through a bridge process (bridge.py,
*_bridge.py)."""
