"""The host plan: how many hosts each role's mesh gets, decided from the config alone
(`check_cpu_procs` alone reads this machine: its cores).

Pure: no Monarch, no network. One host holds every role; with more, the trainer and the
generators get disjoint hosts and the coordinator shares the first generator host.
"""

from __future__ import annotations

import math
import os

from meshrl.config import Config, ConfigError

ROLES = ("trainer", "generator", "coord")
SHARED_MESH = "hosts"
"""The mesh name when one host holds every role."""
SPARE_MESH = "spare"
"""The mesh of launcher.spare_hosts idle hosts a trainer whose host is lost moves to."""


def critic_gpus(config: Config) -> int:
    """GPUs PPO's critic holds: one per critic proc, beside a GPU trainer (trainer.loss.advantage=gae)."""
    return config.critic.procs if config.trainer.loss.advantage == "gae" and config.trainer.device != "cpu" else 0


def trainer_host_gpus(config: Config) -> int:
    """GPUs the trainer hosts hold: the policy's trainer ranks and its critic's, and each trained
    model's beside it (a frozen model trains nothing; its replicas are the generator hosts')."""
    views = [config, *(config.for_model(m.name) for m in config.models if not m.frozen)]
    return sum((0 if v.trainer.device == "cpu" else v.trainer.procs) + critic_gpus(v) for v in views)


def plan_hosts(config: Config) -> dict[str, int]:
    """Named host meshes and their host counts for `launcher.hosts` hosts.

    {"hosts": 1} for one host; else {"trainer": t, "generator": g} with t + g = hosts.
    Each role's procs must split evenly over its hosts (a generator replica's `tp` procs
    stay on one host), and launcher.spare_hosts must be able to take the trainer's, otherwise
    a ConfigError says what to change.
    """
    la = config.launcher
    hosts = la.working_hosts
    trainer_procs = config.trainer.procs
    generator_procs = config.generator.replicas * config.generator.tp
    if hosts == 1:
        _check_spares(config, None)
        return {SHARED_MESH: 1}
    if la.gpus_per_host > 0:  # (a CPU trainer's procs take a host's cores, still a host of their own)
        trainer_hosts = math.ceil(max(trainer_procs if config.trainer.device == "cpu" else 0, trainer_host_gpus(config)) / la.gpus_per_host)
    else:  # CPU hosts: share the hosts in proportion to the procs each role runs
        trainer_hosts = round(hosts * trainer_procs / (trainer_procs + generator_procs))
        trainer_hosts = min(max(trainer_hosts, 1), hosts - 1)
    generator_hosts = hosts - trainer_hosts
    if generator_hosts < 1:
        raise ConfigError(
            "launcher.hosts",
            f"{hosts} hosts leave none for the generators after {trainer_hosts} trainer hosts "
            f"({trainer_host_gpus(config) or trainer_procs} trainer-side procs, critics' and trained models' included, "
            f"at {la.gpus_per_host} GPUs per host): raise launcher.hosts",
        )
    if trainer_procs % trainer_hosts:
        raise ConfigError("trainer.procs", f"{trainer_procs} procs do not split evenly over {trainer_hosts} trainer hosts: use a multiple of {trainer_hosts}")
    if generator_procs % generator_hosts or (generator_procs // generator_hosts) % config.generator.tp:
        raise ConfigError(
            "generator.replicas",
            f"{config.generator.replicas} replicas x tp {config.generator.tp} do not split evenly over {generator_hosts} generator hosts "
            "(whole replicas per host): change generator.replicas or launcher.hosts",
        )
    if la.gpus_per_host > 0 and generator_procs // generator_hosts > la.gpus_per_host:
        raise ConfigError(
            "launcher.hosts",
            f"{generator_procs} generator procs need more than the {generator_hosts} hosts x {la.gpus_per_host} GPUs "
            "left after the trainer: raise launcher.hosts",
        )
    _check_spares(config, trainer_hosts)
    return {"trainer": trainer_hosts, "generator": generator_hosts}


def job_meshes(config: Config) -> dict[str, int]:
    """What the job holds: `plan_hosts`' meshes, plus the `SPARE_MESH` of launcher.spare_hosts
    idle hosts (checked there)."""
    meshes = plan_hosts(config)
    if config.launcher.spare_hosts:
        meshes[SPARE_MESH] = config.launcher.spare_hosts
    return meshes


def _check_spares(config: Config, trainer_hosts: int | None) -> None:
    """launcher.spare_hosts must be able to take the whole trainer mesh, on hosts of its own."""
    spares = config.launcher.spare_hosts
    if spares and trainer_hosts is None:
        raise ConfigError(
            "launcher.spare_hosts",
            "with launcher.hosts=1 the trainer shares its host with the episode queue, which a lost host takes with it: "
            "raise launcher.hosts to 2 or more, or set launcher.spare_hosts=0",
        )
    if spares and spares < trainer_hosts:
        raise ConfigError("launcher.spare_hosts", f"the trainer moves whole, onto as many spares as its {trainer_hosts} hosts: set it to {trainer_hosts}")


def role_meshes(meshes: dict) -> dict:
    """Map each role to its host mesh; the coordinator gets the first generator host."""
    if SHARED_MESH in meshes:
        return {role: meshes[SHARED_MESH] for role in ROLES}
    generator = meshes["generator"]
    return {"trainer": meshes["trainer"], "generator": generator, "coord": generator.slice(hosts=slice(0, 1))}


def check_cpu_procs(config: Config) -> None:
    """A run on this machine's CPUs alone (no GPU in its plan) gives each trainer rank and each
    generator replica's procs a core at least: more procs than the cores this process may use
    started, each importing torch and vLLM on a share of a core, until the start timed out."""
    cores = len(os.sched_getaffinity(0))
    roles = []
    for where, c in [("", config)] + [(f"models[{i}].", config.for_model(m.name)) for i, m in enumerate(config.models)]:
        roles += [(f"{where}trainer.procs", c.trainer.procs), (f"{where}generator.replicas", c.generator.replicas * c.generator.tp)]
    for field, procs in roles:
        if procs > cores:
            raise ConfigError(field, f"{procs} procs on this machine's {cores} cores, without a GPU: at most {cores} (a core each), or run on more hosts")
