"""Train a reward model on preference pairs (Bradley-Terry) and save it as a checkpoint.

    pairs = task_preferences("digits", 4000, seed=0)          # or your own (prompt, chosen, rejected)
    build_reward_model(out, tokenizer_dir)                    # a small sequence-classification model
    stats = train_reward_model(out, pairs, steps=300)         # saved in place, with its tokenizer
    # scoring.scorers: [{kind: reward_model, path: out}]

Training maximises log sigmoid(r(chosen) - r(rejected)) over the pairs, with each pair
rendered exactly as a reward-model scorer renders an episode (`RewardModel.encode`: the
checkpoint's chat template, the prompt as the user's turn and the response as the
assistant's), so what it learns is what the run is scored by.

`task_preferences` makes pairs from a built-in single-turn task: random responses (each
drawn from printable characters, with one character class favoured at a random rate: the
responses range from nothing like an answer to mostly answer-like), ordered by the task's
own exact reward; pairs of equal reward are left out.
"""

from __future__ import annotations

import os
import random
import string
from typing import Sequence

CLASSES = (string.digits, string.ascii_lowercase, string.ascii_uppercase, string.punctuation + " ")
PRINTABLE = "".join(CLASSES)


def random_response(rng: random.Random, max_len: int = 16) -> str:
    favoured = rng.choice(CLASSES)
    rate = rng.random()
    return "".join(rng.choice(favoured) if rng.random() < rate else rng.choice(PRINTABLE) for _ in range(rng.randint(1, max_len)))


def task_preferences(task: str, n: int, seed: int = 0, max_len: int = 16) -> list[tuple[str, str, str]]:
    """`n` (prompt, chosen, rejected) pairs of a built-in single-turn task, ordered by its reward."""
    from meshrl.tasks import get_task

    t = get_task(task)
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        sample = t.sample(rng)
        a, b = random_response(rng, max_len), random_response(rng, max_len)
        ra, rb = t.reward(sample["prompt"], a, sample), t.reward(sample["prompt"], b, sample)
        if ra != rb:
            pairs.append((sample["prompt"], a, b) if ra > rb else (sample["prompt"], b, a))
    return pairs


def build_reward_model(path: str | os.PathLike, tokenizer_dir: str, dim: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A small randomly initialised Qwen3 sequence-classification model (one label) with the
    tokenizer of `tokenizer_dir`, saved at `path`."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=dim // 2,
        max_position_embeddings=1024,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen3ForSequenceClassification(cfg)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def train_reward_model(
    path: str | os.PathLike,
    pairs: Sequence[tuple[str, str, str]],
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    held_out: float = 0.1,
) -> dict:
    """Train the checkpoint at `path` on `pairs` and save it there. Returns the final loss and
    the pairwise accuracy on the held-out share of the pairs."""
    import torch
    import torch.nn.functional as F

    from meshrl.scorers.backends import RewardModel

    rm = RewardModel(str(path), device="cpu")
    rng = random.Random(seed)
    pairs = list(pairs)
    rng.shuffle(pairs)
    cut = max(1, int(len(pairs) * held_out))
    test, train = pairs[:cut], pairs[cut:]
    rm.model.train()
    opt = torch.optim.AdamW(rm.model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = rng.sample(train, min(batch_size, len(train)))
        rows = [rm.encode({"prompt": p}, c) for p, c, _ in batch] + [rm.encode({"prompt": p}, r) for p, _, r in batch]
        scores = rm.forward(rows)
        loss = -F.logsigmoid(scores[: len(batch)] - scores[len(batch) :]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.model.eval()
    with torch.no_grad():
        chosen = rm.forward([rm.encode({"prompt": p}, c) for p, c, _ in test])
        rejected = rm.forward([rm.encode({"prompt": p}, r) for p, _, r in test])
    rm.model.config.pad_token_id = rm.pad_id  # the checkpoint keeps its tokenizer's pad id
    rm.model.save_pretrained(str(path))
    return {"loss": loss.item(), "accuracy": float((chosen > rejected).float().mean()), "pairs": len(train), "held_out": len(test)}
