"""The device plan: which GPUs every proc of every role holds, decided before any mesh starts.

    plan = plan_devices(config)          # ConfigError (field + fix) when it does not fit
    print(plan.table())                  # `meshrl config plan`
    plan.env("generator", 3)             # {"CUDA_VISIBLE_DEVICES": "4,5"}: set before the proc starts

Roles that hold devices: trainer ranks (one GPU each), generator replicas (`generator.tp`
GPUs each), the distillation teacher (one replica, `tp` GPUs), the scorers (one GPU per
reward model or judge replica, `scoring.scorers`), and each trained model beside the policy
(`models`: roles `NAME/trainer` and `NAME/generator`, from its own sections, after the
policy's roles; colocated, on the same GPUs as the policy's; a frozen one: its replicas alone). Hosts come from the host
plan (`hosts.py`): on one host every role shares its GPUs; on split hosts the trainer's
hosts hold the trainer ranks, the generator hosts the replicas (round-robin, as the
allocation spawns them), the teacher and the scorers on the first generator host (colocated:
scorers share the host's GPUs round-robin, resident while the trainer steps).

Each proc is started with `CUDA_VISIBLE_DEVICES` naming exactly its GPUs (by their index
on its host), so vLLM, its tensor-parallel workers and torch see only those, and every proc
uses its device 0. Procs that hold no GPU (episode queue, rollout workers) see none.
GPUs per host: `launcher.gpus_per_host`, else those this host has (local and process
launchers only: the controller's host is then the run's host).

Layouts (`placement`, resolved by `resolve_placement`):
- `disaggregated` (placement=split): every role on GPUs of its own; a plan that needs more
  GPUs than a host has is refused with the fields to change. A CPU trainer
  (`trainer.device=cpu`) holds no GPU and leaves them all to the generators.
- `colocated` (placement=colocate, one host): trainer rank r on GPU r, generator replica i on
  GPUs i*tp .. i*tp+tp-1, the same GPUs time-sliced (the loop sleeps the engines during a
  training step). It fits when trainer.procs and replicas x tp each fit the host's GPUs, for
  the policy and for each trained model beside it (laid out the same way, on the same GPUs).
Without GPUs the plan is `cpu`: no device is named, cores are pinned by `meshrl/pinning.py`.
Pure: the standard library and the config, no torch import and no CUDA initialisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from meshrl.config import Config, ConfigError
from meshrl.config.cpus import AUTO
from meshrl.config.hf import model_args_from_hf
from meshrl.launch.hosts import SHARED_MESH, critic_gpus, plan_hosts

DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
PLAN_ENV = "MESHRL_DEVICE_PLAN"
"""Set in every proc the plan placed on GPUs: its role and index (`generator 3`); it sees only its own GPUs and uses its device 0."""
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
"""Where NCCL's bootstrap sockets listen. NCCL reads it once per process, at its first
communicator (TorchTitan's or weight sync's, whichever comes first), so a one-machine plan
sets it in the GPU procs' environment before they start, unless the user set it."""


@dataclass(frozen=True)
class Slot:
    """One proc's place: its role and index, the host mesh and host it runs on, its GPUs."""

    role: str
    """`trainer` (index = rank), `generator` (index = replica), `teacher` or `scorer` (see scorer_slots)."""
    index: int
    mesh: str
    """The host mesh it is spawned on: `hosts` (one host), `trainer` or `generator`."""
    host: int
    """Which host of that mesh."""
    gpus: tuple[int, ...]
    """GPU indices on that host; empty on CPU."""


@dataclass
class DevicePlan:
    layout: str
    """`cpu`, `disaggregated` or `colocated`."""
    gpus_per_host: int
    hosts: dict[str, int]
    """The host plan: host mesh name -> hosts."""
    slots: list[Slot] = field(default_factory=list)
    placement: str = "split"
    """The resolved `placement`: `split` or `colocate` (on CPU too, where no GPU is named)."""
    one_machine: bool = True
    """Every host is this machine (`local`, `torchx` and `process` launchers): GPU procs' NCCL groups
    then listen on loopback. Otherwise (`workers`: `meshrl worker` names the interface;
    Slurm: NCCL_SOCKET_IFNAME as the cluster sets it) they listen where NCCL's default puts them."""
    stand_ins: bool = False
    """`launcher.kind=process` with several hosts: stand-ins on this one machine, stand-in host h
    (counted across host meshes) holding this machine's GPUs h*G .. h*G+G-1 (G = gpus_per_host),
    so no two of them number the same GPU from 0."""
    visible: list[str] | None = None
    """This machine's GPUs as the controller was given them (its `CUDA_VISIBLE_DEVICES`, e.g.
    `4,5` on a shared node), where every host is this machine: plan index i is `visible[i]`,
    so a proc never lands on another job's GPU. None: indices are the host's own."""

    def slot(self, role: str, index: int) -> Slot:
        for s in self.slots:
            if s.role == role and s.index == index:
                return s
        raise KeyError(f"no {role} {index} in the device plan")

    def env(self, role: str, index: int = 0) -> dict[str, str]:
        """The environment a proc of `role` starts with: its GPUs (none for roles that hold
        none, such as the queue and the rollout workers); empty on a CPU plan."""
        if self.layout == "cpu":
            return {}
        if role.rpartition("/")[2] not in ("trainer", "critic", "generator", "teacher", "scorer"):
            return {DEVICE_ENV: ""}
        gpus = [self.visible[i] if self.visible else str(i) for i in self._machine_gpus(self.slot(role, index))]
        env = {DEVICE_ENV: ",".join(gpus), PLAN_ENV: f"{role} {index}"}
        if self.one_machine and NCCL_IFNAME_ENV not in os.environ:
            env[NCCL_IFNAME_ENV] = "lo"
        return env

    def _machine_gpus(self, slot: Slot) -> list[int]:
        """A slot's GPUs as its machine numbers them (stand-in hosts share one machine)."""
        if not self.stand_ins:
            return list(slot.gpus)
        meshes = list(self.hosts)
        host = sum(self.hosts[m] for m in meshes[: meshes.index(slot.mesh)]) + slot.host
        return [host * self.gpus_per_host + i for i in slot.gpus]

    def envs(self, role: str, indices: list[int]) -> list[dict[str, str]]:
        return [self.env(role, i) for i in indices]

    def view(self, model: str) -> "DevicePlan":
        """The plan as trained model `model` sees it (`policy`: the policy's): its own slots,
        under the plain role names (`trainer`, `generator`), on the same hosts."""
        if model == "policy":
            mine = [s for s in self.slots if "/" not in s.role]
        else:
            mine = [replace(s, role=s.role.partition("/")[2]) for s in self.slots if s.role.startswith(model + "/")]
        return replace(self, slots=mine)

    def table(self) -> str:
        """The plan as a text table, one row per proc that holds devices."""
        head = f"device plan: {self.layout} (placement {self.placement}), {self.gpus_per_host} GPUs per host, host meshes " + ", ".join(
            f"{name}={n}" for name, n in self.hosts.items()
        )
        rows = [("role", "index", "host", "GPUs")]
        for s in self.slots:
            rows.append((s.role, str(s.index), f"{s.mesh}[{s.host}]", ",".join(map(str, s.gpus)) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        idle = self.idle()
        if idle:
            lines.append("idle GPUs: " + "; ".join(f"{mesh}[{h}]: {','.join(map(str, g))}" for (mesh, h), g in sorted(idle.items())) + self._idle_hint(idle))
        return "\n".join(lines) + "\n"

    def _idle_hint(self, idle: dict[tuple[str, int], list[int]]) -> str:
        """On one split host, the generator.replicas that would use the idle GPUs."""
        gens = [s for s in self.slots if s.role == "generator"]
        if self.layout != "disaggregated" or SHARED_MESH not in self.hosts or not gens:
            return ""
        more = len(idle[(SHARED_MESH, 0)]) // len(gens[0].gpus)
        return f" (generator.replicas={len(gens) + more} would use them)" if more else ""

    def idle(self) -> dict[tuple[str, int], list[int]]:
        """GPUs no proc holds, per (host mesh, host)."""
        if self.layout == "cpu":
            return {}
        used: dict[tuple[str, int], set[int]] = {}
        for s in self.slots:
            used.setdefault((s.mesh, s.host), set()).update(s.gpus)
        out = {}
        for mesh, n in self.hosts.items():
            for h in range(n):
                free = [g for g in range(self.gpus_per_host) if g not in used.get((mesh, h), set())]
                if free:
                    out[(mesh, h)] = free
        return out


def planned_gpu() -> bool:
    """Whether the device plan started this proc with GPUs of its own (PLAN_ENV set and
    CUDA_VISIBLE_DEVICES naming some): it then uses its device 0."""
    return PLAN_ENV in os.environ and bool(os.environ.get(DEVICE_ENV))


def visible_gpus() -> list[str] | None:
    """The GPUs `CUDA_VISIBLE_DEVICES` names, in its order (indices or UUIDs, up to the first
    invalid `-1`, as CUDA reads it); None when it is not set."""
    visible = os.environ.get(DEVICE_ENV)
    if visible is None:
        return None
    names = [d.strip() for d in visible.split(",")]
    return names[: names.index("-1")] if "-1" in names else [d for d in names if d]


def detected_gpus() -> int:
    """GPUs this process may use: those `CUDA_VISIBLE_DEVICES` names, else those the NVIDIA
    driver lists (read from /proc, so CUDA is not initialised here), else 0."""
    visible = visible_gpus()
    if visible is not None:
        return len(visible)
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
    except OSError:
        return 0


def gpus_per_host(config: Config) -> int:
    """`launcher.gpus_per_host`, else this host's GPUs where it is the run's (a TorchX job's too)."""
    la = config.launcher
    if la.gpus_per_host > 0 or la.kind not in ("local", "process", "torchx"):
        return la.gpus_per_host
    return detected_gpus()


def _split_gpus_needed(config: Config) -> int:
    """GPUs one host needs for every role on GPUs of its own."""
    t, gen = config.trainer, config.generator
    trainer = (0 if t.device == "cpu" else t.procs) + critic_gpus(config)
    views = [(m.frozen, config.for_model(m.name)) for m in config.models]  # a view has no models of its own; a frozen one: replicas alone
    models = sum(v.generator.replicas * v.generator.tp if frozen else _split_gpus_needed(v) for frozen, v in views)
    return trainer + gen.replicas * gen.tp + (gen.tp if config.distill.teacher else 0) + scorer_gpus(config) + models


def scorer_gpus(config: Config) -> int:
    """GPUs the scorer procs hold: one per reward model or judge replica, and an implicit PRM's beside a GPU trainer (a remote client none)."""
    return len(scorer_slots(config))


def scorer_slots(config: Config) -> list[tuple[int, int]]:
    """(scoring.scorers index, replica) of each scorer proc that holds a GPU: the device
    plan's `scorer` slots 0, 1, ... in this order. An implicit PRM trains: each of its `procs`
    holds one where the trainer does (on the host's cores beside a CPU trainer), its slots
    one after another."""
    prm = config.trainer.device != "cpu" and gpus_per_host(config) > 0
    kinds = ("reward_model", "judge", "prm") if prm else ("reward_model", "judge")
    return [(i, r) for i, s in enumerate(config.scoring.scorers) if s.kind in kinds for r in range(s.replicas) for _ in range(s.procs)]


# `placement=auto` on one CPU host colocates (every role all the cores, taking turns) when a
# training step is estimated at more than this many GFLOP, and splits the cores otherwise.
# Set between two runs measured on a 2-core host (benchmarks/README.md section 6), at about
# their geometric mean: the default 100K-parameter model (2.5 GFLOP a step by this estimate)
# ran faster split, trainer and engine overlapping; a 25M-parameter model with short answers
# (about 250 GFLOP a step, trainer-bound) ran 1.25x TRL colocated and 0.90x split, where the
# trainer had half the cores.
COLOCATE_ABOVE_GFLOP = 25.0


def trainer_gflop_per_step(config) -> float:
    """A training step's forward and backward, estimated: 6 x parameters x tokens, with
    every row at its longest (prompt allowance plus `generator.max_new_tokens` per turn),
    plus the KL reference's forward when there is one."""
    m = config.model
    if m.path is not None:
        try:
            m = model_args_from_hf(m.path)[0]
        except (OSError, ValueError, KeyError):  # preflight names what is wrong with the checkpoint
            pass
    head = m.dim // m.n_heads
    ffn = m.ffn_dim * (m.experts_top_k + 1 if m.moe else 1)  # active experts (and a shared one) for MoE
    per_layer = m.dim * head * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * ffn
    params = m.n_layers * per_layer + m.dim * m.vocab_size
    g = config.generator
    tokens = config.batch_groups * g.group_size * min(m.max_seq_len, 16 + g.max_new_tokens * config.rollout.max_turns)
    passes = 6 + (2 if config.trainer.loss.kl_coef > 0 else 0)
    return passes * params * tokens / 1e9


def resolve_placement(config: Config, gpus: int | None = None) -> tuple[str, str]:
    """(`split` or `colocate`, why): `config.placement`, with `auto` decided for `gpus` per host
    (None: `gpus_per_host(config)`). On GPUs: colocate on one host where the roles do not fit
    one each and do fit sharing (every trained model's too, none with a critic), split
    everywhere else (several hosts, a CPU trainer). On a host with no GPU: colocate only where
    it can be (one machine, a shared-memory weight handoff, cores not pinned by hand) and the
    trainer's step outweighs generating its batch."""
    c = config
    if c.placement != "auto":
        return c.placement, "set by placement"
    g = gpus_per_host(c) if gpus is None else gpus
    if c.launcher.working_hosts > 1 or c.distill.teacher or scorer_gpus(c):
        return "split", "several hosts, a distillation teacher or model scorers: each role on devices of its own"
    if c.models and g == 0:
        return "split", "several models: trainers and generators apart, each model's beside the policy's; placement=colocate takes turns on all"
    if c.trainer.loss.advantage == "gae":
        return "split", "PPO's critic trains beside the policy on a proc of its own"
    if g == 0:
        if c.launcher.kind not in ("local", "process"):
            return "split", "several hosts or a distillation teacher: each role on its own cores"
        if c.weight_sync.transport not in ("auto", "shm") or not c.trainer.cpus == c.generator.cpus == AUTO:
            return "split", "weight_sync.transport or the roles' cores are set by hand"
        gflop = trainer_gflop_per_step(c)
        if gflop > COLOCATE_ABOVE_GFLOP:
            return "colocate", (
                f"a training step is about {gflop:.0f} GFLOP, more than generating its batch: each role gets every core in turn; placement=split overlaps them"
            )
        return "split", (
            f"a training step is about {gflop:.1f} GFLOP: trainer and generators overlap on their own cores; placement=colocate takes turns on all of them"
        )
    if c.trainer.device == "cpu":
        return "split", "a CPU trainer leaves every GPU to the generators"
    if _split_gpus_needed(c) <= g:
        return "split", "every role fits GPUs of its own"
    views = [c, *(c.for_model(m.name) for m in c.models if not m.frozen)]
    if any(v.trainer.loss.advantage == "gae" or v.trainer.device == "cpu" for v in views):
        return "split", "a trained model's critic or CPU trainer: each role on devices of its own"
    served = [c.for_model(m.name).generator for m in c.models if m.frozen]
    if all(v.trainer.procs <= g and v.generator.replicas * v.generator.tp <= g for v in views) and all(v.replicas * v.tp <= g for v in served):
        return "colocate", "the roles do not fit GPUs of their own and do fit sharing them"
    return "split", "the roles fit neither apart nor sharing (the device plan says what to change)"


def resolve_transport(config: Config) -> str:
    """`weight_sync.transport` with `auto` decided: `collective` across hosts, and on one host
    when trainer and generators hold GPUs of their own (an NCCL broadcast between GPU buckets,
    no host hop); otherwise (one CPU host, or colocated on one GPU host) `shm`: the generators
    map the trainer's snapshot and nothing moves."""
    if config.weight_sync.transport != "auto":
        return config.weight_sync.transport
    if SHARED_MESH not in plan_hosts(config):
        return "collective"
    plan = plan_devices(config)
    return "collective" if plan.layout == "disaggregated" and weights_on_gpu(plan, "collective") else "shm"


def weights_on_gpu(plan: DevicePlan, transport: str) -> bool:
    """Whether versions stay in GPU memory (SyncSpec.on_gpu). `collective`: the trainer and
    the generators all hold GPUs (not on a CPU plan, nor with a CPU trainer beside GPU
    generators). `shm`: every replica is on trainer rank 0's one GPU (colocated there), the
    only GPU a CUDA IPC handle of rank 0's slot reaches; elsewhere the slot is host memory."""
    if plan.layout == "cpu" or not all(s.gpus for s in plan.slots if s.role in ("trainer", "generator")):
        return False
    if transport == "collective":  # NCCL needs its ranks on distinct GPUs: never a colocated plan
        return plan.layout == "disaggregated"
    publisher = plan.slot("trainer", 0).gpus
    return transport == "shm" and all(s.gpus == publisher for s in plan.slots if s.role == "generator")


def plan_devices(config: Config, gpus: int | None = None) -> DevicePlan:
    """The device plan of `config` with `gpus` per host (None: `gpus_per_host(config)`).
    Raises ConfigError naming the field to change when it does not fit."""
    g = gpus_per_host(config) if gpus is None else gpus
    hosts = plan_hosts(config)
    placement = resolve_placement(config, g)[0]
    if config.placement == "auto" and placement == "colocate" and config.weight_sync.transport not in ("auto", "shm"):
        # auto resolved to colocate: config.checks refuses the same for an explicit colocate
        raise ConfigError(
            "weight_sync.transport",
            f"placement auto colocates trainer and generators on this host's "
            f"{g} GPUs, where weights pass through shared memory, not {config.weight_sync.transport}: "
            "set auto or shm, or placement=split with more GPUs",
        )
    plan = _colocated(config, g, hosts) if g and placement == "colocate" else _split(config, g, hosts)
    plan.placement = placement
    plan.one_machine = config.launcher.kind in ("local", "torchx", "process")
    plan.stand_ins = config.launcher.kind == "process" and sum(hosts.values()) > 1
    if g and plan.one_machine:
        plan.visible = visible_gpus()
        have = len(plan.visible) if plan.visible is not None else detected_gpus()
        need = g * sum(hosts.values()) if plan.stand_ins else g
        if have and need > have:  # 0: no GPU seen here (a plan printed on a login node)
            raise ConfigError(
                "launcher.gpus_per_host",
                f"{sum(hosts.values())} stand-in hosts x {g} GPUs need {need} GPUs on this machine, "
                f"which has {have}: lower launcher.gpus_per_host or launcher.hosts",
            )
    return plan


def _split(config: Config, g: int, hosts: dict[str, int]) -> DevicePlan:
    t, gen = config.trainer, config.generator
    if g == 0 and t.device == "cuda":
        raise ConfigError("trainer.device", f"is cuda but no GPU was found ({_where(config)}): set launcher.gpus_per_host, or trainer.device=auto")
    plan = DevicePlan("disaggregated" if g else "cpu", g, hosts)
    taken: dict[tuple[str, int], int] = {}  # (mesh, host) -> GPUs handed out so far

    def take(role: str, index: int, mesh: str, host: int, n: int, field_path: str, why=lambda: _no_fit(config, hosts, g)) -> None:
        first = taken.get((mesh, host), 0) if g else 0
        if g and first + n > g:
            raise ConfigError(field_path, why())
        taken[(mesh, host)] = first + n
        plan.slots.append(Slot(role, index, mesh, host, tuple(range(first, first + n)) if g else ()))

    for r in range(t.procs):  # a CPU trainer (trainer.device=cpu) beside GPU generators holds none
        take("trainer", r, *_trainer_host(config, hosts, r), 0 if t.device == "cpu" else 1, "trainer.procs")
    if t.loss.advantage == "gae":  # PPO's critic: critic.procs on the trainer's first host, on the trainer's kind of device
        for r in range(config.critic.procs):
            take("critic", r, *_trainer_host(config, hosts, 0), 1 if critic_gpus(config) else 0, "critic.procs" if r else "trainer.procs")
    for i in range(gen.replicas):
        take("generator", i, *_generator_host(hosts, i), gen.tp, "generator.replicas")
    if config.distill.teacher:
        take("teacher", 0, *_generator_host(hosts, 0), gen.tp, "distill.teacher")
    for k in range(scorer_gpus(config)):  # reward models and judges, in scoring.scorers order
        take("scorer", k, *_generator_host(hosts, 0), 1, "scoring.scorers")
    for i, m in enumerate(config.models):  # each trained model beside the policy: its trainer ranks and replicas, after the policy's
        view = config.for_model(m.name)
        vt, vg, at = view.trainer, view.generator, f"models[{i}]"
        trains = 0 if m.frozen else (0 if vt.device == "cpu" else vt.procs) + critic_gpus(view)

        def why(name=m.name, at=at, held=dict(taken), need=trains + vg.replicas * vg.tp, frozen=m.frozen) -> str:
            return _no_fit_model(name, at, g, held, need, critic_gpus(view), frozen)

        if g == 0 and vt.device == "cuda" and not m.frozen:
            raise ConfigError(f"{at}.trainer.device", f"is cuda but no GPU was found ({_where(config)}): set launcher.gpus_per_host, or trainer.device=auto")
        if not m.frozen and vt.procs % (n := hosts.get("trainer", 1)):  # several hosts: laid out over the policy's trainer hosts
            raise ConfigError(f"{at}.trainer.procs", f"{vt.procs} procs do not split evenly over the {n} trainer hosts: use a multiple of {n}")
        for r in range(0 if m.frozen else vt.procs):  # a frozen model: its replicas alone
            take(f"{m.name}/trainer", r, *_trainer_host(view, hosts, r), 0 if vt.device == "cpu" else 1, f"{at}.trainer.procs", why)
        if vt.loss.advantage == "gae" and not m.frozen:  # its critic, as the policy's: on its trainer's first host
            for r in range(view.critic.procs):
                take(f"{m.name}/critic", r, *_trainer_host(view, hosts, 0), 1 if critic_gpus(view) else 0, f"{at}.trainer.procs", why)
        for k in range(vg.replicas):
            take(f"{m.name}/generator", k, *_generator_host(hosts, k), vg.tp, f"{at}.generator.replicas", why)
    return plan


def _colocated(config: Config, g: int, hosts: dict[str, int]) -> DevicePlan:
    """Trainer ranks and generator replicas on the same GPUs of the one host."""
    t, gen = config.trainer, config.generator
    if t.device == "cpu":
        raise ConfigError("placement", "colocate shares GPUs between trainer and generators, and trainer.device=cpu: set placement=split")
    if t.procs > g:
        raise ConfigError("trainer.procs", f"placement=colocate puts one trainer rank on each GPU, and the host has {g}: set trainer.procs={g} or fewer")
    if gen.replicas * gen.tp > g:
        raise ConfigError(
            "generator.replicas",
            f"placement=colocate puts generator.replicas={gen.replicas} x generator.tp={gen.tp} GPUs on a host of {g}: "
            f"set generator.replicas={max(1, g // gen.tp)}" + ("" if gen.tp <= g else f" and generator.tp={g}"),
        )
    for i, s in enumerate(config.scoring.scorers):  # a sharded PRM's ranks are one NCCL group: two on one GPU cannot start
        if s.kind == "prm" and s.procs > g:
            why = f"placement=colocate puts each of a prm's procs on a GPU of its own, and the host has {g}: set procs={g} or fewer"
            raise ConfigError(f"scoring.scorers[{i}].procs", why)
    slots = [Slot("trainer", r, SHARED_MESH, 0, (r,)) for r in range(t.procs)]
    slots += [Slot("generator", i, SHARED_MESH, 0, tuple(range(i * gen.tp, (i + 1) * gen.tp))) for i in range(gen.replicas)]
    # reward models, judges and a PRM's ranks share the GPUs too, round-robin (a PRM's on distinct ones); they stay resident (not slept)
    slots += [Slot("scorer", k, SHARED_MESH, 0, (k % g,)) for k in range(scorer_gpus(config))]
    for i, m in enumerate(config.models):  # each trained model beside the policy on the same GPUs, laid out as the policy's
        vt, vg, at = config.for_model(m.name).trainer, config.for_model(m.name).generator, f"models[{i}]"
        trainer = None if m.frozen else f"{at}.trainer.device" if vt.device == "cpu" else f"{at}.trainer.procs" if vt.procs > g else None
        if trainer or vg.replicas * vg.tp > g:
            why = f"placement=colocate lays model {m.name} out on the host's {g} GPUs as the policy's (a GPU trainer; ranks, replicas x tp within them)"
            raise ConfigError(trainer or f"{at}.generator.replicas", f"{why}: lower it, or set placement=split")
        slots += [Slot(f"{m.name}/trainer", r, SHARED_MESH, 0, (r,)) for r in range(0 if m.frozen else vt.procs)]
        slots += [Slot(f"{m.name}/generator", k, SHARED_MESH, 0, tuple(range(k * vg.tp, (k + 1) * vg.tp))) for k in range(vg.replicas)]
    return DevicePlan("colocated", g, hosts, slots, "colocate")


def _trainer_host(config: Config, hosts: dict[str, int], rank: int) -> tuple[str, int]:
    return (SHARED_MESH, 0) if SHARED_MESH in hosts else ("trainer", rank // (config.trainer.procs // hosts["trainer"]))  # spawn_procs fills hosts in order


def _generator_host(hosts: dict[str, int], replica: int) -> tuple[str, int]:
    return (SHARED_MESH, 0) if SHARED_MESH in hosts else ("generator", replica % hosts["generator"])  # Allocation.host: round-robin by index


def _where(config: Config) -> str:
    la = config.launcher
    return (
        f"launcher.gpus_per_host={la.gpus_per_host}"
        if la.gpus_per_host or la.kind not in ("local", "process")
        else f"{DEVICE_ENV}={os.environ.get(DEVICE_ENV)!r}"
        if DEVICE_ENV in os.environ
        else "no NVIDIA driver on this host"
    )


def _no_fit_model(name: str, at: str, g: int, held: dict[tuple[str, int], int], need: int, critic: int = 0, frozen: bool = False) -> str:
    """Why model `name` (config path `at`; `frozen`: replicas alone) finds no room beside the roles placed before it (`held`)."""
    used = ", ".join(f"{n} of the {g} GPUs of {mesh}[{h}]" for (mesh, h), n in held.items())
    ranks = "" if frozen else f"{at}.trainer.procs" + (" + its critic's critic.procs" if critic else "") + " + "
    return (
        f"{'frozen' if frozen else 'trained'} model {name} needs {need} GPUs ({ranks}{at}.generator.replicas x tp) beside what the policy's roles "
        f"and the models before it hold ({used}): lower them, raise launcher.gpus_per_host" + ("" if frozen else f", or set {at}.trainer.device=cpu")
    )


def _no_fit(config: Config, hosts: dict[str, int], g: int) -> str:
    t, gen = config.trainer, config.generator
    teacher = (gen.tp if config.distill.teacher else 0) + scorer_gpus(config)
    if SHARED_MESH in hosts:
        ranks = (0 if t.device == "cpu" else t.procs) + critic_gpus(config)
        need = ranks + gen.replicas * gen.tp + teacher
        room = max(0, (g - ranks - teacher) // gen.tp)
        if room >= 1:
            fix = f"generator.replicas={room}"
        elif g - gen.tp - teacher - critic_gpus(config) >= 1:
            fix = f"trainer.procs={g - gen.tp - teacher - critic_gpus(config)}"
        elif critic_gpus(config):  # PPO's critic is never colocated
            fix = "trainer.device=cpu (the trainer and the critic on the host's cores)"
        else:  # one GPU, or fewer than one trainer rank and one replica need
            fix = "placement=colocate (trainer and generators sharing the GPUs, time-sliced)"
        return (
            f"the plan needs {need} GPUs on one host (trainer.procs={ranks - critic_gpus(config)}"
            + (f" + the critic {critic_gpus(config)}" if critic_gpus(config) else "")
            + f" + generator.replicas={gen.replicas} x generator.tp={gen.tp}"
            f"{f' + the teacher and scorers {teacher}' if teacher else ''}), and the host has {g}: set {fix}, or raise launcher.hosts"
        )
    per_trainer_host = t.procs // hosts["trainer"] + critic_gpus(config)  # the critic: on the first
    per_gen_host = -(-gen.replicas // hosts["generator"]) * gen.tp + teacher
    return (
        f"{hosts['trainer']} trainer hosts x {per_trainer_host} GPUs and {hosts['generator']} generator hosts x {per_gen_host} GPUs "
        f"do not fit {g} GPUs per host: lower trainer.procs or generator.replicas, or raise launcher.hosts"
    )
