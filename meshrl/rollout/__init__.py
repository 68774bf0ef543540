"""What episodes are played against: the env protocol (env.py), tools (tools.py), chat
rendering (chat.py) and OpenEnv environments (openenv.py). The rollout workers that play
them live in `meshrl/agent/`."""
