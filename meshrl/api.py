"""What users call: `meshrl.run(config)` and the interactive `meshrl.Session`.

    result = meshrl.run("configs/default.yaml")          # or a Config, or a dict
    print(result.run_dir, result.metrics[-1]["trainer/reward_mean"])

    with meshrl.Session(config) as s:                       # IPython: meshes live across cells
        s.step(5)
        s.set(lr=3e-4, max_lag=1)
        s.generate(["a:", "q:"])

A Session drives an `RLLoop` on its own event-loop thread, so every method is a plain
blocking call that works the same in scripts, IPython and Jupyter; every call is bounded.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Coroutine

from meshrl.config import Config
from meshrl.controller.live import Live
from meshrl.errors import TrainerFailed, first_line
from meshrl.logs import progress_bar
from meshrl.metrics import format_row, plot_run
from meshrl.preflight import check, preflight
from meshrl.resume import run_config
from meshrl.rollout.env import RewardFn

log = logging.getLogger("meshrl")
PROGRESS_KEYS = ("trainer/reward_mean", "trainer/loss", "trainer/staleness_max", "trainer/idle_frac")  # the trained batch's reward: every step has one


def progress_keys(config: Config) -> tuple[str, ...]:
    """The progress bar's metrics: the policy's, then each trained model's own reward in a game."""
    return PROGRESS_KEYS + tuple(f"{m.name}/trainer/reward_mean" for m in config.models if not m.frozen)


@dataclass
class RunResult:
    run_dir: str
    metrics: list[dict[str, float]]
    """One row per step, as written to RUN_DIR/metrics.jsonl."""
    checkpoint: str | None
    hf_export: str | None
    """The policy's Hugging Face export (RUN_DIR/hf/final)."""
    plot: str | None
    hf_exports: dict[str, str] = field(default_factory=dict)
    """Each trained model's beside the policy, by name (RUN_DIR/hf/final-NAME)."""


class Session:
    """A live run you drive step by step. Context manager; `stop()` always cleans up."""

    def __init__(
        self, config: Config | dict | str | None = None, *, resume: str | None = None, reward_fn: RewardFn | None = None, overrides: list[str] | None = None
    ):
        self.config = run_config(config, resume, overrides)
        preflight(self.config, reward_fn)  # a bad path, an unwritable run directory, bad data or user code fails here, before any mesh
        self._resume = resume is not None
        self._reward_fn = reward_fn
        self._interrupted = None  # the call a signal interrupted, left running
        self._stopped = False  # its thread is gone: a new Session goes on (resume=RUN_DIR)
        self._live = Live()
        self._thread_loop = self._live.thread_loop
        # A Session dropped without stop() (a notebook cell run again) stops its run when it is
        # collected: the finalizer holds `_live`, not the Session. At the interpreter's exit an
        # exit hook does, registered once the run has started so that it runs before Monarch's.
        self._finalizer = weakref.finalize(self, self._live.dropped)
        self._finalizer.atexit = False

    @property
    def loop(self):
        """The started run (`RLLoop`), None before start() and after stop()."""
        return self._live.run

    # ---- plumbing ---------------------------------------------------------------------------
    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._thread_loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            if future.done():  # the call itself raised TimeoutError (the same class since Python 3.11)
                raise
            future.cancel()
            raise TimeoutError(f"meshrl session call took over {timeout:.0f}s") from None
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C or SIGTERM: the call goes on in the session thread, so that a step in
            # flight can still finish before `save_on_interrupt` checkpoints.
            self._interrupted = future
            raise
        except BaseException:
            future.cancel()
            raise

    def _trainer_bound(self) -> float:
        """How long a trainer call (checkpoint, export) may take: the trainer's own bound."""
        return self.config.trainer.collective_timeout_s + 60

    def _step_bound(self) -> float:
        """How long one step may take: the batch's wait, the trainer's call (bounded by
        trainer.collective_timeout_s), a checkpoint after it and the rest."""
        return self.config.buffer.get_timeout_s + 2 * self.config.trainer.collective_timeout_s + 600

    def _settled(self):
        """The loop, once a step Ctrl-C left running has ended: never two at once, and neither
        a checkpoint, an export nor a knob's change beside it (a Ctrl-C here leaves it the one
        to wait for)."""
        loop, earlier = self._need(), self._interrupted
        if earlier is not None:
            try:
                earlier.result(self._step_bound())
            except Exception as e:  # noqa: BLE001 - its failure was never reported: the interrupt was
                if not earlier.done():
                    raise TimeoutError(f"the step Ctrl-C left running still runs after {self._step_bound():.0f}s") from None
                log.warning("the step Ctrl-C left running failed: %s", first_line(str(e)) or type(e).__name__)
        self._interrupted = None
        return loop

    def _need(self):
        if self._stopped:
            raise RuntimeError("this session was stopped: start a new one (meshrl.Session(resume=RUN_DIR) goes on from its checkpoint)")
        if self.loop is None:
            raise RuntimeError("the session is not started: call start() (or use `with Session(...) as s`)")
        return self.loop

    def __enter__(self) -> "Session":
        self.start()
        return self

    def __exit__(self, kind, error, tb) -> None:
        """Stops the run. Left by Ctrl-C or a scheduler's signal (not the user's own sys.exit),
        it first checkpoints as `meshrl.run` does: the step in flight finishes, within
        trainer.interrupt_checkpoint_timeout_s."""
        signal = isinstance(error, KeyboardInterrupt) or (isinstance(error, SystemExit) and isinstance(error.code, int) and error.code > 128)
        if signal and self.loop is not None and not self._stopped:
            from meshrl.controller.checkpoint import how_to_resume
            from meshrl.logs import console

            self.save_on_interrupt(self.config.trainer.interrupt_checkpoint_timeout_s)
            print(f"meshrl: interrupted at step {self.version}: {how_to_resume(self.run_dir)}", file=console())
        self.stop()

    # ---- the user's verbs --------------------------------------------------------------------
    def start(self) -> "Session":
        """Allocate meshes, start the trainer, generators, episode queue and rollout workers; rollouts begin."""
        if self.loop is not None:
            return self
        if self._stopped:
            self._need()  # raises: its thread is gone
        if self._live.starting():
            raise RuntimeError("the start an interrupt cut short is still stopping its procs: call start() again once it has")
        from meshrl.controller.checkpoint import hold_run_dir, keep_earlier
        from meshrl.controller.loop import RLLoop

        if self._live.held is None:  # (held: a start again after one cut short, in its own directory)
            if not self._resume:
                keep_earlier(self.config)
            self._live.held = hold_run_dir(self.config.logging.run_dir)  # until the run stops: no other run moves or resumes it
        loop = RLLoop(self.config, resume=self._resume, reward_fn=self._reward_fn)
        try:
            self._call(self._live.enter(loop))
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C or SIGTERM while the meshes start: the start cancelled stops what it started (start() may be called again)
            starting, self._interrupted = self._interrupted, None
            self._live.cancel_start(starting, loop)
            raise
        except Exception:
            self._live.release()  # its start failed and stopped what it started: the directory is free for a new Session
            raise
        atexit.register(self._live.at_exit)
        return self

    @property
    def version(self) -> int:
        return self._need().version

    @property
    def run_dir(self) -> str:
        return self._need().run_dir

    def step(self, n: int = 1, progress: bool = False) -> list[dict[str, float]]:
        """Train until the policy's version is `n` past where it was; returns each step's metric
        row. A healed trainer that lost a step trains it again: that version's row comes twice,
        the later one what the run kept (docs/healing.md)."""
        loop = self._settled()
        if loop.generators.paused:  # its batch would wait for resume() until buffer.get_timeout_s
            raise RuntimeError("generation is paused: call resume() first (a step's batch is generated)")
        loop.collect.last_step_end = time.monotonic()  # a step's wall time from when it was asked, not the time between cells
        rows = []
        bar = progress_bar(n) if progress else None
        try:
            goal = loop.version + n
            while loop.version < goal:
                try:  # a replacement that failed is tried again by the step's own checks, as one during a step is
                    self._call(loop.check_health(), 600)
                except TrainerFailed:  # the queue's host is gone: the run stops, resumably
                    raise
                except Exception as e:  # noqa: BLE001 - tried again by the step's own checks
                    log.warning("health check between steps failed: %s", first_line(str(e), 200) or type(e).__name__)
                before = loop.version
                row = self._call(loop.step(), self._step_bound())
                rows.append(row)
                if bar is not None:
                    bar.set_postfix_str(format_row(row, progress_keys(loop.config)))
                    bar.update(max(0, loop.version - before))
        finally:
            if bar is not None:
                bar.close()
        return rows

    def metrics(self) -> list[dict[str, float]]:
        """Every step's metrics so far."""
        return list(self._need().history)

    def buffer_state(self) -> dict[str, float]:
        """The episode queue's counters: groups ready, running and pending, staleness."""
        from meshrl.futures import awaited

        return self._call(awaited(self._need().queue.metrics.call_one()), 60)

    def pause(self) -> None:
        """Freeze generation (in-flight requests stay) until resume()."""
        from meshrl.controller import control

        self._call(control.pause_generation(self._need()), 120)

    def resume(self) -> None:
        from meshrl.controller import control

        self._call(control.resume_generation(self._need()), 120)

    def generate(self, prompts: list[str], temperature: float | None = None) -> list[list[str]]:
        """Sample a group of completions for each prompt text with the current policy."""
        from meshrl.controller import control

        return self._call(control.generate_text(self._need(), prompts, temperature), 600)

    def set(self, **knobs: Any) -> None:
        """Change knobs between steps: lr, max_lag (the staleness bound)."""
        from meshrl.controller import control

        self._call(control.set_knobs(self._settled(), **knobs), 120)

    def scale_generators(self, replicas: int) -> None:
        """Grow or shrink the number of generator replicas."""
        from meshrl.controller import control

        self._call(control.scale_generators(self._settled(), replicas), self.config.generator.startup_timeout_s * max(1, replicas) + 120)

    def sync_generators(self) -> None:
        """Wait until every generator replica runs the trainer's current version."""
        from meshrl.controller import control
        from meshrl.generator.service import update_bound_s

        loop = self._settled()  # each model's update in turn at most, and a replica replaced in one
        self._call(control.wait_for_generators(loop), update_bound_s(self.config) * (1 + len(loop.partners)) + self.config.generator.startup_timeout_s)

    def evaluate(self) -> dict[str, float] | None:
        """Evaluate the current policy on the held-out prompts (eval.*) now; its `eval/` metrics,
        also written to the run's metrics (None if it failed: see the log). ConfigError on
        eval.source where nothing is held out (a file or dataset source without one)."""
        from meshrl.controller.evaluation import eval_timeout_s

        loop = self._settled()
        if loop.generators.paused:
            raise RuntimeError("generation is paused: call resume() first (an evaluation is generated)")
        return self._call(loop.evaluations.now(loop.version), 2 * eval_timeout_s(self.config, self.config.eval.num_prompts) + 60)

    def export(self, path: str) -> str:
        """Write the current policy as a Hugging Face checkpoint directory; returns its path. The
        directory is replaced whole, so one holding anything but an earlier export (its
        config.json) is refused, as are the run's own directory, one above it or in it (its
        exports and checkpoints), and one holding a path the config reads (`model.path`, the
        tokenizer, a teacher's or a scorer's checkpoint)."""
        from meshrl.controller.checkpoint import config_strings

        loop = self._settled()
        out, run = os.path.abspath(os.path.expanduser(path)), os.path.abspath(loop.run_dir)

        def holds(inner: str) -> bool:
            return inner == out or inner.startswith(out.rstrip(os.sep) + os.sep)

        if holds(run) or out.startswith(run + os.sep):
            raise ValueError(f"export to {path!r} would replace the run's own directory ({run}) or what it keeps there: name a directory outside it")
        for field_path, value in config_strings(self.config.to_dict()):
            if os.sep in value and holds(os.path.abspath(os.path.expanduser(value))):
                raise ValueError(f"export to {path!r} would replace {field_path} ({value}), which the run reads: name a directory of its own")
        if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
            raise ValueError(f"{path!r} holds files that are not a Hugging Face checkpoint, and an export replaces it whole: name a new directory")
        return self._call(loop.export_to(out), self._trainer_bound())

    def checkpoint(self) -> str | None:
        """The run's state now (None: deferred while trained models are ahead of a policy its heal took back)."""
        return self._call(self._settled().checkpoint(), self._trainer_bound())

    def save_on_interrupt(self, timeout_s: float) -> str | None:
        """After Ctrl-C or SIGTERM: let the interrupted step finish if it can within half of
        `timeout_s` (otherwise close the queue, so the trainer stops waiting for a batch),
        then checkpoint, all within `timeout_s`. Returns the checkpoint, None if none was
        written in time."""
        from meshrl.futures import awaited

        loop, deadline = self._need(), time.monotonic() + timeout_s
        step, self._interrupted = self._interrupted, None
        if step is not None and not step.done():
            try:
                step.result(timeout_s / 2)
            except BaseException:  # noqa: BLE001 - a step that fails or times out is given up
                pass
            if not step.done():
                try:
                    self._call(awaited(loop.queue.close.call_one()), 10)
                    step.result(max(1.0, deadline - time.monotonic()))
                except BaseException:  # noqa: BLE001
                    pass
        try:
            return self._call(loop.checkpoint(heal=False), max(1.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - reported by the caller as "no checkpoint"
            log.warning("no checkpoint written on interrupt: %s", first_line(str(e), 200) or type(e).__name__)
            return None

    def finish(self) -> RunResult:
        """Final checkpoint, Hugging Face export and curves."""
        loop = self._settled()
        from meshrl.controller.evaluation import eval_timeout_s

        goal, bound = loop.version, 2 * eval_timeout_s(self.config, self.config.eval.num_prompts) + 60
        while True:  # a trainer healed inside the checkpoint lost a step: trained again, its evaluation of the weights exported waited for
            try:  # the last step's evaluation waits for the one before it; one that never ends still leaves the checkpoint and export
                self._call(loop.evaluations.finish(goal), bound)
            except TimeoutError as e:
                log.warning("the last evaluation did not finish: %s", e)
            except (KeyboardInterrupt, SystemExit):  # no step to wait for: the checkpoint gets the interrupt's time (a resume evaluates again)
                self._interrupted, evaluation = None, self._interrupted
                if evaluation is not None:
                    evaluation.cancel()
                raise
            ckpt = self._call(loop.checkpoint(), self._trainer_bound())
            if loop.version >= goal:
                break
            self.step(goal - loop.version)
        hf = self._call(loop.export(), self._trainer_bound())
        png = plot_run(loop.run_dir) if self.config.logging.plot and loop.history else None
        return RunResult(loop.run_dir, list(loop.history), ckpt, hf, png, {p.name: p.export_dir(loop.run_dir) for p in loop.partners})

    def stop(self) -> None:
        """Shut every mesh and engine down; safe to call twice. A Ctrl-C or SIGTERM that comes
        meanwhile does not cut it short (procs would outlive the run, and a failure being
        reported would give way to a bare exit): the shutdown, bounded part by part, finishes."""
        self._finalizer.detach()
        atexit.unregister(self._live.at_exit)
        self._live.stop()
        self._stopped = True


def run(
    config: Config | dict | str | None = None, *, resume: str | None = None, reward_fn: RewardFn | None = None, overrides: list[str] | None = None
) -> RunResult:
    """Train to `config.steps` and return the run directory and per-step metrics."""
    checked = run_config(config, resume, overrides)
    if checked.launcher.dry_run:
        from meshrl.launch import describe_job

        check(checked)  # a dry run starts nothing: no run directory to write, no model to load
        print(describe_job(checked))
        return RunResult(os.path.abspath(checked.logging.run_dir), [], None, None, None)
    config, overrides = (checked, None) if resume is None else (config, overrides)
    session = Session(config, resume=resume, reward_fn=reward_fn, overrides=overrides)
    try:
        try:
            session.start()
        except (KeyboardInterrupt, SystemExit) as stop:
            if isinstance(stop, SystemExit) and not (isinstance(stop.code, int) and stop.code > 128):
                raise  # sys.exit in the user's code, not a signal's (meshrl.launch.signals)
            raise StartInterrupted(stop) from None
        remaining = session.config.steps - session.version
        try:
            if remaining > 0:
                session.step(remaining, progress=session.config.logging.progress)
            return session.finish()  # (its evaluation, checkpoint and export may take minutes: a signal there checkpoints too)
        except (KeyboardInterrupt, SystemExit) as stop:
            ckpt = session.save_on_interrupt(session.config.trainer.interrupt_checkpoint_timeout_s)
            raise Interrupted(session.run_dir, session.version, ckpt, stop) from None
    finally:
        session.stop()


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C or a signal while the run's meshes started: what had started is stopped, nothing of this start trained."""

    def __init__(self, cause: BaseException):
        self.exit_status = cause.code if isinstance(cause, SystemExit) and isinstance(cause.code, int) else 130
        super().__init__("interrupted while starting")


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM, after checkpointing what it could."""

    def __init__(self, run_dir: str, version: int, checkpoint: str | None, cause: BaseException):
        self.run_dir, self.version, self.checkpoint = run_dir, version, checkpoint
        self.exit_status = cause.code if isinstance(cause, SystemExit) and isinstance(cause.code, int) else 130
        super().__init__(f"interrupted at step {version}")
