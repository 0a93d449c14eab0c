"""Environments for multi-turn episodes: the protocol (protocol.py), tool calls (tools.py), adapters for the
environments users already have (adapters.py), the episode loop over a sampling engine (episodes.py) and the
demo's game (games.py). docs/environments.md."""
