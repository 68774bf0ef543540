"""The config a run starts from: a Config, a dict or a YAML path with overrides
(`as_config`), or a resumed run's own, RUN_DIR/config.yaml, checked against its latest
checkpoint before any mesh starts (`resume_config`). `run_config` is which, for
`meshrl.run` and `meshrl.Session`."""

from __future__ import annotations

import os

from meshrl.config import Config, ConfigError, apply_overrides, load_yaml
from meshrl.errors import first_line


def as_config(config: Config | dict | str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    if config is None:
        config = {}
    if isinstance(config, Config):
        config = config.to_dict()
    if isinstance(config, (str, os.PathLike)):
        config = load_yaml(config)
    if not isinstance(config, dict):
        raise ConfigError("", f"config must be a meshrl.Config, a dict or a YAML path, not {type(config).__name__}")
    return Config.from_dict(apply_overrides(config, overrides or []))


def run_config(config, resume: str | None, overrides: list[str] | None) -> Config:
    """The run's config: `config` with `overrides`, or a resumed run's own (RUN_DIR/config.yaml) with them."""
    if resume is not None and config is not None:  # (the CLI refuses the same)
        raise ConfigError("--resume", "a resumed run uses RUN_DIR/config.yaml: pass only overrides with resume=")
    return as_config(config, overrides) if resume is None else resume_config(resume, overrides)


def resume_config(run_dir: str, overrides: list[str] | None = None) -> Config:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError("--resume", f"{run_dir!r} is not a meshrl run directory (no config.yaml): pass the RUN_DIR of an earlier run")
    if not os.path.isfile(os.path.join(run_dir, "checkpoints", "latest")):
        raise ConfigError("--resume", f"{run_dir!r} has no checkpoint yet: nothing to resume")
    config = as_config(path, overrides)
    written, asked = load_yaml(path), config.logging.run_dir
    if asked != written.get("logging", {}).get("run_dir") and os.path.abspath(asked) != os.path.abspath(run_dir):  # an override would be dropped silently
        raise ConfigError("logging.run_dir", f"a resumed run continues in {run_dir}: drop the override (copy the directory to continue it elsewhere)")
    config.logging.run_dir = run_dir
    from meshrl.controller.checkpoint import check_resumable, latest_state

    try:
        state = latest_state(run_dir)
    except Exception as e:  # noqa: BLE001 - the file `latest` names is gone or cut short
        why = first_line(str(e), 160) or type(e).__name__
        raise ConfigError("--resume", f"{run_dir!r}: its latest checkpoint cannot be read ({why}): point checkpoints/latest at a complete one") from None
    check_resumable(state, config, run_dir)
    from meshrl.config.loading import build

    saved = build(Config, written)  # the run as it wrote itself (typed, not checked: its cores were another host's)
    check_same_shapes(saved, config, run_dir)
    check_same_seed(saved, config, run_dir)
    return config


def check_same_seed(saved: Config, config: Config, run_dir: str) -> None:
    """A from-scratch model (no `model.path`) rebuilds its KL reference, and a PRM without a
    path of its own its pi_ref, from `seed` on every start, its trained state restored over
    the rest: another seed on a resume would give them other weights, silently."""
    if saved.seed == config.seed:
        return
    views = [("the policy's", config)] + [(f"{m.name}'s", _view(config, m.name)) for m in config.models if not m.frozen]
    for whose, c in views:
        prm = c is config and any(s.kind == "prm" and s.path is None for s in config.scoring.scorers)
        rebuilt = [what for what, on in (("KL reference", c is not None and c.trainer.loss.kl_coef > 0), ("PRM's pi_ref", prm)) if on]
        if c is not None and c.model.path is None and rebuilt:
            why = f"{run_dir} started from seed={saved.seed}'s weights, which {whose} {' and '.join(rebuilt)} is built from again"
            raise ConfigError("seed", f"{why}: resume with seed={saved.seed}")


def _view(config: Config, name: str) -> Config | None:
    try:
        return config.for_model(name)
    except ConfigError:  # a view this host refuses: preflight says why
        return None


SHAPE = ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "num_experts", "experts_top_k")
"""The model fields that shape a trainer's state where it has no model.path (its config.json does then)."""


def check_same_shapes(saved: Config, config: Config, run_dir: str) -> None:
    """A resume whose overrides reshape a trained model (its `model` fields, a checkpoint where
    it had none or none where it had one, LoRA's rank or targets) would fail to load its checkpoint once
    the meshes are up, after its config.yaml was written over, and LoRA's alpha would rescale
    the trained adapters silently: refused here, in one line."""

    def refuse(field: str, was, now) -> None:
        own = field.split(".", 1)[-1] if field.startswith("models[") else field
        raise ConfigError(
            field, f"{run_dir}'s checkpoint was trained with {own}={was}, and this resume asks for {now}: resume with its own, or start a new run"
        )

    if saved.lora.rank != config.lora.rank:
        refuse("lora.rank", saved.lora.rank, config.lora.rank)
    if config.lora.rank > 0 and sorted(saved.lora.targets) != sorted(config.lora.targets):  # other adapters to load
        refuse("lora.targets", sorted(saved.lora.targets), sorted(config.lora.targets))
    if config.lora.rank > 0 and saved.lora.alpha != config.lora.alpha:  # the trained adapters would be scaled anew, silently
        refuse("lora.alpha", saved.lora.alpha, config.lora.alpha)

    views = [("", saved, config)] + [(f"models[{i}].", _view(saved, m.name), _view(config, m.name)) for i, m in enumerate(config.models) if not m.frozen]
    for prefix, was, now in views:
        if was is None or now is None:
            continue
        if (was.model.path is None) != (now.model.path is None):  # (a checkpoint moved elsewhere may be named anew)
            refuse(prefix + "model.path", was.model.path, now.model.path)
        for key in SHAPE if now.model.path is None else ():
            if getattr(was.model, key) != getattr(now.model, key):
                refuse(f"{prefix}model.{key}", getattr(was.model, key), getattr(now.model, key))
