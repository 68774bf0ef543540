"""What a scorer proc runs: a reward model, an LLM judge or a remote reward server.

Every backend takes a batch of items and answers one result per item:

    item   = {"prompt": str, "messages": list | None, "response": str, "answer": str,
              "sample": dict, "steps": [str, ...] | None}
    result = float (an outcome score) | [float, ...] (one per step, `process`) | Failed
             (a judge's wrapped in Judged, with its reply)

`prompt` is the prompt's text (a chat prompt's last user message), `messages` the chat
prompt when the record has one, `response` everything after the prompt (the model's
turns and the env's replies, special tokens skipped), `steps` the response cut after each
step (process rewards, meshrl/scorers/process.py). A `Failed` result fails its episode
(reward 0, out of the loss) and is counted; the others are not affected.

- `RewardModel`: a Hugging Face sequence-classification checkpoint with one label, on its
  own tokenizer: a chat template renders (messages or prompt) + the response as the
  assistant's turn; without one, prompt + response. Each input keeps its last `max_len`
  tokens; a batch is padded on the side the tokenizer says and scored in one forward pass.
- `Judge`: a vLLM engine on a causal-LM checkpoint. The template is filled and sent as a
  user message through the judge's chat template (plain text without one), decoded
  greedily, and the reply parsed (`parse_reply`). An unparsable reply scores
  `unparsable` (None: Failed).
- `Remote`: one HTTP POST per batch, `{"items": [...]}` -> `{"scores": [...]}`, bounded by
  the scorer's timeout and retried `retries` times; a batch still failing fails its items.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.config import ConfigError, ScorerConfig

Result = Any  # float | list[float] | Failed


@dataclass
class Failed:
    """An item the scorer could not score: why, in one line."""

    reason: str
    unparsable: bool = False


@dataclass
class Judged:
    """A judge's result with the reply it was read from (kept in the scorer's answer)."""

    value: Any  # float | Failed
    reply: str


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


SCORE_CUE = re.compile(r"(\w+)?\W{0,2}\bscore\s*(?::|=|is|of)\s*(" + NUMBER.pattern + ")", re.IGNORECASE)
NOT_A_VERDICT = ("max", "maximum", "highest", "possible", "top", "best", "total")


def number_parser(text: str) -> float | None:
    """The judge's score: the number after its reply's last `final score:`, else after its first
    `score:` (or `score is`, `score of`, `score =`) that is no maximum (`the maximum score is 10`),
    else its first number; None when there is none. (The first number alone read a judge's
    "1. Correctness: wrong. Score: 2" as 1.)"""
    cued = [(word.lower(), value) for word, value in SCORE_CUE.findall(text) if word.lower() not in NOT_A_VERDICT]
    final = [value for word, value in cued if word == "final"]
    if final or cued:
        return float(final[-1] if final else cued[0][1])
    m = NUMBER.search(text)
    return float(m.group()) if m else None


YES_NO = re.compile(r"(yes|no)\b", re.IGNORECASE)
THINKING = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def yes_no_parser(text: str) -> float | None:
    """1 for a reply whose first word is yes, 0 for no (case and leading space ignored; "Not
    sure" and "Nope" are neither)."""
    m = YES_NO.match(text.strip())
    return None if m is None else float(m.group(1).lower() == "yes")


PARSERS: dict[str, Callable[[str], float | None]] = {"number": number_parser, "yes_no": yes_no_parser}


def load_parser(name: str) -> Callable[[str], float | None]:
    if name in PARSERS:
        return PARSERS[name]
    from meshrl.imports import import_callable

    return import_callable(name)


def with_opened_thinking(prompt_end: str, reply: str) -> str:
    """The judge's reply as it reads: after a prompt whose template opened `<think>` (QwQ,
    R1 distills, Qwen3's thinking models), the reply is inside it, and one cut before `</think>`
    holds thoughts, not a verdict (`parse_reply` finds none in it)."""
    return "<think>" + reply if prompt_end.rfind("<think>") > prompt_end.rfind("</think>") else reply


def parse_reply(parser: Callable[[str], float | None], text: str, scale: float, unparsable: float | None) -> Result:
    """The judge's `text` as a score: parser(text) x scale, read after the reasoning of a
    thinking judge (`<think>...</think>`: its numbers and words are not the verdict; a reply
    cut inside it has none); an unreadable reply (None, a non-finite number or a parser that
    raises) scores `unparsable`, or Failed when None."""
    text = THINKING.sub("", text.rsplit("</think>", 1)[-1])  # (a template may open <think> in the prompt)
    try:
        value = parser(text)
        value = None if value is None else float(value)
    except Exception:  # noqa: BLE001 - a parser that cannot read the reply: unparsable, not a crash
        value = None
    if value is None or not math.isfinite(value):
        if unparsable is None:
            return Failed(f"unparsable judge reply {text[:80]!r}", unparsable=True)
        return Failed(f"unparsable judge reply {text[:80]!r}: scored {unparsable:g}", unparsable=True)
    return value * scale


def render_messages(item: dict, response: str | None = None) -> list[dict]:
    """The item's prompt as chat messages, with `response` as the assistant's turn."""
    messages = list(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return messages


class RewardModel:
    """A sequence-classification checkpoint with one label, scoring (prompt, response) pairs."""

    def __init__(self, path: str, max_len: int = 1024, device: str | None = None, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

        from meshrl.compat import cuda_present

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype="auto").eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path!r} has {self.model.config.num_labels} labels: a reward model has one (num_labels=1)")
        self.device = device or ("cuda" if cuda_present() else "cpu")
        self.model.to(self.device)
        # never past the positions it was built for (an encoder's 512: a longer input raised IndexError
        # for the whole batch); RoBERTa's family numbers them from its padding index + 1
        # (DeBERTa-v3's are relative, no embedding to run past: it reads all of max_len)
        embeddings = getattr(self.model.base_model, "embeddings", None)
        absolute = getattr(embeddings, "position_embeddings", None) is not None
        padding_idx = getattr(embeddings, "padding_idx", None)
        positions = (getattr(self.model.config, "max_position_embeddings", None) if absolute else None) or max_len
        self.max_len, self.batch_size = min(max_len, positions - (padding_idx + 1 if absolute and padding_idx is not None else 0)), batch_size
        # A decoder's head reads the last token: rows are left-padded, so each one's last real
        # token is the last position, and its "last token that is not pad_token_id" must find no
        # pad id at all (a tokenizer whose pad is its end-of-turn token would otherwise be read
        # before the turn's end). An encoder's (BERT, DeBERTa) reads the first: rows right-padded.
        self.left_pad = self.model.config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if self.left_pad:
            self.model.config.pad_token_id = -1
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = pad if pad is not None else 0

    def encode(self, item: dict, response: str) -> list[int]:
        """The ids the model scores for `item` answered by `response` (also how to train one)."""
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(render_messages(item, response), tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(item["prompt"] + response, add_special_tokens=True)["input_ids"]
        ids = list(ids)
        if len(ids) > self.max_len and ids[0] in self.tokenizer.all_special_ids:  # its last tokens, after its [CLS] or BOS
            return ids[:1] + ids[len(ids) - self.max_len + 1 :]
        return ids[-self.max_len :]

    def forward(self, rows: list[list[int]]):
        """[len(rows)] scores of token-id rows, padded into one batch (with gradients:
        meshrl/scorers/preference.py trains through it)."""
        import torch

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            at = slice(width - len(r), width) if self.left_pad else slice(0, len(r))
            ids[i, at] = torch.tensor(r)
            mask[i, at] = 1
        # left-padded (a decoder): each row's positions as if unpadded; right-padded (an encoder) as the model numbers them
        # itself (RoBERTa's family from its padding index + 1: positions from 0 read its padding row)
        positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0).to(self.device)} if self.left_pad else {}
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **positions).logits
        return logits[:, 0].float().cpu()

    def score_sync(self, items: list[dict]) -> list[Result]:
        import torch

        rows, owners = [], []
        for i, item in enumerate(items):
            for text in item.get("steps") or [item["response"]]:
                rows.append(self.encode(item, text))
                owners.append(i)
        with torch.no_grad():  # at most batch_size rows at once: a process scorer has one per step of every item
            scores = [s for at in range(0, len(rows), self.batch_size) for s in self.forward(rows[at : at + self.batch_size]).tolist()]
        results: list[Result] = [[] for _ in items]
        for i, s in zip(owners, scores):
            results[i].append(float(s))
        return [r if items[i].get("steps") else r[0] for i, r in enumerate(results)]

    async def score(self, items: list[dict]) -> list[Result]:
        return await asyncio.to_thread(self.score_sync, items)


class Judge:
    """A vLLM engine on a causal LM, asked for a score by a prompt template."""

    def __init__(self, spec: ScorerConfig, gen_config, dtype: str = "float32", seed: int = 0):
        from meshrl.generator.engine import VLLMEngine
        from meshrl.tokenizer import load_tokenizer

        self.spec = spec
        self.tokenizer = load_tokenizer(spec.path)
        self.parser = load_parser(spec.parser)
        context = spec.judge_context()  # never past what the checkpoint was built for
        self.prompt_len = max(1, context - spec.max_new_tokens)
        # one GPU a judge replica on the device plan, whatever generator.tp the policy's engines use
        self.engine = VLLMEngine(dataclasses.replace(gen_config, tp=1), spec.path, dtype=dtype, max_model_len=context, seed=seed)
        self._ids = 0

    async def start(self) -> float:
        return await self.engine.start(0)

    def prompt_ids(self, item: dict) -> list[int]:
        text = fill_template(self.spec.template, item)
        if getattr(self.tokenizer, "chat_template", None):
            # a hybrid thinking judge (Qwen3) answers at once: thinking by default, it spent its
            # max_new_tokens inside <think> and every reply was unparsable (a template without the switch ignores it)
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, enable_thinking=False)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(text)["input_ids"]
        return list(ids)[-self.prompt_len :]

    async def reply(self, item: dict) -> str:
        self._ids += 1
        ids = self.prompt_ids(item)
        out = await self.engine.run_request(f"judge-{self._ids}", ids, self.spec.max_new_tokens, 0.0)
        return with_opened_thinking(self.tokenizer.decode(ids[-16:]), self.tokenizer.decode(out.token_ids, skip_special_tokens=True))

    async def score(self, items: list[dict]) -> list[Result]:
        replies = await asyncio.gather(*(self.reply(item) for item in items), return_exceptions=True)
        return [
            Failed(f"{type(r).__name__}: {str(r)[:200]}")
            if isinstance(r, BaseException)
            else Judged(parse_reply(self.parser, r, self.spec.judge_scale(), self.spec.unparsable), r)
            for r in replies
        ]

    async def release_sigterm(self) -> None:
        await self.engine.release_sigterm()

    def shutdown(self) -> None:
        self.engine.shutdown()


def fill_template(template: str, item: dict) -> str:
    """The judge's prompt for `item`: `template` over prompt, response and answer."""
    return template.format(prompt=item["prompt"], response=item["response"], answer=item.get("answer") or "")


class Remote:
    """A user's reward server: one POST of a JSON batch, retried, bounded."""

    def __init__(self, spec: ScorerConfig):
        self.spec = spec

    def _post(self, items: list[dict], timeout: float) -> list:
        body = json.dumps({"items": items}).encode()
        request = urllib.request.Request(self.spec.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(items):
            raise ValueError(f'the server answered {str(answer)[:120]!r}: expected {{"scores": [...]}} with {len(items)} entries')
        return scores

    async def score(self, items: list[dict]) -> list[Result]:
        deadline = time.monotonic() + self.spec.timeout_s
        error: Exception | None = None
        for attempt in range(self.spec.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                scores = await asyncio.wait_for(asyncio.to_thread(self._post, items, left), left)
                return [check_remote(s, item) for s, item in zip(scores, items)]
            except (OSError, ValueError, asyncio.TimeoutError, urllib.error.URLError, http.client.HTTPException) as e:  # (a body cut short, a bad status line)
                error = e
                await asyncio.sleep(min(0.5 * 2**attempt, max(0.0, deadline - time.monotonic())))
        why = f"{type(error).__name__}: {str(error)[:160]}" if error else f"no answer in scorer timeout_s={self.spec.timeout_s:g}"
        return [Failed(f"remote scorer {self.spec.url}: {why}") for _ in items]


def check_remote(value: Any, item: dict) -> Result:
    """One entry of a server's answer: a finite number, or with steps one per step."""
    steps = item.get("steps")
    if steps is not None:
        if isinstance(value, list) and len(value) == len(steps) and all(_finite(v) for v in value):
            return [float(v) for v in value]
        return Failed(f"the server answered {str(value)[:80]!r} for an item of {len(steps)} steps: expected {len(steps)} numbers")
    if _finite(value):
        return float(value)
    return Failed(f"the server answered {str(value)[:80]!r}: expected a finite number")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


async def start_backend(spec: ScorerConfig, config, replica: int = 0, restore: bool = False):
    """The backend of `spec` on this proc, ready to score (a judge's engine started). `restore`:
    a trained scorer (an implicit PRM) starts from its newest saved state, where it has one."""
    if spec.kind == "reward_model":
        return await asyncio.to_thread(RewardModel, spec.path, spec.max_len, None, spec.batch_size)
    if spec.kind == "judge":
        judge = Judge(spec, config.generator, dtype=config.model.dtype, seed=config.seed + replica)
        await judge.start()
        return judge
    if spec.kind == "remote":
        return Remote(spec)
    if spec.kind == "prm":
        from meshrl.scorers.prm import ImplicitPRM

        return await asyncio.to_thread(ImplicitPRM, spec, config, config.scoring.scorer_names()[config.scoring.scorers.index(spec)], restore)
    raise ValueError(f"a {spec.kind!r} scorer runs in the rollout workers, not on a scorer proc")


def check_judge(sc: ScorerConfig, path: str) -> None:
    """A judge's template fills with a probe item and its parser reads `probe_reply` as a
    number; else a ConfigError on the field at `path`."""
    try:
        fill_template(sc.template, {"prompt": "q", "response": "r", "answer": "a"})
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"{path}.template", f"cannot be filled ({type(e).__name__}: {e}): use only {{prompt}}, {{response}} and {{answer}}, and double other braces"
        ) from None
    if sc.parser in PARSERS:
        parser = PARSERS[sc.parser]
    else:
        from meshrl.imports import check_import

        parser = check_import(f"{path}.parser", sc.parser, "'number', 'yes_no' or a parser function")
    score = parse_reply(parser, sc.probe_reply, sc.judge_scale(), None)
    if not isinstance(score, float):
        raise ConfigError(
            f"{path}.parser",
            f"{sc.parser!r} cannot read probe_reply={sc.probe_reply!r} as a number: fix the parser, or set probe_reply to a reply of your judge's format",
        )
