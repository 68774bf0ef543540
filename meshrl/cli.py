"""The `meshrl` command line.

    meshrl run [CONFIG.yaml] [section.field=value ...] [--resume RUN_DIR]
    meshrl config show [CONFIG.yaml] [section.field=value ...]
    meshrl config docs [--check FILE]
    meshrl plot RUN_DIR [--out FILE.png]

Bad input (unknown key, wrong type, impossible sizes, missing paths) prints one line on
stderr naming the field and the fix, and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from meshrl.config import Config, ConfigError, apply_overrides, load_yaml, reference_markdown

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
    print(load_config(ns.args).to_yaml(), end="")
    return 0


def _cmd_config_docs(ns: argparse.Namespace) -> int:
    text = reference_markdown() + "\n"
    if ns.check:
        with open(ns.check) as f:
            if f.read() != text:
                print(f"meshrl: {ns.check} is out of date: regenerate it with `meshrl config docs > {ns.check}`", file=sys.stderr)
                return 1
        return 0
    print(text, end="")
    return 0


def _cmd_run(ns: argparse.Namespace) -> int:
    from meshrl.api import run
    from meshrl.controller.loop import TrainerFailed

    path, overrides = _split(ns.args)
    try:
        if ns.resume:
            if path is not None:
                raise ConfigError("--resume", "a resumed run uses RUN_DIR/config.yaml: pass only overrides with --resume")
            result = run(resume=ns.resume, overrides=overrides)
        else:
            result = run(load_config(ns.args))
    except (TrainerFailed, TimeoutError) as e:
        print(f"meshrl: run failed: {e}", file=sys.stderr)
        return 1
    if result.metrics:
        last = result.metrics[-1]
        # the trained batch's reward: every step has one (a step may finish no new episode)
        print(f"meshrl: {len(result.metrics)} steps in {result.run_dir} (reward {last['trainer/reward_mean']:.3f} at step {int(last['step'])})")
    return 0


def _cmd_plot(ns: argparse.Namespace) -> int:
    from meshrl.metrics import plot_run

    try:
        print(plot_run(ns.run_dir, ns.out))
    except FileNotFoundError as e:
        raise ConfigError("RUN_DIR", str(e)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl", description="Asynchronous RL post-training on Monarch meshes.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train: the embedded default, or CONFIG with overrides")
    run.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    run.set_defaults(func=_cmd_run)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    show.add_argument("args", nargs="*", metavar="CONFIG|section.field=value")
    show.set_defaults(func=_cmd_config_show)
    docs = config_sub.add_parser("docs", help="print the config reference (Markdown)")
    docs.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated reference")
    docs.set_defaults(func=_cmd_config_docs)

    plot = sub.add_parser("plot", help="draw a run's reward, staleness and utilisation curves to PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", metavar="FILE.png", help="default: RUN_DIR/curves.png")
    plot.set_defaults(func=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"meshrl: config error: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
