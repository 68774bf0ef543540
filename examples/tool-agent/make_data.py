"""Write MBPP's problems as the coding env's JSONL: a prompt, hidden assert tests.

    python examples/tool-agent/make_data.py /data/mbpp     # needs `datasets` and the network

Each row: {"prompt": [user message], "tests": ["assert ...", ...]}. The prompt shows the
first test (so the model knows the function's name and signature); all of them score the
answer in the sandbox (meshrl.rollout.coding:CodeEnv: reward = the fraction passed).
"""

from __future__ import annotations

import json
import os
import sys

ASK = (
    "Write a Python function for this task. You may run code with the python tool first. "
    "End with the solution in a ```python block.\n\n{text}\nIt must pass, for example:\n{example}"
)


def main(out: str) -> None:
    from datasets import load_dataset

    os.makedirs(out, exist_ok=True)
    for split in ("train", "test"):
        rows = load_dataset("google-research-datasets/mbpp", "full", split=split)
        path = os.path.join(out, f"{split}.jsonl")
        with open(path, "w") as f:
            for r in rows:
                prompt = [{"role": "user", "content": ASK.format(text=r["text"], example=r["test_list"][0])}]
                f.write(json.dumps({"prompt": prompt, "tests": list(r["test_list"])}) + "\n")
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # (--help: the usage, not a directory of that name)
        raise SystemExit(__doc__)
    main(sys.argv[1])
