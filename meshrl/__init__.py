"""meshrl: asynchronous RL post-training of language models on Monarch actor meshes."""

from meshrl.config import Config, ConfigError

__all__ = ["Config", "ConfigError"]
__version__ = "0.1.0"
