"""How episodes run: the environment protocol (protocol.py), tool calls (tools.py), chat rendering (rendering.py),
the episode loop over a sampling engine (episodes.py), where an environment runs (isolation.py; server.py and
pool.py for environment servers), and agents (agents.py) with the endpoint they call (endpoint.py)."""
