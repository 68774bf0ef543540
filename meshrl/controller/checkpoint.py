"""What a run saves: checkpoints to resume from (RUN_DIR/checkpoints/) and Hugging Face
exports of the policy (RUN_DIR/hf/).

A checkpoint is the trainer's state (DCP, meshrl/trainer/checkpoint.py, under trainer/),
under PPO with a critic the critic's beside it (DCP, under critic/), and one
`step_N_loop_state.pt`: the version, the episode queue's state and the metrics history.
`latest` names the newest, and is written last, atomically, so a run killed while it
checkpoints resumes from the previous one.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import time

import torch

from meshrl.config import Config, ConfigError
from meshrl.errors import first_line
from meshrl.futures import bounded
from meshrl.trainer.checkpoint import checkpoint_step, fsync_tree, replace_dir, write_atomic

log = logging.getLogger("meshrl")

CHECKPOINT_FILE = "loop_state.pt"


def due(config: Config, version: int, last_checkpoint: float) -> bool:
    """Every trainer.checkpoint_every steps, or trainer.checkpoint_every_s seconds after the last one."""
    every, every_s = config.trainer.checkpoint_every, config.trainer.checkpoint_every_s
    return bool(every and version % every == 0 or every_s and time.monotonic() - last_checkpoint >= every_s)


async def save(
    run_dir: str,
    trainer,
    queue,
    version: int,
    history: list[dict],
    critic=None,
    partners=(),
    names=(),
    *,
    timeout_s: float = 120.0,
    keep: int = 0,
    alarms=(),
) -> tuple[str | None, int]:
    """Trainer state (DCP), the critic's (a CriticMesh, or None), each trained model's beside
    the policy (controller/partners.py, under its name), the episode queue and the metrics
    history, atomically, and the models' `names` in their order (config.model_names: the places
    a game's rows name): the loop state's path and the version it holds. Nothing (None) while
    a trained model is at another version than the policy (ahead of it while it trains again
    the steps its heal lost), or when one saved is at another version than the policy's (a step
    cut short beside the policy's): a checkpoint never holds trained models at different
    versions, and the next one due saves them. A critic is saved at its own version. The queue's
    state is asked for within `timeout_s` (a lost coordinator host says so, not the step's bound).
    Then all but the newest `keep` checkpoints are removed (`prune`; 0: none), except those the
    raised `alarms` (meshrl/stability.py's watches) name as the last good ones."""
    policy = max(version, trainer.version)  # (its trainer a step past the loop after an interrupted step)
    apart = [p.name for p in partners if p.trainer.version != policy]
    if apart:
        log.warning("checkpoint at version %d deferred: %s not at the policy's version (its heal took it back)", version, ", ".join(apart))
        return None, version
    root = os.path.join(run_dir, "checkpoints")
    trainer_dir = await trainer.save_checkpoint(os.path.join(root, "trainer"))
    # after its train step on the policy's last batch: the critic's version is the policy's
    critic_dir = await critic.save_checkpoint(os.path.join(root, "critic")) if critic is not None else None
    models = {p.name: await p.save_checkpoint(os.path.join(root, "models")) for p in partners}
    model_critics = {p.name: await p.critic.save_checkpoint(os.path.join(root, "models", f"{p.name}-critic")) for p in partners if p.critic is not None}
    # After an interrupted step the trainer may have finished a step the loop never saw (its
    # metrics row is lost, its weights are not); behind it, a heal under way took it back before
    # the loop and the queue heard: no whole state either way but the first.
    saved = checkpoint_step(trainer_dir)
    if saved < version:
        log.warning("checkpoint at version %d not kept: the trainer is at %d, a heal under way (the last whole one stays latest)", version, saved)
        return None, version
    version = saved
    # ...and a model beside it may not have (its step waited for a batch the interrupt took):
    # such a save would be torn, so `latest` keeps naming the last whole one. (A critic may be
    # behind: a heal that lost its last steps leaves it there, and it values on from there.)
    steps = {n: checkpoint_step(d) for n, d in models.items()}
    torn = [f"{n} at {s}" for n, s in steps.items() if s != version]
    if torn:
        behind = ", ".join(torn)
        log.warning("checkpoint at version %d not kept: %s (the last whole one stays latest)", version, behind)
        return None, version
    state = {
        "version": version,
        "trainer_dir": trainer_dir,
        "critic_dir": critic_dir,
        "models": models,
        "model_critics": model_critics,
        "model_names": list(names),
        "queue": await bounded(queue.state_dict.call_one(), timeout_s, "the episode queue, saving its state"),
        "history": history,
    }
    path = os.path.join(root, f"step_{version:06d}_{CHECKPOINT_FILE}")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    write_atomic(os.path.join(root, "latest"), os.path.basename(path))
    spare = {a.good_checkpoint for watch in alarms if watch is not None for a in watch.raised if a.good_checkpoint is not None}
    try:  # the checkpoint is written: a prune that fails is said, not the save's failure
        removed = prune(run_dir, keep, spare)
    except Exception as e:  # noqa: BLE001
        removed = []
        log.warning("older checkpoints not removed (trainer.keep_checkpoints): %s", first_line(str(e)) or type(e).__name__)
    for watch in filter(None, alarms):  # an alarm to come names a checkpoint still there
        watch.checkpoints = [step for step in watch.checkpoints if step not in removed]
    return path, version


_LOOP_STATE = re.compile(rf"^step_(\d+)_{re.escape(CHECKPOINT_FILE)}$")


def prune(run_dir: str, keep: int, spare=()) -> list[int]:
    """All but the newest `keep` checkpoints removed whole (trainer.keep_checkpoints; 0: none):
    each one's loop state first, so none names a state half gone, then the trained states (the
    trainer's, the critic's, each model's) no kept one names, inside `run_dir` only. The one
    `latest` names is always kept, and those of the steps in `spare` (an alarm's last good one);
    any past `latest`'s step (a resume sets them aside, `set_aside_later`) neither counted nor
    removed. Returns the steps removed."""
    if keep <= 0:
        return []
    root = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    steps = {f: int(m.group(1)) for f in os.listdir(root) if (m := _LOOP_STATE.match(f))}
    files = sorted((n for n in steps if steps[n] <= steps.get(latest, steps[n])), key=steps.get)
    kept = set(files[-keep:]) | {latest} | {n for n in files if steps[n] in spare} | (set(steps) - set(files))
    states = {name: here(torch.load(os.path.join(root, name), weights_only=False), root) for name in steps}
    named = lambda state: {p for p in (state["trainer_dir"], state["critic_dir"], *state["models"].values(), *state["model_critics"].values()) if p}  # noqa: E731
    held = set().union(*(named(states[name]) for name in kept))  # (absolute: `here` joins them to root)
    removed = []
    for name in files:
        if name in kept:
            continue
        os.remove(os.path.join(root, name))
        for path in named(states[name]) - held:
            if os.path.commonpath([root, os.path.abspath(path)]) == root:
                shutil.rmtree(path, ignore_errors=True)
        removed.append(steps[name])
    _sweep_unnamed(root, steps.get(latest, 0), held)
    return removed


_STATE_DIR = re.compile(r"^\.?(step-(\d+))(\.tmp|\.old)?$")


def _sweep_unnamed(root: str, below: int, held: set[str]) -> None:
    """A trained state no loop state names, of a step before `latest`'s, removed: a save not
    kept (torn, or deferred while a model was at another version) and a save's debris. Those
    at or past `latest`'s step, and each state root's own `latest`, stay."""
    models = os.path.join(root, "models")
    subs = [os.path.join(root, "trainer"), os.path.join(root, "critic")]
    subs += [os.path.join(models, d) for d in (os.listdir(models) if os.path.isdir(models) else ())]
    for sub in filter(os.path.isdir, subs):
        pointer = pathlib.Path(sub, "latest")
        own = pointer.read_text().strip() if pointer.is_file() else None
        for entry in os.listdir(sub):
            m = _STATE_DIR.match(entry)
            if m and int(m.group(2)) < below and m.group(1) != own and os.path.join(sub, m.group(1)) not in held:
                shutil.rmtree(os.path.join(sub, entry), ignore_errors=True)


def latest_state(run_dir: str) -> dict:
    """The loop state of the run's latest checkpoint (`checkpoints/latest` names its file)."""
    root = os.path.join(run_dir, "checkpoints")
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from ({latest} missing)")
    with open(latest) as f:
        state = torch.load(os.path.join(root, f.read().strip()), weights_only=False)
    return here(state, os.path.abspath(root))


def here(state: dict, root: str) -> dict:
    """The loop state's checkpoint paths under `root` (RUN_DIR/checkpoints), wherever the run
    was when it wrote them: a run moved aside (keep_earlier_run) or copied resumes from its own
    checkpoints, never from what now sits where it was."""

    def moved(path: str | None, parts: int) -> str | None:  # the last `parts` names: trainer/step-N, models/NAME/step-N
        return os.path.join(root, *os.path.normpath(path).split(os.sep)[-parts:]) if path else path

    state["trainer_dir"], state["critic_dir"] = moved(state.get("trainer_dir"), 2), moved(state.get("critic_dir"), 2)
    for key in ("models", "model_critics"):
        state[key] = {name: moved(path, 3) for name, path in (state.get(key) or {}).items()}
    return state


async def restore(run_dir: str, trainer, queue, watch=None, critic=None, *, timeout_s: float) -> tuple[int, list[dict]]:
    """Load the latest checkpoint into the trainer, the critic (a CriticMesh, under PPO with a
    critic) and the queue (its load bounded by `timeout_s`): its version and metrics history.
    `watch` (meshrl/stability.py's CliffWatch) picks up where it was, checkpoints included,
    silently. Every trained state's `latest` is pointed back at the one restored (`repoint`), and
    snapshots written past it are dropped, each state's past its own checkpoint."""
    root = os.path.join(run_dir, "checkpoints")
    state = latest_state(run_dir)
    version = await trainer.load_checkpoint(state["trainer_dir"])
    if version != state["version"]:
        raise RuntimeError(f"trainer checkpoint is at version {version}, loop state at {state['version']}")
    if critic is not None:
        if not state.get("critic_dir"):
            raise RuntimeError(
                f"{run_dir}'s checkpoint has no critic (written by a run without trainer.loss.advantage=gae): "
                "resume it with its own advantage, or start a new run"
            )
        await critic.load_checkpoint(state["critic_dir"])
    changed = await bounded(queue.load_state_dict.call_one(state["queue"]), timeout_s, "the episode queue, loading its checkpointed state")
    if changed:
        log.warning("%s", changed)
    repoint(state, run_dir)
    set_aside_later(root, version)
    from meshrl.trainer.critic_actor import critic_root  # (Monarch's actors: not for a resume's config check)
    from meshrl.trainer.snapshot import drop_after, snapshot_root

    # the previous run's snapshots past each state's checkpoint: never restored. A critic's may be
    # behind its model's (a heal lost its last step), and one without a checkpoint restores none
    critics = {"": state.get("critic_dir"), **(state.get("model_critics") or {})}
    for name in ("", *(state.get("models") or {})):
        trained = os.path.join(run_dir, "models", name) if name else run_dir
        drop_after(snapshot_root(trained), version)
        drop_after(snapshot_root(critic_root(trained)), checkpoint_step(critics[name]) if critics.get(name) else 0)
    history = state["history"]
    if watch is not None:
        saved = {int(name[5:11]) for name in os.listdir(root) if name.startswith("step_") and name.endswith(CHECKPOINT_FILE)}
        for row in history:
            if row.get("step") in saved:
                watch.checkpointed(int(row["step"]))
            watch.update(int(row.get("step", 0)), row)
    return version, history


def set_aside_later(root: str, version: int) -> str | None:
    """The loop states past `version`, the one a resume restored (a run sent back to an earlier
    checkpoint), moved to `checkpoints/abandoned-after-VERSION-TIME/` (returned; None: none): in
    place, they counted as the resumed run's own once it passed their steps (keep_checkpoints
    removed its saves and kept theirs) and an alarm could name one. Their states stay until `prune` sweeps them."""
    later = sorted(n for n in os.listdir(root) if (m := _LOOP_STATE.match(n)) and int(m.group(1)) > version)
    if not later:
        return None
    os.makedirs(aside := os.path.join(root, f"abandoned-after-{version:06d}-{time.strftime('%Y%m%d-%H%M%S')}"), exist_ok=True)
    for name in later:
        os.replace(os.path.join(root, name), os.path.join(aside, name))
    log.warning("the checkpoints after step %d (%s) moved to %s: this run went back from them", version, ", ".join(later), aside)
    return aside


def repoint(state: dict, run_dir: str) -> None:
    """Each trained state's `latest` names the checkpoint the loop state holds: a save cut short
    (an interrupt's deadline, a model's save failing after the policy's) may have moved some past
    it, and a heal restores what `latest` names. Only inside `run_dir` (another run's stays its own)."""
    dirs = [state["trainer_dir"], state.get("critic_dir"), *(state.get("models") or {}).values(), *(state.get("model_critics") or {}).values()]
    root = os.path.abspath(run_dir)
    for path in filter(None, dirs):
        if os.path.isdir(path) and os.path.commonpath([root, os.path.abspath(path)]) == root:
            write_atomic(os.path.join(os.path.dirname(path), "latest"), os.path.basename(path))


def saved_models(run_dir: str) -> dict[str, tuple[str, str | None]]:
    """The latest checkpoint's trained models beside the policy: {name: (their trainer
    checkpoint, their critic's, or None where they train without one)}."""
    state = latest_state(run_dir)
    critics = state.get("model_critics") or {}
    return {name: (path, critics.get(name)) for name, path in (state.get("models") or {}).items()}


def check_resumable(state: dict, config: Config, run_dir: str) -> None:
    """A resumed run trains the models its checkpoint holds, in the same places: a game's
    saved rows name each model by its place in `models` (frozen ones too), so one added,
    renamed, moved, no longer frozen or dropped since would train rows that are not its own.
    A model that now trains by gae needs its critic's state. Checked as the run's config is
    read (resume.resume_config), before any mesh starts."""
    trained, saved = [m.name for m in config.models if not m.frozen], list(state.get("models") or {})
    names = state.get("model_names")  # (None: written before checkpoints named them all)
    if names is not None and names != config.model_names() or saved != trained:
        held = ", ".join(names[1:] if names is not None else saved) or "none"
        now = ", ".join(m.name for m in config.models) if names is not None else ", ".join(trained)
        frozen = f" (trained: {', '.join(saved) or 'none'})" if names is not None and names == config.model_names() else ""
        why = f"{run_dir}'s checkpoint holds the models {held}{frozen}, and this config names {now or 'none'}"
        raise ConfigError("models", f"{why}: resume with the models it was written with, in the same order, frozen or trained as they were")
    modes, critics = config.advantage_modes(), state.get("model_critics") or {}
    if modes[0] == "gae" and not state.get("critic_dir"):
        raise ConfigError(
            "trainer.loss.advantage", f"{run_dir}'s checkpoint holds no critic (written without gae): resume with its own advantage, or start a new run"
        )
    for i, m in enumerate(config.models):
        if not m.frozen and modes[i + 1] == "gae" and m.name not in critics:
            field = f"models[{i}].trainer.loss.advantage"
            raise ConfigError(field, f"{run_dir}'s checkpoint holds no critic of {m.name}'s (written without gae): resume with its own advantage")
    from meshrl.scorers.prm import saved_prms

    prms = saved_prms(run_dir)
    for i, (name, sc) in enumerate(zip(config.scoring.scorer_names(), config.scoring.scorers)):
        if sc.kind == "prm" and prms and name not in prms:  # it would start again from its first weights, silently
            raise ConfigError(
                f"scoring.scorers[{i}].name", f"{run_dir} holds the trained state of the prm {', '.join(prms)}, not of {name!r}: name it as it was"
            )


def lora_base_dir(run_dir: str) -> str:
    """Where a from-scratch LoRA policy's frozen base weights are exported (its adapters'
    PEFT base): once per run, beside the versions."""
    return os.path.join(run_dir, "hf", "base")


async def export_hf(trainer, path: str, run_dir: str, tokenizer_dir: str) -> str:
    """The current policy as a Hugging Face checkpoint at `path`, with its tokenizer (and a
    LoRA policy's adapter), so that transformers, vLLM and `meshrl eval` load it alone. Whole
    or not at all: written beside `path`, then renamed over it (an export cut short, or
    failing, leaves the previous one as it was)."""
    from meshrl.tokenizer import load_tokenizer

    path = os.path.abspath(path)
    stage = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.export")
    shutil.rmtree(stage, ignore_errors=True)
    try:
        written = await trainer.export_hf(stage, lora_base_dir(run_dir))
        load_tokenizer(tokenizer_dir).save_pretrained(written)
        fsync_tree(written)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    replace_dir(written, path)
    return path


def start_export(run_dir: str, version: int) -> str:
    """Where a start exports the weights its generators begin from: `hf/vVERSION`. The exports of
    earlier starts (resumes) go, but `hf/v0`, the model the run began from: a preempted run
    resubmitted 20 times kept 20 whole copies of its model."""
    root = os.path.join(run_dir, "hf")
    keep = {"v0", f"v{version}"}
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if re.fullmatch(r"v\d+", name) and name not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return os.path.join(root, f"v{version}")


async def export_critic(critic, run_dir: str, tokenizer_dir: str, name: str = "final-critic") -> None:
    """PPO's critic at hf/NAME (a trained model's: final-MODEL-critic); one that fails is
    logged (its checkpoints keep its state) and the policy's export goes on."""
    try:
        await export_hf(critic, os.path.join(run_dir, "hf", name), run_dir, tokenizer_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("the critic's export failed (%s: %s); its state is in its checkpoints", type(e).__name__, first_line(str(e), 200))


async def export_scorers(scorers, run_dir: str, tokenizer_dir: str) -> list[dict]:
    """Each implicit PRM at hf/final-NAME with its tokenizer, and its pi_ref where the run
    exported it (ScorerPool.export_trained); each export's {"path", "reference", "version"}."""
    from meshrl.tokenizer import load_tokenizer

    hf_dir = os.path.join(run_dir, "hf")
    done = await scorers.export_trained(hf_dir)
    ours = [
        p for d in done for p in (d["path"], d["reference"]) if os.path.dirname(p) == os.path.abspath(hf_dir)
    ]  # a checkpoint the PRM started from keeps its own
    if ours:
        tokenizer = load_tokenizer(tokenizer_dir)  # read once for every directory it goes to
        for path in ours:
            tokenizer.save_pretrained(path)
    return done


def go_on(run_dir: str, version: int, saved: str | None) -> str:
    """How to go on from a run stopped at `version`: from that step's checkpoint (`saved`, its path), or (None: not kept
    while trained models were at different versions, `save`) from the newest one before it."""
    if saved:
        return f"continue from the checkpoint at step {version} with: meshrl run --resume {run_dir}"
    return f"{how_to_resume(run_dir)} (step {version}'s was not kept: its trained models were at different versions)"


def how_to_resume(run_dir: str) -> str:
    if os.path.isfile(os.path.join(run_dir, "checkpoints", "latest")):
        return f"resume from the last checkpoint with: meshrl run --resume {run_dir}"
    return "no checkpoint was written yet"


def keep_earlier(config: Config) -> None:
    """An earlier run in the config's run directory is moved aside, whole, before a new one starts there (`keep_earlier_run`), and the console says where."""
    from meshrl.logs import console

    kept = keep_earlier_run(config)
    if kept is not None:
        print(f"meshrl: {config.logging.run_dir} held an earlier run: kept whole in {kept}", file=console())


def keep_earlier_run(config: Config) -> str | None:
    """A new run (not `--resume`) whose RUN_DIR holds an earlier run (its config.yaml): that run
    is moved to RUN_DIR.YYYYmmdd-HHMMSS (when it last started) and kept whole, so that the new
    one neither cuts its metrics nor leaves its checkpoints where `--resume` would take them
    for its own. Returns where it went, None when there was none. ConfigError, before anything
    moved, where the new config reads a file in it or it cannot be moved."""
    run_dir = config.logging.run_dir
    marker = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(marker):
        return None
    held = hold_run_dir(run_dir)  # a live run's is not moved from under it
    if held is not None:
        os.close(held)
    inside = os.path.realpath(run_dir) + os.sep
    for field_path, value in config_strings(config.to_dict()):
        if os.path.exists(value) and os.path.realpath(value).startswith(inside):
            raise ConfigError(
                field_path, f"{value!r} lies in logging.run_dir, which holds an earlier run this new one would move aside: give it another logging.run_dir"
            )
    base = f"{os.path.abspath(run_dir).rstrip(os.sep)}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(os.path.getmtime(marker)))}"
    kept, n = base, 1
    while os.path.exists(kept):
        kept, n = f"{base}-{n}", n + 1
    try:
        os.rename(run_dir, kept)
    except OSError as e:
        raise ConfigError(
            "logging.run_dir",
            f"{run_dir!r} holds an earlier run that cannot be moved aside to {kept!r} ({e.strerror}): move it, or give this run another directory",
        ) from None
    return kept


RUN_LOCK = ".lock"


def hold_run_dir(run_dir: str) -> int | None:
    """A live run's hold on RUN_DIR (an exclusive lock on RUN_DIR/.lock, gone with its process):
    the descriptor to close when the run stops (None where the filesystem takes no locks; on
    a shared one the lock may bind one host only). ConfigError while another run or Session, in
    this process or another, holds it: a second run there (a notebook cell run again while the
    first Session lives) would move the live one's directory aside, or resume it, and the two
    would write their checkpoints into one place."""
    import fcntl

    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, RUN_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if not isinstance(e, BlockingIOError):  # a filesystem without locks (some network mounts): the run goes on unguarded
            log.warning("%s cannot be locked (%s): a second run there would not be refused", run_dir, e.strerror or type(e).__name__)
            return None
        why = "another meshrl run or Session holds it"
        raise ConfigError("logging.run_dir", f"{run_dir!r} is a live run's ({why}): stop that run first, or give this one another logging.run_dir") from None
    return fd


def config_strings(data, path: str = ""):
    """(dotted field path, value) of every string in a config's dict, lists' entries as `[i]`."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if isinstance(value, str):
            yield here, value
        else:
            yield from config_strings(value, here)
