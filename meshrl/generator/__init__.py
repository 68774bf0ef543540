"""vLLM generators: engine wrapper, generation loop with versioned weight updates, Monarch actor."""

from meshrl.generator.engine import RequestResult, VLLMEngine
from meshrl.generator.loop import UPDATE_MODES, Generator

__all__ = ["Generator", "RequestResult", "UPDATE_MODES", "VLLMEngine"]
