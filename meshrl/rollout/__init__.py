"""The rollout side: envs (env.py), tools and chat rendering (tools.py, chat.py), and the
rollout workers that play episodes against the generation service (worker.py)."""
