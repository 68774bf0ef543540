"""Token-in, token-out chat rendering: the ids of a multi-turn episode, built by appending.

An episode's context is the prompt's ids, then the model's sampled ids, then the ids of
what the env said, then the model again, and so on. Rendering the whole conversation
through the chat template after every turn and tokenizing it again would not give back the
ids the model sampled (BPE merges differently across a turn's edges, templates rewrite past
turns, a turn cut by length gets closed), and the trainer would then score tokens the
model never produced. So ids once in the context are never touched: after a model turn,
only the template's text for what comes next is rendered and tokenized.

That text is found for any Hugging Face chat template by rendering a fixed stub
conversation (a user turn, an assistant turn) without and with the new messages: what the
second writes after the assistant's content is the "glue" that closes the assistant turn
(`<|im_end|>\\n` for Qwen, `<eos>` for the character template), then the new messages,
then the generation prompt. The model has usually sampled the start of the glue itself
(its end-of-turn token); that part is not written twice. A turn cut by length gets all of it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from meshrl.rollout.env import Message, Observation
from meshrl.tokenizer import prompt_ids

# NUL cannot occur in a template's own text, so these mark exactly where contents land.
_USER, _ASSISTANT = "\x00user\x00", "\x00assistant\x00"
_STUB: list[Message] = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]


def is_messages(observation: Observation) -> bool:
    """A non-empty list of chat messages (an empty list is read as no token ids)."""
    return isinstance(observation, list) and bool(observation) and all(isinstance(m, dict) for m in observation)


def prompt_too_long(tokens: int, max_seq_len: int, max_new_tokens: int, field: str = "model.max_seq_len") -> str:
    """What is wrong with a prompt of `tokens` tokens that leaves a model turn of `max_new_tokens`
    too little room under `field` (the model's max_seq_len): one line naming the fix."""
    room = max_seq_len - tokens
    left = "no room for a model turn" if room <= 0 else f"{room} of a model turn's {max_new_tokens} tokens"
    return (
        f"a prompt of {tokens} tokens leaves {left} under {field}={max_seq_len}: "
        f"raise it to at least {tokens + max_new_tokens} (the prompt and its answer budget), or shorten the prompt"
    )


class ChatRenderer:
    """Turns observations into token ids for one tokenizer (and its chat template).

    `tools` (JSON schemas, as `ToolEnv.tools_schema` gives them) are passed to every
    rendering, so a template that lists them in its system block does so in the prompt.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, vocab: int | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.vocab = vocab
        """The model's vocabulary size: token ids an env sends must lie below it (None: unchecked)."""

    def initial_ids(self, observation: Observation) -> list[int]:
        """The first prompt: text is tokenized as is (no template, as single-turn tasks are;
        after the BOS a tokenizer puts first on its own, `tokenizer.prompt_ids`), chat messages
        are rendered with a generation prompt, token ids are kept."""
        if isinstance(observation, str):
            return prompt_ids(self.tokenizer, observation)
        if is_messages(observation):
            return self.encode(self._render(observation, generation_prompt=True))
        return self._ids(observation)

    def continuation_ids(self, model_ids: list[int], observation: Observation) -> list[int]:
        """The ids to append after a model turn that sampled `model_ids` so that the context
        goes on with `observation` and, for chat messages, ends with a generation prompt.

        Text and token ids are appended as they are; the caller owns their format.
        """
        if isinstance(observation, str):
            return self.encode(observation)
        if not is_messages(observation):
            return self._ids(observation)
        delta = self._delta(observation)
        emitted = self._emitted_glue(model_ids)
        if emitted == 0:
            return self.encode(self._glue + delta)
        done = self.tokenizer.decode(self._glue_ids[:emitted], skip_special_tokens=False)
        if self._glue.startswith(done):
            # Tokenize what is left of the glue together with the new turns, as the template's text is.
            return self.encode(self._glue[len(done) :] + delta)
        return self._glue_ids[emitted:] + self.encode(delta)

    def _ids(self, observation: list[int]) -> list[int]:
        """Token ids an env sent, refused past the model's vocabulary (the generator would
        refuse the request as a replica's failure, and the group would be played again)."""
        ids = list(observation)
        bad = next((i for i in ids if i < 0 or (self.vocab is not None and i >= self.vocab)), None)
        if bad is not None:
            bound = "" if self.vocab is None else f" (0..{self.vocab - 1})"
            raise ValueError(f"the env's observation holds token id {bad}, outside the model's vocabulary{bound}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS of the tokenizer's own: a template writes the specials it wants in its text,
        # and the HF tokenizer turns each special written there into its single id.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _after_assistant(self, messages: list[Message]) -> str:
        """The stub conversation + `messages` rendered; the text after the assistant's content."""
        try:
            text = self._render(_STUB + messages, generation_prompt=bool(messages))
        except Exception as e:
            roles = [m.get("role") for m in messages]
            raise ValueError(f"the chat template cannot render a user turn, an assistant turn, then {roles}: {e}") from e
        head, found, tail = text.partition(_ASSISTANT)
        if not found or _ASSISTANT in tail:
            raise ValueError("the chat template does not render an assistant message's content exactly once, so where a model turn ends cannot be found")
        # `head` may differ between the two renderings (Qwen3 drops an empty think block from
        # an assistant turn that is no longer the last one): it lies before the model's turn,
        # whose ids are kept as sampled, so only what follows the turn has to agree.
        return tail

    @cached_property
    def _glue(self) -> str:
        """What the template writes after an assistant turn's content to close it."""
        return self._after_assistant([])

    @cached_property
    def _glue_ids(self) -> list[int]:
        return self.encode(self._glue)

    def _delta(self, messages: list[Message]) -> str:
        """The new messages and the generation prompt, as the template writes them after the glue."""
        tail = self._after_assistant(messages)
        if not tail.startswith(self._glue):
            raise ValueError(
                f"the chat template closes an assistant turn with {self._glue!r} when it is the last message "
                f"but writes {tail[: len(self._glue) + 20]!r} when more follow: a conversation in this template "
                "cannot be continued by appending"
            )
        return tail[len(self._glue) :]

    def _emitted_glue(self, model_ids: list[int]) -> int:
        """How many of the glue's leading ids the model sampled at the end of its turn (its
        end-of-turn token, usually). Compared as ids, not text: a turn cut by length that
        happens to end in the glue's first characters has not closed itself."""
        glue, model_ids = self._glue_ids, list(model_ids)  # a sampler may hand a tuple or an array
        for k in range(min(len(glue), len(model_ids)), 0, -1):
            if model_ids[-k:] == glue[:k]:
                return k
        return 0
