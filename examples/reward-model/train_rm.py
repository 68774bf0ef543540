"""Train a reward model on preference pairs (Bradley-Terry) and save it where a run's
`scoring.scorers: [{kind: reward_model, path: OUT}]` reads it.

    python examples/reward-model/train_rm.py --task digits runs/rm                  # the CPU variant's pairs and model
    python examples/reward-model/train_rm.py --pairs prefs.jsonl --init /data/rm0 /data/rm --steps 2000

--pairs: JSONL rows {"prompt": ..., "chosen": ..., "rejected": ...} (prompt as text or chat
messages, as the run's data has it). --task NAME: pairs made from a built-in single-turn
task, ordered by its own verifier (meshrl/scorers/preference.py). --init: start from a
sequence-classification checkpoint with one label (AutoModelForSequenceClassification,
copied to OUT first); without it a small Qwen3 with meshrl's character tokenizer, the
tiny policy's. Trains in this process on CPU: suited to small models (see README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile


def train(out: str, task: str | None = None, pairs_file: str | None = None, n: int = 4000, init: str | None = None, **kwargs) -> dict:
    """Make the pairs, the starting checkpoint at `out`, train it there; returns the stats
    (final loss, held-out pairwise accuracy), also written to OUT/preference_stats.json.
    `kwargs`: train_reward_model's steps, batch_size, lr, seed."""
    from meshrl.scorers.preference import build_reward_model, task_preferences, train_reward_model
    from meshrl.tokenizer import build_char_tokenizer

    seed = kwargs.get("seed", 0)
    if pairs_file:
        with open(pairs_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        pairs = [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    else:
        pairs = task_preferences(task, n, seed=seed)
    if init:
        shutil.copytree(init, out, dirs_exist_ok=True)
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the reward model saves its own copy of the tokenizer
            build_reward_model(out, build_char_tokenizer(os.path.join(tmp, "tokenizer")), seed=seed)
    stats = train_reward_model(out, pairs, **kwargs)
    with open(os.path.join(out, "preference_stats.json"), "w") as f:  # beside the weights: what it learned
        json.dump(stats, f)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="where the trained checkpoint goes")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairs", help="JSONL of prompt, chosen, rejected")
    source.add_argument("--task", help="a built-in single-turn task (digits, letters, count, add, copy)")
    ap.add_argument("--n", type=int, default=4000, help="pairs made from --task")
    ap.add_argument("--init", help="a sequence-classification checkpoint to start from")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    stats = train(a.out, a.task, a.pairs, a.n, a.init, steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed)
    print(f"{a.out}: held-out pairwise accuracy {stats['accuracy']:.3f} on {stats['held_out']} pairs, final loss {stats['loss']:.4f}")


if __name__ == "__main__":
    main()
