"""The run configuration, plain data: `from meshrl.config import Config, ConfigError, ...`.

sections.py and models.py hold the dataclasses, loading.py YAML and overrides, checks.py
the checks the values answer alone, reference.py the generated docs, cpus.py and hf.py the
parsing of CPU lists and of a Hugging Face config.json. Nothing here imports meshrl above
it; checks that need the domain live beside their components, listed by meshrl/preflight.py.
"""

from meshrl.config.checks import ip_and_port, source_kind, validate
from meshrl.config.model_checks import VLLM_HEAD_SIZES
from meshrl.config.loading import ConfigError, apply_overrides, load_yaml, need
from meshrl.config.reference import field_docs, reference_markdown
from meshrl.config.sections import (
    MOE_FAMILIES,
    AlarmConfig,
    BufferConfig,
    Config,
    ContractsConfig,
    CriticConfig,
    DataConfig,
    DistillConfig,
    EvalConfig,
    GeneratorConfig,
    LauncherConfig,
    LengthTailConfig,
    LoggingConfig,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    PaceConfig,
    RolloutConfig,
    SandboxConfig,
    ScorerConfig,
    ScoringConfig,
    TrainedModelConfig,
    TrainerConfig,
    WeightSyncConfig,
)
