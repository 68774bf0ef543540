"""Checks a config's values can answer alone: ranges, and relations between fields.

`validate` runs inside `Config.from_dict`, so every config built anywhere (the CLI, the API, each
actor rebuilding its copy from a dict) is consistent: sizes that divide, bounds that hold, CPU
lists that parse and, on this machine, name cores it has. It reads no file and imports nothing of
meshrl's domain; what needs the tasks, user code, optional packages or the files a config names is
checked once, before a run, beside its component (listed in order by meshrl/preflight.py). The
first problem found is raised as one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import ipaddress
import math
import re
import typing

from meshrl.config.loading import need
from meshrl.config.model_checks import (
    _check_critic,
    _check_distill,
    _check_generator,
    _check_lora,
    _check_loss,
    _check_model,
    _check_trainer,
    _check_weight_sync,
)

if typing.TYPE_CHECKING:
    from meshrl.config import Config


def source_kind(source: str) -> str:
    """`task`, `reasoning_gym`, `file` (.jsonl / .parquet) or `dataset` (a save_to_disk directory)."""
    if source.startswith("task:"):
        return "task"
    if source.startswith("reasoning_gym:"):
        return "reasoning_gym"
    return "file" if source.endswith((".jsonl", ".parquet")) else "dataset"


def ip_and_port(address: str) -> tuple[str, int]:
    """`IP:PORT` (`[IPv6]:PORT` too) as (IP, port); ValueError for a name, a wildcard or a bad port."""
    host, _, port = address.rpartition(":")
    ip = host.strip("[]")
    try:
        unspecified, port = ipaddress.ip_address(ip).is_unspecified, int(port)
    except ValueError:
        raise ValueError(f"{address!r} is not IP:PORT: give this host's own address and a port, e.g. 10.0.0.5:26600 ([IPv6]:PORT)") from None
    if unspecified or not 0 < port < 65536:
        raise ValueError(f"refusing the wildcard address {ip!r}: give a host's own address" if unspecified else f"port {port} is out of range")
    return ip, port


def validate(c: Config) -> None:
    """Check values and relations that types alone cannot; raise the first problem found."""
    for check in _SECTIONS:
        check(c)


def _check_run(c: Config) -> None:
    """The run's own sizes."""
    need(c.steps >= 1, "steps", f"must be at least 1, got {c.steps}")
    need(c.batch_groups >= 1, "batch_groups", f"must be at least 1, got {c.batch_groups}")
    need(0 <= c.seed < 2**31, "seed", f"must be from 0 to {2**31 - 1} (the engines seed numpy with it, plus their index), got {c.seed}")
    need(c.logging.run_dir.strip() != "", "logging.run_dir", "is empty: name the run's directory (default runs/latest)")


def _check_buffer(c: Config) -> None:
    """The episode queue's depth and staleness bound."""
    buffer = c.buffer
    need(buffer.depth >= 0, "buffer.depth", f"must be at least 0 (0 = synchronous), got {buffer.depth}")
    need(buffer.max_lag is None or buffer.max_lag >= 0, "buffer.max_lag", f"a staleness bound must be at least 0 (or null for none), got {buffer.max_lag}")
    need(buffer.get_timeout_s > 0, "buffer.get_timeout_s", f"must be positive, got {buffer.get_timeout_s}")
    need(
        buffer.max_dropped_per_batch is None or buffer.max_dropped_per_batch >= 0,
        "buffer.max_dropped_per_batch",
        f"must be at least 0 (or null for batch_groups), got {buffer.max_dropped_per_batch}",
    )


def _check_alarm(c: Config) -> None:
    """The run-level alarm's window and thresholds."""
    alarm = c.alarm
    need(alarm.window >= 1, "alarm.window", f"must be at least 1, got {alarm.window}")
    need(0 < alarm.reward_drop < 1, "alarm.reward_drop", f"a fraction of the best window's reward, in (0, 1), got {alarm.reward_drop}")
    need(alarm.min_best_reward >= 0, "alarm.min_best_reward", f"must be at least 0, got {alarm.min_best_reward}")
    need(alarm.entropy_floor >= 0, "alarm.entropy_floor", f"must be at least 0 (0 = off), got {alarm.entropy_floor}")
    need(alarm.divergence_window >= 2, "alarm.divergence_window", f"must be at least 2, got {alarm.divergence_window}")
    need(alarm.divergence_z > 0, "alarm.divergence_z", f"must be above 0 (a multiple of the noise), got {alarm.divergence_z}")
    need(alarm.divergence_min_move >= 0, "alarm.divergence_min_move", f"a fraction of the signal's size, at least 0, got {alarm.divergence_min_move}")
    need(-1 <= alarm.divergence_corr <= 1, "alarm.divergence_corr", f"a rank correlation, in [-1, 1] (-1 = off), got {alarm.divergence_corr}")
    need(alarm.on_divergence in ("warn", "stop"), "alarm.on_divergence", f"warn or stop, got {alarm.on_divergence!r}")


def _check_sync_mode(c: Config) -> None:
    """buffer.depth=0 (synchronous) with the update mode it needs."""
    buffer = c.buffer
    gen = c.generator
    if buffer.depth == 0:
        need(
            gen.update_mode == "block",
            "generator.update_mode",
            f"buffer.depth=0 is synchronous on-policy training and needs update_mode 'block', got {gen.update_mode!r}",
        )


def _check_scoring(c: Config) -> None:
    """Scorers, their weights and names."""
    scoring = c.scoring
    need(scoring.timeout_s > 0, "scoring.timeout_s", f"must be positive, got {scoring.timeout_s}")
    need(not (scoring.reward_fn and scoring.reward_model), "scoring.reward_model", "set either scoring.reward_fn or scoring.reward_model, not both")
    need(math.isfinite(scoring.env_weight), "scoring.env_weight", f"must be a finite number, got {scoring.env_weight}")
    need(
        scoring.env_weight == 1.0 or scoring.scorers,
        "scoring.env_weight",
        f"is {scoring.env_weight:g}, and it weighs the env's reward against scoring.scorers, of which there are none: add a scorer, or leave env_weight at 1",
    )
    need(math.isfinite(scoring.process_weight), "scoring.process_weight", f"must be a finite number, got {scoring.process_weight}")
    models = c.model_names()
    for i, sc in enumerate(scoring.scorers):
        _check_scorer(sc, f"scoring.scorers[{i}]")
        name = sc.name or sc.kind  # (a PRM's name is in its state's and export's paths)
        need(
            bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", name)),
            f"scoring.scorers[{i}].name",
            f"must be a short name (letters, digits, _ and -), got {name!r}",
        )
        need(sc.model in models, f"scoring.scorers[{i}].model", f"names no trained model ({sc.model!r}): the run trains {', '.join(models)}")
        if sc.kind == "prm":
            _check_prm(c, sc, f"scoring.scorers[{i}]")
    if scoring.scorers:
        names = scoring.scorer_names()
        dup = sorted({n for n in names if names.count(n) > 1} | ({"env"} & set(names)))
        need(not dup, "scoring.scorers", f"names {dup} are taken (by another scorer, or `env`, the env's reward): give each scorer its own `name`")


def _check_contracts(c: Config) -> None:
    """The user-code contract checks' bounds."""
    contracts = c.contracts
    need(contracts.data_check_s >= 0, "contracts.data_check_s", f"must be at least 0 (0 = no check before the run), got {contracts.data_check_s}")
    need(0 <= contracts.warn_failed_frac <= 1, "contracts.warn_failed_frac", f"must be in [0, 1] (1 = never warn), got {contracts.warn_failed_frac}")
    need(
        contracts.stop_after_failed_steps >= 0,
        "contracts.stop_after_failed_steps",
        f"must be at least 0 (0 = never stop), got {contracts.stop_after_failed_steps}",
    )


def _check_data(c: Config) -> None:
    """The prompt source and its arguments."""
    data = c.data
    need(data.num_prompts >= 1, "data.num_prompts", f"must be at least 1, got {data.num_prompts}")
    need(
        not data.task_args or source_kind(data.source) == "reasoning_gym",
        "data.task_args",
        f"only a reasoning_gym: source takes task arguments, not {data.source!r}: drop them",
    )
    if data.source in ("task:longtail", "task:longtail_chat"):
        n = data.lengths
        need(n.median >= 1, "data.lengths.median", f"must be at least 1, got {n.median}")
        need(n.max >= n.median, "data.lengths.max", f"must be at least data.lengths.median ({n.median}), got {n.max}")
        need(n.sigma >= 0, "data.lengths.sigma", f"must be at least 0, got {n.sigma}")
        need(n.slack >= 0, "data.lengths.slack", f"must be at least 0, got {n.slack}")
        if data.source == "task:longtail_chat":  # (the single-turn task plays no rounds)
            need(
                1 <= n.turns_max <= c.rollout.max_turns,
                "data.lengths.turns_max",
                f"must be from 1 to rollout.max_turns ({c.rollout.max_turns}), got {n.turns_max}",
            )


def _check_eval(c: Config) -> None:
    """Held-out evaluation: its cadence and source."""
    ev = c.eval
    need(ev.every >= 0, "eval.every", f"must be at least 0 (0 = off), got {ev.every}")
    need(ev.num_prompts >= 1, "eval.num_prompts", f"must be at least 1, got {ev.num_prompts}")
    need(ev.k >= 1, "eval.k", f"must be at least 1, got {ev.k}")
    if ev.source is not None:
        need(
            not ev.task_args or source_kind(ev.source) == "reasoning_gym",
            "eval.task_args",
            f"only a reasoning_gym: eval.source takes task arguments, not {ev.source!r}: drop them",
        )
    else:
        need(
            not ev.task_args,
            "eval.task_args",
            "eval.task_args go with an eval.source of its own: set eval.source, or drop them (the training task's data.task_args apply)",
        )
        if ev.every:
            check_held_out(c)


def check_held_out(c: Config) -> None:
    """Evaluation has prompts the run does not train on: eval.source, or a task's or
    reasoning_gym's own held-out draw. A file or dataset source alone has none."""
    need(
        c.eval.source is not None or source_kind(c.data.source) in ("task", "reasoning_gym"),
        "eval.source",
        f"a file or dataset source ({c.data.source}) has no held-out part of its own: give eval.source a held-out file",
    )


def _check_rollout(c: Config) -> None:
    """Rollout workers, turns, and the sandbox's limits."""
    rollout = c.rollout
    need(rollout.workers >= 1, "rollout.workers", f"must be at least 1, got {rollout.workers}")
    need(rollout.groups_per_worker >= 0, "rollout.groups_per_worker", f"must be at least 0 (0 = auto), got {rollout.groups_per_worker}")
    need(rollout.max_turns >= 1, "rollout.max_turns", f"must be at least 1, got {rollout.max_turns}")
    need(rollout.env_timeout_s > 0, "rollout.env_timeout_s", f"must be positive, got {rollout.env_timeout_s}")
    sandbox = rollout.sandbox
    for name, low in (
        ("pool_size", 0),
        ("max_concurrent", 1),
        ("cpu_time_s", 1),
        ("memory_mb", 64),
        ("max_processes", 4),
        ("max_file_mb", 1),
        ("workspace_mb", 1),
        ("max_output_bytes", 1024),
    ):
        need(getattr(sandbox, name) >= low, f"rollout.sandbox.{name}", f"must be at least {low}, got {getattr(sandbox, name)}")
    need(0 < sandbox.wall_timeout_s <= 3600, "rollout.sandbox.wall_timeout_s", f"must be in (0, 3600], got {sandbox.wall_timeout_s}")
    need(sandbox.uid > 0, "rollout.sandbox.uid", f"must be an unprivileged uid (not 0), got {sandbox.uid}")


def _check_launcher(c: Config) -> None:
    """Hosts, workers, and Slurm's time limit and signal."""
    launcher = c.launcher
    need(launcher.hosts >= 1, "launcher.hosts", f"must be at least 1, got {launcher.hosts}")
    need(
        launcher.hosts == 1 or launcher.kind != "local",
        "launcher.hosts",
        "launcher.kind=local runs every role on this machine (two roles would share its GPUs): set it to 1, or use process, slurm or workers",
    )
    if launcher.kind == "workers":
        _check_workers(c)
    else:
        need(not launcher.workers, "launcher.workers", f"only launcher.kind=workers attaches to workers, not {launcher.kind!r}: set the kind or drop the list")
    need(launcher.gpus_per_host >= 0, "launcher.gpus_per_host", f"must be at least 0, got {launcher.gpus_per_host}")
    need(launcher.spare_hosts >= 0, "launcher.spare_hosts", f"must be at least 0, got {launcher.spare_hosts}")
    need(
        launcher.spare_hosts == 0 or launcher.kind in ("process", "slurm", "workers"),
        "launcher.spare_hosts",
        f"launcher.kind={launcher.kind} runs on this host alone and has no hosts to spare: set it to 0, or use process, slurm or workers",
    )
    need(launcher.start_timeout_s > 0, "launcher.start_timeout_s", f"must be positive, got {launcher.start_timeout_s}")
    need(
        launcher.host_timeout_s >= 1,
        "launcher.host_timeout_s",
        f"must be at least 1 s (a host's agent answers within milliseconds when up), got {launcher.host_timeout_s}",
    )
    parts = launcher.time_limit.split(":")
    need(len(parts) == 3 and all(p.isdigit() for p in parts), "launcher.time_limit", f"{launcher.time_limit!r} must look like HH:MM:SS")
    need(launcher.max_resubmits >= 0, "launcher.max_resubmits", f"must be at least 0, got {launcher.max_resubmits}")
    need(
        launcher.max_resubmits == 0 or launcher.kind == "slurm",
        "launcher.max_resubmits",
        f"only launcher.kind=slurm resubmits itself, not {launcher.kind!r}: set it to 0",
    )
    if launcher.kind == "slurm":
        limit_s = int(parts[0]) * 3600 + int(parts[1]) * 60 + int(parts[2])
        need(
            0 < launcher.signal_before_s < limit_s,
            "launcher.signal_before_s",
            f"must be positive and below the time limit ({launcher.time_limit} = {limit_s} s), got {launcher.signal_before_s}",
        )
        need(
            launcher.signal_before_s > c.trainer.interrupt_checkpoint_timeout_s,
            "launcher.signal_before_s",
            f"{launcher.signal_before_s} s leaves no time to stop after the interrupt checkpoint "
            f"(trainer.interrupt_checkpoint_timeout_s={c.trainer.interrupt_checkpoint_timeout_s:g}): raise it or lower that timeout",
        )


METRIC_PREFIXES = (
    "alarm",
    "buffer",
    "colocate",
    "env",
    "episode",
    "eval",
    "generator",
    "response",
    "reward",
    "rollout",
    "scoring",
    "step",
    "sync",
    "time",
    "trainer",
    "version",
)
"""The run's own metric prefixes: a model's metrics are NAME/..., so no model takes one of these
names (`critic`, the policy's critic's prefix, is refused beside a critic: its exports collide too)."""


def _check_models(c: Config) -> None:
    """Trained models beside the policy (docs/coevolve.md): names, and what they do not combine with yet."""
    if not c.models:
        return
    names = ["policy"]
    for i, m in enumerate(c.models):
        path = f"models[{i}].name"
        need(bool(re.fullmatch(r"[a-z][a-z0-9_]{0,31}", m.name)), path, f"must be a short lowercase name (letters, digits, _), got {m.name!r}")
        taken = {"policy": "the policy", "game": "a game's own numbers, game/KEY"}.get(m.name, "by another model")
        need(m.name not in names and m.name != "game", path, f"{m.name!r} is taken ({taken}): give each model a name of its own")
        need(
            m.name not in METRIC_PREFIXES,
            path,
            f"{m.name!r} is the run's own metrics prefix ({m.name}/...), which NAME/... would mix with: give the model another name",
        )
        need("group_size" not in m.generator, f"models[{i}].generator.group_size", "a group is the run's: every model's episodes share generator.group_size")
        for key in ("checkpoint_every", "checkpoint_every_s", "keep_checkpoints"):  # one checkpoint holds every model at one version
            need(key not in m.trainer, f"models[{i}].trainer.{key}", f"a checkpoint is the run's (every model at one version): set trainer.{key}")
        if m.frozen:  # served from a checkpoint of its own, never trained
            need(bool(m.model.get("path")), f"models[{i}].model.path", "a frozen model serves a checkpoint, never trained: set a Hugging Face model directory")
            need(not m.trainer, f"models[{i}].trainer", f"{m.name} is frozen and has no trainer: drop its trainer section, or frozen")
        names.append(m.name)
    models = ", ".join(names[1:])
    if c.eval.every > 0 or c.eval.source is not None:  # the policy alone on held-out prompts, as Absolute Zero evaluates its solver
        alone = c.eval.source is not None and source_kind(c.eval.source) in ("task", "reasoning_gym") and c.rollout.env is None
        need(
            alone,
            "eval.source",
            "with several trained models evaluation plays the policy alone on a `task:` or `reasoning_gym:` source of its own "
            f"(e.g. task:digits; not the game, nor a run with rollout.env) (models: {models})",
        )
    for i, sc in enumerate(c.scoring.scorers):  # per-token rewards on the threads of the model a scorer names
        if sc.kind == "prm":  # it starts from the policy's weights (or its own path) and trains on the policy's outcomes
            need(
                sc.model == "policy",
                f"scoring.scorers[{i}].model",
                f"an implicit PRM scores and trains on the policy's threads (it starts from the policy's weights): set model=policy (models: {models})",
            )
    for i, m in enumerate(c.models):
        if m.frozen:  # no trainer, no critic; its generator and model sections checked as any model's
            c.for_model(m.name)
            continue
        gae = c.advantage_modes()[i + 1] == "gae"
        need(
            not (gae and c.placement == "colocate"),
            f"models[{i}].trainer.loss.advantage",
            f"{m.name} trains by gae, and its critic would train beside its trainer, while colocate hands the devices to one "
            "role at a time: set placement=split, or a group advantage (grpo) for it",
        )
        view = c.for_model(m.name)  # each model's sections, checked as the policy's are
        if view.trainer.loss.advantage == "gae":  # a critic of its own, started from its own weights (critic.init)
            how = "inherits the policy's gae" if "advantage" not in m.trainer.get("loss", {}) else "trains by gae"
            need(
                c.critic.path is None,
                "critic.path",
                f"names the policy's critic checkpoint, and {m.name} {how}: its critic starts from its own weights "
                f"(critic.init); drop critic.path, or set models[{i}].trainer.loss.advantage to grpo",
            )


def _check_exports(c: Config) -> None:
    """Each trained model, critic and implicit PRM exports to a directory of its own under
    RUN_DIR/hf: a name that makes two of them one would let the last overwrite the first."""
    modes, owners = c.advantage_modes(), {"final": "the policy"}

    def claim(folder: str, path: str, owner: str) -> None:
        need(folder not in owners, path, f"{owner} would export to hf/{folder}, where {owners.get(folder)} exports: give it another name")
        owners[folder] = owner

    if modes[0] == "gae":
        claim("final-critic", "trainer.loss.advantage", "the policy's critic")
    for i, m in enumerate(c.models):
        if not m.frozen:
            claim(f"final-{m.name}", f"models[{i}].name", f"model {m.name}")
            if modes[i + 1] == "gae":
                claim(f"final-{m.name}-critic", f"models[{i}].name", f"model {m.name}'s critic")
    for i, (sc, name) in enumerate(zip(c.scoring.scorers, c.scoring.scorer_names())):
        if sc.kind == "prm":
            claim(f"final-{name}", f"scoring.scorers[{i}].name", f"PRM {name}")
            if sc.path is None:  # its frozen start exported beside it (a start from a checkpoint is that checkpoint)
                claim(f"final-{name}-reference", f"scoring.scorers[{i}].name", f"PRM {name}'s reference")


_SECTIONS = (
    _check_run,
    _check_model,
    _check_trainer,
    _check_loss,
    _check_generator,
    _check_buffer,
    _check_alarm,
    _check_sync_mode,
    _check_weight_sync,
    _check_scoring,
    _check_contracts,
    _check_data,
    _check_eval,
    _check_distill,
    _check_lora,
    _check_rollout,
    _check_launcher,
    _check_critic,
    _check_models,
    _check_exports,
)
"""In the order the problems are reported: the first found is raised."""


def _check_workers(c: Config) -> None:
    """Hosts given as `meshrl worker` addresses, and this controller's own address on their network."""
    launcher = c.launcher
    need(len(launcher.workers) >= 1, "launcher.workers", "launcher.kind=workers needs the IP:PORT of at least one `meshrl worker`")
    working = len(launcher.workers) - launcher.spare_hosts
    need(working >= 1, "launcher.spare_hosts", f"{launcher.spare_hosts} spares leave none of the {len(launcher.workers)} launcher.workers to run on: lower it")
    need(
        launcher.hosts in (1, working),
        "launcher.hosts",
        f"is {launcher.hosts} but launcher.workers lists {working} hosts besides launcher.spare_hosts: drop launcher.hosts (the workers are the hosts)",
    )
    for i, w in enumerate(launcher.workers):
        try:
            ip_and_port(w)
            bad = False
        except ValueError:
            bad = True
        need(not bad, f"launcher.workers[{i}]", f"{w!r} must be IP:PORT of a `meshrl worker` (an address of its host, not a wildcard or a name)")
    need(launcher.address is not None, "launcher.address", "launcher.kind=workers needs this controller's own IP, as the workers reach it")
    try:
        ok = not ipaddress.ip_address(launcher.address).is_unspecified
    except ValueError:
        ok = False
    need(ok, "launcher.address", f"{launcher.address!r} must be an IP of this controller (not a wildcard or a name)")


def _check_prm(c: Config, sc, path: str) -> None:
    """An implicit PRM's values, and what it cannot combine with (docs/coevolve.md, PRIME)."""
    need(math.isfinite(sc.beta) and sc.beta > 0, f"{path}.beta", f"must be a positive number, got {sc.beta}")
    need(math.isfinite(sc.lr) and sc.lr > 0, f"{path}.lr", f"must be a positive number, got {sc.lr}")
    band = sc.train_accuracy
    need(
        len(band) == 2 and 0 <= band[0] <= band[1] <= 1,
        f"{path}.train_accuracy",
        f"must be [low, high] with 0 <= low <= high <= 1 (shares of a group's successful episodes), got {band}",
    )
    need(
        c.generator.group_size >= 2 or band[0] == 0 or band[1] == 1,
        f"{path}.train_accuracy",
        f"is {band}, and with one completion per prompt (generator.group_size=1) a group's share of successes is 0 or 1: "
        "the prm would never train; include 0 or 1 in it, or sample at least 2 completions per prompt",
    )
    need(
        sc.replicas == 1,
        f"{path}.replicas",
        f"is {sc.replicas}: a prm trains in one replica, and its weights are not synced between replicas: set replicas=1 (`procs` shards it)",
    )
    need(sc.process == "none", f"{path}.process", "a prm scores every model token (PRIME's per-token rewards): leave process=none")
    need(
        c.generator.group_size >= 2 or c.trainer.loss.advantage == "gae",
        "generator.group_size",
        "a prm's rewards are measured against the rest of their group (leave-one-out), and one completion has none: "
        "at least 2 completions per prompt, or trainer.loss.advantage=gae",
    )
    others = [i for i, o in enumerate(c.scoring.scorers) if o is not sc and (o.process != "none" or o.kind == "prm")]
    need(
        not others,
        "scoring.scorers",
        f"a prm and scorers {others} would share one process baseline (the prm's is leave-one-out): keep one process scorer",
    )


def _check_scorer(sc, path: str) -> None:
    """One scoring.scorers entry's values (its files and code are checked at preflight)."""
    if sc.kind in ("function", "reward_model", "judge"):
        what = "an import path module:function" if sc.kind == "function" else "a local checkpoint directory"
        need(bool(sc.path), f"{path}.path", f"a {sc.kind} scorer needs `path`: {what}")
    if sc.kind == "remote":
        need(
            bool(sc.url) and str(sc.url).startswith(("http://", "https://")),
            f"{path}.url",
            f"a remote scorer needs `url`, an http:// or https:// address, got {sc.url!r}",
        )
    need(math.isfinite(sc.weight), f"{path}.weight", f"must be a finite number, got {sc.weight}")
    need(sc.batch_size >= 1, f"{path}.batch_size", f"must be at least 1, got {sc.batch_size}")
    need(sc.batch_wait_s >= 0, f"{path}.batch_wait_s", f"must be at least 0, got {sc.batch_wait_s}")
    need(sc.timeout_s > 0, f"{path}.timeout_s", f"must be positive, got {sc.timeout_s}")
    need(sc.retries >= 0, f"{path}.retries", f"must be at least 0, got {sc.retries}")
    need(sc.replicas >= 1, f"{path}.replicas", f"must be at least 1, got {sc.replicas}")
    need(sc.procs >= 1, f"{path}.procs", f"must be at least 1, got {sc.procs}")
    alone = f"is {sc.procs}: only a prm shards its model over procs; a {sc.kind} scales by `replicas`: set procs=1"
    need(sc.procs == 1 or sc.kind == "prm", f"{path}.procs", alone)
    need(sc.max_len >= 8, f"{path}.max_len", f"must be at least 8 tokens, got {sc.max_len}")
    need(sc.max_new_tokens >= 1, f"{path}.max_new_tokens", f"must be at least 1, got {sc.max_new_tokens}")
    need(sc.unparsable is None or math.isfinite(sc.unparsable), f"{path}.unparsable", f"must be a finite number or null, got {sc.unparsable}")
    need(
        sc.kind != "judge" or sc.process == "none",
        f"{path}.process",
        "a judge scores whole episodes: use process=none, or a reward model, function or remote server for step scores",
    )
    need(sc.process != "step" or bool(sc.step_delimiter), f"{path}.step_delimiter", "process=step needs a delimiter that ends a step, e.g. '\\n'")
