"""Write the math example's prompts as JSONL rows of {"prompt": ..., "answer": ...}.

    python examples/math/make_data.py gsm8k /data/math          # GSM8K's train and test splits (needs `datasets` and the network)
    python examples/math/make_data.py tiny runs/math-data        # the CPU variant's problems, no download

`gsm8k`: each question as a chat message asking for the answer in \\boxed{}, the reference
answer after GSM8K's `####`. `tiny`: one-digit problems a model trained from scratch on
characters can learn on a CPU in minutes: `k*0` (answer 0) and `k*1`, `k+0`, `0+k` (answer k).
Both write train.jsonl and test.jsonl into the directory; `meshrl.verifiers:math_answer`
scores a response by its final answer (its last \\boxed{}, else <answer> tag, else number).
"""

from __future__ import annotations

import json
import os
import random
import sys

INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


def tiny_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(0, 9)
        prompt, answer = rng.choice([(f"{k}*0=", 0), (f"{k}*1=", k), (f"{k}+0=", k), (f"0+{k}=", k)])
        rows.append({"prompt": prompt, "answer": str(answer)})
    return rows


def gsm8k_rows(split: str) -> list[dict]:
    from datasets import load_dataset

    rows = []
    for r in load_dataset("openai/gsm8k", "main", split=split):
        answer = r["answer"].split("####")[-1].strip().replace(",", "")
        rows.append({"prompt": [{"role": "user", "content": f"{r['question']}\n{INSTRUCTION}"}], "answer": answer})
    return rows


def write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(kind: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    if kind == "tiny":
        splits = {"train": tiny_rows(2000, seed=0), "test": tiny_rows(64, seed=1)}
    elif kind == "gsm8k":
        splits = {"train": gsm8k_rows("train"), "test": gsm8k_rows("test")}
    else:
        raise SystemExit(f"unknown kind {kind!r}: tiny or gsm8k")
    for name, rows in splits.items():
        write(os.path.join(out, f"{name}.jsonl"), rows)
        print(f"{os.path.join(out, name + '.jsonl')}: {len(rows)} rows")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1].startswith("-"):  # (--help: the usage, not a directory of that name)
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
