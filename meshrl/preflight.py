"""Checks before a run starts: each component's own, in order, and this machine's plans.

`check(config)` asks the domain what a config's values cannot show alone (reads files,
writes none); `preflight(config)` adds this machine: a device plan that fits its GPUs, a
run directory it can write, its launcher, model and tokenizer directories that load, the
memory plan, the sandbox, and the user's data and code on a real record. Both raise the
first problem as one `ConfigError` naming the field and the fix (exit 2). The CLI, the API
and the TorchX component call them before any mesh starts; nothing below them imports
this module.

Each check lives beside what it checks: the model's in meshrl/trainer/checks.py, the
tokenizer's in meshrl/tokenizer.py, the data source's and its rows in meshrl/data.py, the
scorers' in meshrl/scorers/checks.py, the env and reward contracts in
meshrl/rollout/checks.py (the table is docs/contracts.md), the sandbox's in
meshrl/rollout/sandbox.py, Slurm's in meshrl/launch/slurm.py, the workers' address in
meshrl/launch/workers.py, the device and memory plans in meshrl/launch/. This module is the
order they run in. Modules that bring torch are imported only by the checks that need
them, so that `meshrl config show` stays quick.
"""

from __future__ import annotations

import contextlib
import os

from meshrl.config import Config, ConfigError
from meshrl.data import check_data, check_eval_source, check_prompt_room, check_records
from meshrl.imports import check_import
from meshrl.launch.devices import plan_devices
from meshrl.launch.hosts import check_cpu_procs
from meshrl.launch.memory import check_memory
from meshrl.rollout.checks import check_env, check_reward_signature, probe_user_code
from meshrl.rollout.env import RewardFn
from meshrl.rollout.sandbox import check_sandbox
from meshrl.scorers.checks import check_reward_fn, check_scorer_files, probe_scorers
from meshrl.tasks import needs_sandbox
from meshrl.tokenizer import check_tokenizer, check_tokenizer_dir
from meshrl.trainer.checks import (
    check_critic_files,
    check_lora,
    check_model,
    check_model_files,
    check_models_vocabulary,
    check_routed_experts,
    check_routed_shapes,
    check_teacher,
)


def check(c: Config) -> None:
    """The domain checks of a built config (reads files, writes none); raise the first problem."""
    # Ordered from the highest layer down (data, scorers, models, rollout, tokenizer), so that
    # no check runs below the next one: each component's own checks, in their modules.
    check_data(c)
    check_eval_source(c)
    check_reward_fn(c)
    check_scorer_files(c)
    check_model_files(c)
    check_teacher(c)
    check_critic_files(c)
    check_lora(c)
    _each_model(c, lambda view, name: check_model_files(view))
    check_models_vocabulary(c)
    check_env(c)
    if c.buffer.sampling not in ("fifo", "random"):
        check_import("buffer.sampling", c.buffer.sampling, "'fifo', 'random' or a sampling function")
    check_tokenizer_dir(c)


def preflight(c: Config, reward_fn: RewardFn | None = None) -> None:
    """`check`, then what only this machine can answer: a device plan that fits its GPUs, a
    run directory that can be written, a launcher address of its own, model and tokenizer
    directories that load, the sandbox where the run executes model-written code, and the
    user's data, env and reward (`reward_fn`: one passed in code) on a real record. Run
    before any mesh starts; raises ConfigError naming the field and the fix."""
    check(c)
    plan = plan_devices(c)  # every proc gets GPUs of its own, or one line saying which field to change
    if c.launcher.kind in ("local", "process") and not any(s.gpus for s in plan.slots):
        check_cpu_procs(c)
    if reward_fn is not None:
        check_reward_signature(reward_fn, "reward_fn")
        if c.models and c.rollout.env is None:  # it would replace the game task's env (agent/envs.py env_factory)
            raise ConfigError("models", "the models beside the policy speak only in a game, and a reward_fn passed in code plays the policy alone: pass none")
    _check_run_dir(c)
    if c.weight_sync.transport == "files" and c.weight_sync.files_dir is not None:
        from meshrl.weightsync.connect import check_files_dir  # it imports torch: only where it is asked

        check_files_dir(c)
    if c.launcher.kind == "workers":
        from meshrl.launch.workers import check_address

        check_address(c)
    if c.launcher.kind == "slurm" and not c.launcher.dry_run:
        from meshrl.launch.slurm import check_slurm

        check_slurm(c)
    family = check_model(c, plan)  # the checkpoint loads; tp, cp and the dtype suit its family and the plan
    check_models(c, plan)
    check_memory(c, plan)  # what every proc will hold on its GPU fits it, or one line naming the field to change
    check_routed_experts(c, family)
    tokenizer = check_tokenizer(c)  # (loaded once: the prompt check reads the first record with it)
    if needs_sandbox(c):
        check_sandbox(c)  # the isolation tool works here; model-written code never runs unsandboxed
    check_user_code(c, reward_fn, tokenizer)


def check_models(c: Config, plan) -> None:
    """`check_model` and `check_routed_experts` on each model beside the policy, against its own
    slots of the plan; then the routes of every model that returns them share one shape."""
    _each_model(c, lambda view, name: check_routed_experts(view, check_model(view, plan, own=plan.view(name)), f"model {name}"))
    check_routed_shapes(c)


def _each_model(c: Config, check) -> None:
    """`check(view, name)` on each model beside the policy (its config view), its field named under `models[i]`."""
    for i, m in enumerate(c.models):
        view = c.for_model(m.name)  # a field of its own that is wrong already names models[i]
        try:
            check(view, m.name)
        except ConfigError as e:
            raise e.under(f"models[{i}]") from None


def _check_run_dir(c: Config) -> None:
    """RUN_DIR can be made and written. What the probe made is removed again: a config
    refused by a later check, or a dry run, leaves no directory behind (the run makes it)."""
    run_dir = missing = os.path.abspath(c.logging.run_dir)
    levels, made = [], []
    while not os.path.exists(missing):
        levels.append(missing)
        missing = os.path.dirname(missing)
    try:
        for level in reversed(levels):
            try:
                os.mkdir(level)
                made.append(level)
            except FileExistsError:  # made meanwhile by another: not ours to remove
                pass
        probe = os.path.join(run_dir, f".meshrl-write-check-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError("logging.run_dir", f"cannot write to {run_dir!r} ({e.strerror or type(e).__name__}): choose a writable directory") from None
    finally:
        for level in reversed(made):  # only those this probe made, and only while empty
            with contextlib.suppress(OSError):
                os.rmdir(level)


_checked: set[tuple[str, int]] = set()
"""Configs (and code-passed reward functions) whose data and code passed `check_user_code`
in this process: the CLI checks before the console is quieted and `run` again, once is enough."""


def check_user_code(c: Config, reward_fn: RewardFn | None = None, tokenizer=None) -> None:
    """The data source's rows, a single-turn prompt's room (read with `tokenizer`, the policy's
    that `check_tokenizer` loaded, where it loaded one), then (contracts.probe) the env or reward function and the
    scorers run once on its first record. ConfigError (kind `data error` or `contract
    error`) at the first problem."""
    key = (c.to_yaml(), id(reward_fn))
    if key in _checked:
        return
    record = check_records(c)
    check_prompt_room(c, record, tokenizer)
    if c.contracts.probe:
        probe_user_code(c, record, reward_fn)
        probe_scorers(c, record)
    _checked.add(key)
