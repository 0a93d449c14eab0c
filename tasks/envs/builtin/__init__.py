"""The environments rlflow ships, named in configs as users' own are (env.factory, env.agent): the multi-turn demo's
game and its agent (games.py), a browser environment (browser.py) and the small shop it is tested on (webshop.py)."""
