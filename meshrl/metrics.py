"""Run metrics: one JSONL row and TensorBoard scalars per step, and PNG curves.

Any actor can produce metrics: endpoints return flat `{name: float}` dicts (names like
`reward/mean`, `trainer/loss`, `buffer/occupancy`) and the controller merges them into
one row per step. `plot_run(run_dir)` draws reward, staleness and utilisation curves.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from typing import Iterable

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Appends step rows to RUN_DIR/metrics.jsonl and, optionally, TensorBoard events.

    `keep_until`: the step the run starts from (0 for a new run, the restored step for a
    resumed one). Rows and events of later steps are cut, so no step appears twice.
    `restored`: the checkpoint's history; its rows past the file's last step are written
    again (a run killed after a checkpoint and before its step's row was written, or as it
    was written)."""

    def __init__(self, run_dir: str, tensorboard: bool = True, keep_until: int = 0, wandb: dict | None = None, restored: Iterable[dict] = ()):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        present = _truncate_rows(self.path, keep_until)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides the events of steps >= purge_step written before this point
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=keep_until + 1)
        self._wandb = _start_wandb(run_dir, keep_until, **wandb) if wandb else None
        last = max((step for step, evaluation in present if not evaluation), default=0)
        for row in restored:  # (a heal keeps the rows of the steps it lost: those past keep_until are trained again)
            if last < row.get("step", 0) <= keep_until and (row["step"], _is_evaluation(row)) not in present:
                self.write(int(row["step"]), {k: v for k, v in row.items() if k != "step"})

    def rewind(self, step: int) -> None:
        """Cut the rows and TensorBoard events of the steps after `step`: a heal went back to it,
        and the steps it lost are trained again and write their own rows, as after a resume.
        (W&B keeps what it was sent: there a lost step's row stays beside its retrained one.)"""
        self._file.close()
        _truncate_rows(self.path, step)
        self._file = open(self.path, "a", buffering=1)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            logdir = self._tb.log_dir
            self._tb.close()
            self._tb = SummaryWriter(logdir, purge_step=step + 1)

    def write(self, step: int, row: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({"step": step, **clean})

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stops the wandb-core service process it started


def _start_wandb(run_dir: str, keep_until: int, project: str, mode: str, config: dict):
    """A W&B run in RUN_DIR/wandb. A resumed meshrl run continues the same W&B run (its id
    is kept in the run directory). Every metric is plotted against the row's `step` field,
    not W&B's own counter, so an evaluation row that lands after later steps' rows and the
    rows of re-trained steps keep their steps. wandb's own output stays off the console."""
    import wandb

    id_file = os.path.join(run_dir, "wandb", "run_id")
    os.makedirs(os.path.dirname(id_file), exist_ok=True)
    run_id = open(id_file).read().strip() if keep_until and os.path.isfile(id_file) else uuid.uuid4().hex[:12]
    with open(id_file, "w") as f:
        f.write(run_id)
    run = wandb.init(
        project=project,
        dir=run_dir,
        id=run_id,
        resume="allow",
        mode=mode,
        config=config,
        name=os.path.basename(os.path.abspath(run_dir)),
        settings=wandb.Settings(silent=True, console="off"),
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def _truncate_rows(path: str, keep_until: int) -> set[tuple[float, bool]]:
    """Keep the rows of steps <= keep_until in the JSONL file at `path`, atomically; returns
    the (step, whether an evaluation's) of the rows kept."""
    if not os.path.isfile(path):
        return set()
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if _step_of(line) <= keep_until]
    present = {(row.get("step", 0), _is_evaluation(row)) for row in map(json.loads, kept)}
    if len(kept) == len(lines):
        return present
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return present


def _is_evaluation(row: dict) -> bool:
    """An evaluation's row (`eval/...` alone), which shares its step with the step's own."""
    return all(k.startswith("eval/") for k in row if k != "step")


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:  # a row torn by a crash mid-write
        return math.inf


def read_metrics(run_dir: str) -> list[dict[str, float]]:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a meshrl run directory?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


PANELS = [
    ("reward", ["reward/mean", "reward/success_rate", "trainer/reward_mean", "buffer/sampled_reward_mean"]),
    ("stability", ["trainer/entropy", "trainer/zero_variance_groups"]),
    ("held-out eval", ["eval/greedy_accuracy", "eval/pass@", "eval/reward_mean"]),
    ("staleness (versions)", ["trainer/staleness_mean", "trainer/staleness_max"]),
    ("idle fraction", ["trainer/idle_frac", "generator/idle_frac"]),
    ("loss", ["trainer/loss"]),
]


def trained_models(names: Iterable[str]) -> list[str]:
    """The trained models beside the policy that metric names show (a game's `NAME/trainer/reward_mean`)."""
    return [n.removesuffix("/trainer/reward_mean") for n in names if n.endswith("/trainer/reward_mean")]


def panels_of(names: list[str]) -> list[tuple[str, list[str]]]:
    """Each panel's title and the metrics it draws, of those a run has (`names`). In a game
    each trained model's curve (`NAME/trainer/reward_mean`, `NAME/trainer/entropy`, ...) is
    drawn beside the policy's."""
    models = trained_models(names)
    keys_of = lambda key: [key, *(f"{m}/{key}" for m in models)]  # noqa: E731
    panels = [(title, [n for key in keys for k in keys_of(key) for n in names if n == k or k.endswith("@") and n.startswith(k)]) for title, keys in PANELS]
    panels = [(title, keys) for title, keys in panels if keys or title != "held-out eval"]
    signals = [n for n in names if n.startswith("scoring/") and n.endswith("/mean")]
    if signals:  # the trained reward beside every signal (docs/stability.md: the divergence alarm)
        panels.append((SIGNALS_PANEL, ["reward/mean", *signals, *(["eval/reward_mean"] if "eval/reward_mean" in names else [])]))
    return panels


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw reward, staleness, utilisation and loss curves of a run to a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = out or os.path.join(run_dir, "curves.png")
    panels = panels_of(sorted({k for r in rows for k in r}))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (title, keys) in zip(axes, panels):
        if title == SIGNALS_PANEL:
            _plot_signals(ax, rows, keys)
            continue
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), label=key, marker="." if len(points) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SIGNALS_PANEL = "trained reward and each signal"


def _plot_signals(ax, rows: list[dict], keys: list[str]) -> None:
    """The trained reward (solid) beside every scorer's and the env's signal and the held-out
    evaluation's reward (dashed), each scaled to its own range (given in the legend): a
    reward model's scores need not share the verifier's scale, and the picture to see is
    one rising while another falls."""
    for i, key in enumerate(keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        steps, values = zip(*points)
        low, high = min(values), max(values)
        scaled = [(v - low) / (high - low) if high > low else 0.5 for v in values]
        ax.plot(steps, scaled, "-" if i == 0 else "--", label=f"{key} ({low:.3g} to {high:.3g})", marker="." if len(points) < 30 else None)
    ax.set_title(SIGNALS_PANEL)
    ax.set_xlabel("step")
    ax.set_ylabel("scaled to its range")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)


def format_row(row: dict[str, float], keys: Iterable[str]) -> str:
    """A short progress-bar postfix from selected metrics; a model's beside the policy's
    (`NAME/trainer/reward_mean`) is labelled `NAME:reward_mean`."""
    parts = []
    for key in keys:
        if key in row:
            words = key.split("/")
            parts.append(f"{words[0] + ':' if len(words) > 2 else ''}{words[-1]}={row[key]:.3g}")
    return " ".join(parts)
