"""vLLM generators: engine wrapper, the generation service with versioned weight updates, Monarch actor."""

from meshrl.generator.engine import RequestResult, VLLMEngine
from meshrl.generator.service import UPDATE_MODES, Generator

__all__ = ["Generator", "RequestResult", "UPDATE_MODES", "VLLMEngine"]
