"""The `meshrl` command line.

    meshrl run [CONFIG.yaml] [section.field=value ...] [--resume RUN_DIR | --auto-resume [JOB_ID]]
    meshrl config show [CONFIG.yaml] [section.field=value ...]
    meshrl config plan [CONFIG.yaml] [section.field=value ...]   # the device plan (also: meshrl run --plan)
    meshrl config docs [--check FILE]
    meshrl eval RUN_DIR|CHECKPOINT [CONFIG.yaml] [section.field=value ...] [--out DIR]
    meshrl plot RUN_DIR [--out FILE.png]
    meshrl worker --address IP:PORT          # serve this host to a launcher.kind=workers run
    meshrl doctor [--keep DIR]               # try every path this machine can take; one table

Bad input (unknown key, wrong type, impossible sizes, missing paths; a data row without its
prompt, an env or reward function that breaks its contract: docs/contracts.md) prints one
line on stderr naming the field or the file and line, and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

from meshrl import collector
from meshrl.config import Config, ConfigError, apply_overrides, load_yaml, reference_markdown
from meshrl.errors import first_line
from meshrl.logs import console, quiet_console, restore_terminal, verbose
from meshrl.metrics import trained_models
from meshrl.preflight import check, preflight

USAGE_ERROR = 2


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional config path (first argument without '=') and the overrides."""
    path, overrides = None, []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = arg
        else:
            raise ConfigError("", f"unexpected argument {arg!r}: give one config file, then section.field=value overrides")
    return path, overrides


def load_config(args: list[str]) -> Config:
    path, overrides = _split(args)
    data = load_yaml(path) if path else {}
    return Config.from_dict(apply_overrides(data, overrides))


def _cmd_config_show(ns: argparse.Namespace) -> int:
    config = load_config(ns.args)
    check(config)  # an unknown task, a missing extra or a bad import path: one line, exit 2
    print(config.to_yaml(), end="")
    return 0


def _cmd_config_plan(ns: argparse.Namespace) -> int:
    from meshrl.launch.devices import plan_devices
    from meshrl.launch.memory import plan_memory

    config = load_config(ns.args)
    check(config)
    devices = plan_devices(config)
    print(devices.table(), end="")
    memory = plan_memory(config, plan=devices)
    if memory is not None:
        print(memory.table(), end="")
    elif devices.layout != "cpu":
        print("memory plan: set launcher.gpu_memory_gib (the GPUs' memory) to see what each proc will hold")
    return 0


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from meshrl.doctor import run_doctor, table

    t0 = time.monotonic()
    rows = run_doctor(ns.keep)
    print(table(rows), end="")
    failed = [r.path for r in rows if r.status == "failed"]
    print(
        f"meshrl doctor: {len(rows) - len(failed)} of {len(rows)} paths passed or skipped in {time.monotonic() - t0:.0f}s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def _cmd_config_docs(ns: argparse.Namespace) -> int:
    text = reference_markdown() + "\n"
    if ns.check:
        if not os.path.isfile(ns.check):
            raise ConfigError("--check", f"{ns.check} is not a file: write it first with `meshrl config docs > {ns.check}`")
        with open(ns.check) as f:
            if f.read() != text:
                print(f"meshrl: {ns.check} is out of date: regenerate it with `meshrl config docs > {ns.check}`", file=sys.stderr)
                return 1
        return 0
    print(text, end="")
    return 0


def _cmd_run(ns: argparse.Namespace) -> int:
    from meshrl.resume import resume_config

    if ns.plan:
        if ns.resume:
            raise ConfigError("--plan", "prints the plan of a config: pass the config and overrides, not --resume")
        return _cmd_config_plan(ns)
    path, overrides = _split(ns.args)
    overrides += ["logging.verbose=true"] if ns.verbose else []
    if ns.auto_resume is not None:
        if ns.auto_resume.endswith((".yaml", ".yml")) or "=" in ns.auto_resume:
            raise ConfigError("--auto-resume", f"takes a job id, not {ns.auto_resume!r}: put the config and overrides before it")
        if ns.resume:
            raise ConfigError("--auto-resume", "resumes the config's own run directory: pass the config, not --resume")
        run_dir = load_config([path, *overrides] if path else overrides).logging.run_dir
        if last_checkpoint_step(run_dir) is not None and ns.auto_resume in (ANY_JOB, _job_of(run_dir)):  # a retry: continue
            ns.resume, path = run_dir, None
    if ns.resume:
        if path is not None:
            raise ConfigError("--resume", "a resumed run uses RUN_DIR/config.yaml: pass only overrides with --resume")
        config = resume_config(ns.resume, overrides)
    else:
        config = load_config([path, *overrides] if path else overrides)
    preflight(config)  # bad inputs end here, in one line, before any output is redirected
    if not ns.resume and not config.launcher.dry_run:
        from meshrl.controller.checkpoint import keep_earlier  # (torch: once the run is to start)

        keep_earlier(config)  # before this run's log goes there
        if ns.auto_resume not in (None, ANY_JOB):  # the job this run is, for its retries to know it by
            os.makedirs(config.logging.run_dir, exist_ok=True)
            with open(os.path.join(config.logging.run_dir, JOB_FILE), "w") as f:
                f.write(ns.auto_resume)
    loud = verbose(config) or config.launcher.dry_run  # a dry run's output is the job description
    out = sys.stderr if loud else quiet_console(config.logging.run_dir)
    if not loud:  # nanobind's leak report at exit goes to the log
        collector.no_collection_at_exit()
    run_dir = os.path.abspath(config.logging.run_dir)
    where = "" if loud else f"; library output in {os.path.join(run_dir, 'logs')} (--verbose shows it here)"
    what = f"resuming {run_dir}" if ns.resume else f"training {path or 'the embedded default'} in {run_dir}"
    if not config.launcher.dry_run:  # a dry run trains nothing: its job description says what it would do
        print(f"meshrl: {what}{where}", file=out)

    from meshrl.api import Interrupted, StartInterrupted, run
    from meshrl.errors import RunFailed, one_line

    start = time.monotonic()
    try:
        result = run(resume=ns.resume, overrides=overrides) if ns.resume else run(config)
    except (RunFailed, TimeoutError) as e:
        print(f"meshrl: run failed: {e}", file=out)
        return 1
    except Interrupted as e:
        from meshrl.launch.slurm import allocation_signaled

        last = last_checkpoint_step(e.run_dir)
        if e.checkpoint:
            how = f"checkpoint at step {e.version}; continue with: meshrl run --resume {e.run_dir}"
        elif last is not None:  # the procs went with the allocation (a lost node): the periodic checkpoint stands
            how = f"no checkpoint could be written in time; the last is at step {last}: continue from it with: meshrl run --resume {e.run_dir}"
        else:
            how = "no checkpoint could be written in time"
        by = "Slurm's SIGTERM to the allocation" if allocation_signaled() else _stopped_by(e.exit_status)
        print(f"meshrl: stopped at step {e.version} by {by}: {how}", file=out)
        if allocation_signaled() and last is not None:
            _resubmit(config, e.run_dir, ns.verbose, out)  # returns only when no resubmission is left
        return e.exit_status
    except StartInterrupted as e:  # nothing of this start trained
        from meshrl.launch.slurm import allocation_signaled

        by = "Slurm's SIGTERM to the allocation" if allocation_signaled() else _stopped_by(e.exit_status)
        print(f"meshrl: stopped while starting by {by}; nothing trained in this start", file=out)
        if allocation_signaled() and last_checkpoint_step(run_dir) is not None:
            _resubmit(config, run_dir, ns.verbose, out)  # returns only when no resubmission is left
        return e.exit_status
    except (KeyboardInterrupt, SystemExit) as e:  # a second interrupt or signal while the first one's checkpoint was written
        if isinstance(e, SystemExit) and not (isinstance(e.code, int) and e.code > 128):
            raise  # not a signal's (meshrl.launch.signals)
        status, last = (e.code if isinstance(e, SystemExit) else 130), last_checkpoint_step(run_dir)
        how = (
            f"the last checkpoint is at step {last}: continue from it with: meshrl run --resume {run_dir}" if last is not None else "no checkpoint was written"
        )
        print(f"meshrl: stopped again while checkpointing, by {_stopped_by(status)}; {how}", file=out)
        return status
    except ConfigError:
        raise  # one line and exit 2, from main()
    except Exception as e:  # noqa: BLE001 - one line here, the traceback in the controller's log
        traceback.print_exc()  # to stderr: RUN_DIR/logs/controller.log unless --verbose
        line = one_line(e)  # the user's code failing in an actor: its own line, not Monarch's text
        if line is not None:
            print(f"meshrl: run failed: {line}", file=out)
            return 1
        first = first_line(str(e))
        where = "above" if loud else os.path.join(run_dir, "logs", "controller.log")
        print(f"meshrl: run failed: {type(e).__name__}: {first} (traceback: {where})", file=out)
        return 1
    if not config.launcher.dry_run:
        print(summary_line(result, time.monotonic() - start), file=out)
    return 0


ANY_JOB = "any"
"""`--auto-resume` without a job id: resume whatever run the directory holds."""
JOB_FILE = "job_id"
"""RUN_DIR/job_id: the `--auto-resume JOB_ID` that started the run (a retry of that job resumes it)."""


def _job_of(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, JOB_FILE)) as f:
            return f.read().strip()
    except OSError:
        return None


def _stopped_by(exit_status: int) -> str:
    """What stopped a run that exits with `exit_status`: an interrupt for 130 (Ctrl-C), else
    the signal a 128+N status stands for (SIGTERM for 143)."""
    if exit_status == 130:
        return "an interrupt"
    try:
        return signal.Signals(exit_status - 128).name
    except ValueError:
        return f"signal {exit_status - 128}"


def last_checkpoint_step(run_dir: str) -> int | None:
    """The step of RUN_DIR's latest checkpoint (what `--resume` continues from), None if none."""
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            name = f.read().strip()  # step_000012_loop_state.pt
        return int(name.split("_")[1])
    except (OSError, IndexError, ValueError):
        return None


RESUBMITS_ENV = "MESHRL_RESUBMITS"
"""How many times this run's controller has resubmitted itself after a Slurm signal."""


def _resubmit(config: Config, run_dir: str, loud: bool, out) -> None:
    """Slurm signaled the allocation and the run checkpointed: while `launcher.max_resubmits`
    allows, replace this process by `meshrl run --resume RUN_DIR`, which submits a fresh
    allocation and continues with the same step numbering (its allocation was released
    already). A fresh process, not a second run in this one: Monarch's client state from the
    released allocation goes with it."""
    done = int(os.environ.get(RESUBMITS_ENV, "0"))
    if done >= config.launcher.max_resubmits:
        return
    print(
        f"meshrl: resubmitting ({done + 1} of launcher.max_resubmits={config.launcher.max_resubmits}): "
        f"a fresh allocation continues {run_dir} from its checkpoint",
        file=out,
    )
    for stream in (out, sys.stdout, sys.stderr):
        stream.flush()
    restore_terminal()  # the next process's console is the terminal again, not this one's log
    os.environ[RESUBMITS_ENV] = str(done + 1)
    os.execv(sys.executable, [sys.executable, "-m", "meshrl", "run", "--resume", run_dir, *(["--verbose"] if loud else [])])


def summary_line(result, wall_s: float) -> str:
    """Steps, the batches' reward at the first and last step, throughput, results. The
    reward is `buffer/sampled_reward_mean` (the trained batch plus the groups dynamic
    sampling dropped while it filled), else `trainer/reward_mean`: every step trains a batch
    and has one, while `reward/mean` covers only the episodes that finished during the step.
    With models beside the policy, each model's own `trainer/reward_mean`, the policy's too:
    the same measure for every model (the others have no sampled reward of their own)."""
    rows = [r for r in result.metrics if "trainer/reward_mean" in r]
    if not rows:
        return f"meshrl: no step trained; results in {result.run_dir}"
    first, last = rows[0], rows[-1]
    others = trained_models(last)

    def reward(row) -> float:
        return row["trainer/reward_mean"] if others else row.get("buffer/sampled_reward_mean", row["trainer/reward_mean"])

    samples = sum(r.get("trainer/seqs", 0.0) for r in result.metrics)
    train_s = sum(r.get("time/step_s", 0.0) for r in result.metrics)
    rate = f", {samples / train_s:.1f} samples/s" if train_s > 0 and samples else ""
    alarms = sum(1 for r in result.metrics for k in r if k.startswith("alarm/") or "/alarm/" in k)  # NAME/alarm/KIND: a model's
    warned = f"; {alarms} alarm(s) raised (see above)" if alarms else ""

    def own(name: str) -> str:  # from the first step that has it
        key = f"{name}/trainer/reward_mean"
        since = next(r for r in rows if key in r)
        return f", {name}'s {since[key]:.3f}" + (f" (step {int(since['step'])})" if since is not first else "") + f" -> {last[key]:.3f}"

    theirs = "".join(own(name) for name in others)
    return (
        f"meshrl: step {int(last['step'])} reached in {wall_s:.0f} s{rate}; reward {reward(first):.3f} "
        f"(step {int(first['step'])}) -> {reward(last):.3f} (step {int(last['step'])}){theirs}{warned}; "
        f"results in {result.run_dir} (metrics.jsonl, curves.png, hf/final)"
    )


def _cmd_eval(ns: argparse.Namespace) -> int:
    """Evaluate a run's final export (or any Hugging Face checkpoint) on the held-out prompts
    of the run's config (eval.*), with one generator replica and one rollout worker."""
    import asyncio

    from meshrl.controller.evaluation import evaluate_checkpoint, resolve_target, write_results

    run_dir, checkpoint = resolve_target(ns.target)
    path, overrides = _split(ns.args)
    for key in (o.split("=", 1)[0] for o in overrides):  # what it sets itself would replace the override without a word
        for field, why in (
            ("logging.run_dir", "give --out DIR"),
            ("launcher", "it runs on this host"),
            ("generator.replicas", "it runs one"),
            ("generator.cpus", "it pins none"),
        ):
            if key == field or key.startswith(field + "."):
                raise ConfigError(key, f"meshrl eval sets it ({why}): drop the override")
    if path is None and run_dir is not None:
        path = os.path.join(run_dir, "config.yaml")
    data = apply_overrides(load_yaml(path) if path else {}, overrides)
    for section in ("eval", "logging", "generator"):  # filled in below: a section written as a value is said as `run` says it
        data[section] = {} if data.get(section) is None else data[section]  # (written empty: its defaults, as `run` reads it)
        if not isinstance(data[section], dict):
            raise ConfigError(section, f"must be a mapping of fields, got {type(data[section]).__name__} {data[section]!r}")
    data["eval"]["every"] = data["eval"].get("every") or 1  # validates the held-out source
    out_dir = os.path.abspath(ns.out or (os.path.join(run_dir, "eval") if run_dir else f"eval-{os.path.basename(checkpoint.rstrip('/'))}"))
    data["logging"] = {**data["logging"], "run_dir": out_dir}
    data["launcher"] = {"kind": "local"}
    data["generator"] = {**data["generator"], "replicas": 1, "cpus": ""}
    if not isinstance(data.get("model") or {}, dict):
        raise ConfigError("model", f"must be a mapping of fields, got {type(data['model']).__name__} {data['model']!r}")
    data["model"] = {**(data.get("model") or {}), "path": checkpoint}  # what is evaluated is checked, not a base the run started from
    config = Config.from_dict(data)
    preflight(config)
    has_tokenizer = any(os.path.isfile(os.path.join(checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer_dir = (
        checkpoint
        if has_tokenizer
        else config.model.tokenizer or (os.path.join(run_dir, "tokenizer") if run_dir and os.path.isdir(os.path.join(run_dir, "tokenizer")) else None)
    )
    if tokenizer_dir is None:
        raise ConfigError("model.tokenizer", f"{checkpoint!r} holds no tokenizer: give model.tokenizer=DIR")
    out = sys.stderr if verbose(config) else quiet_console(out_dir)
    from meshrl.data import eval_records

    records = eval_records(config)
    print(f"meshrl: evaluating {checkpoint} on {len(records)} held-out prompts ({config.eval.k} samples each)", file=out)
    try:
        metrics, results = asyncio.run(evaluate_checkpoint(config, checkpoint, tokenizer_dir))
    except Exception as e:  # noqa: BLE001 - one line here, the traceback in the log
        traceback.print_exc()
        print(f"meshrl: eval failed: {type(e).__name__}: {first_line(str(e))}", file=out)
        return 1
    written = os.path.join(out_dir, f"eval-{os.path.basename(checkpoint.rstrip('/'))}.json")  # one per checkpoint evaluated
    os.makedirs(out_dir, exist_ok=True)
    write_results(written, metrics, results, records, checkpoint)
    k = config.eval.k
    print(
        f"meshrl: greedy accuracy {metrics['eval/greedy_accuracy']:.3f}, pass@{k} {metrics[f'eval/pass@{k}']:.3f}, "
        f"mean reward {metrics['eval/reward_mean']:.3f}; results in {written}",
        file=out,
    )
    return 0


def _cmd_plot(ns: argparse.Namespace) -> int:
    from meshrl.metrics import plot_run

    try:
        print(plot_run(ns.run_dir, ns.out))
    except FileNotFoundError as e:
        raise ConfigError("RUN_DIR", str(e)) from None
    return 0


def _cmd_worker(ns: argparse.Namespace) -> int:
    from meshrl.launch import run_worker

    try:
        run_worker(ns.address)
    except ValueError as e:
        print(f"meshrl: worker: {e}", file=console())
        return USAGE_ERROR
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl", description="Asynchronous RL post-training on Monarch meshes.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train: the embedded default, or CONFIG with overrides")
    run.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    run.add_argument(
        "--auto-resume",
        nargs="?",
        const="any",
        metavar="JOB_ID",
        help="resume the config's logging.run_dir from its last checkpoint when it has one, else start it; with JOB_ID, "
        "resume only a run that this job id started (a scheduler's retries), else move it aside and start anew",
    )
    run.add_argument("--verbose", action="store_true", help="show vLLM, Monarch and torch output on the terminal (default: RUN_DIR/logs/)")
    run.add_argument("--plan", action="store_true", help="print which GPUs every proc would hold, and exit")
    run.set_defaults(func=_cmd_run)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    show.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    show.set_defaults(func=_cmd_config_show)
    plan = config_sub.add_parser("plan", help="print the device plan: which GPUs every proc of every role holds")
    plan.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    plan.set_defaults(func=_cmd_config_plan)
    docs = config_sub.add_parser("docs", help="print the config reference (Markdown)")
    docs.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated reference")
    docs.set_defaults(func=_cmd_config_docs)

    evaluate = sub.add_parser("eval", help="evaluate a run's final export or a checkpoint on held-out prompts (eval.*)")
    evaluate.add_argument("target", metavar="RUN_DIR|CHECKPOINT")
    evaluate.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    evaluate.add_argument(
        "--out", metavar="DIR", help="where eval-NAME.json (NAME: the checkpoint's directory, e.g. final) and logs go (default: RUN_DIR/eval)"
    )
    evaluate.set_defaults(func=_cmd_eval)

    plot = sub.add_parser("plot", help="draw a run's reward, staleness and utilisation curves to PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", metavar="FILE.png", help="default: RUN_DIR/curves.png")
    plot.set_defaults(func=_cmd_plot)

    worker = sub.add_parser("worker", help="serve this host to a controller (launcher.kind=workers) until it shuts the host down")
    worker.add_argument("--address", required=True, metavar="IP:PORT", help="this host's own address and a free port (never a wildcard)")
    worker.set_defaults(func=_cmd_worker)

    doctor = sub.add_parser("doctor", help="try every path this machine can take (engine, weight sync, sandbox, Slurm) and print one table")
    doctor.add_argument("--keep", metavar="DIR", help="keep the short runs' directories (logs) here")
    doctor.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    collector.fewer_passes()
    if not sys.flags.safe_path:  # a user's import paths (rollout.env, scoring.reward_fn) resolve from where the command
        sys.path[:] = [os.getcwd(), *(p for p in sys.path if p != os.getcwd())]  # runs, first, as a local run's procs do (they start there)
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (`run my.yaml --verbose steps=5`, `--auto-resume 17 steps=5`) are the command's too
        if any(a.startswith("-") for a in extra) or not isinstance(getattr(ns, "args", None), list):
            parser.parse_args(argv)  # argparse's own one line, exit 2
        ns.args += extra
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"meshrl: {e.kind}: {e}", file=console())
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
