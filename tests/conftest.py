"""Shared test helpers: tokenizers built on the spot, so no test needs a hub or a checkpoint."""

from __future__ import annotations

import os
import string

import pytest

NL = "{{ '\\n' }}"  # HF renders templates with trim_blocks, which eats a literal newline after a tag
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system" + NL
    + "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}" + NL + NL + "{% endif %}"
    "# Tools" + NL + "<tools>"
    "{% for tool in tools %}" + NL + "{{ tool | tojson }}{% endfor %}" + NL + "</tools>" + NL
    + 'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>' + NL
    + "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system" + NL + "{{ messages[0]['content'] }}<|im_end|>" + NL
    + "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    # Consecutive tool results share one user turn, as Qwen's own template has them.
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    + NL + "<tool_response>" + NL + "{{ m['content'] }}" + NL + "</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>" + NL + "{% endif %}"
    "{% elif not (m['role'] == 'system' and loop.first) %}"
    "<|im_start|>{{ m['role'] }}" + NL + "{{ m['content'] }}<|im_end|>" + NL
    + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
"""A Qwen-style chat template: tool schemas in the system block, tool results as
`<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>`, `<|im_end|>` ends a turn."""


def build_qwen_style_tokenizer(path: str | os.PathLike) -> str:
    """A character-level tokenizer with Qwen's turn specials and QWEN_STYLE_TEMPLATE, saved at `path`.

    `<tool_call>` and `</tool_call>` are single added tokens but not special ones, as in
    Qwen's tokenizer: a turn decoded with special tokens skipped still shows its calls.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.model_max_length = 1 << 20
    fast.chat_template = QWEN_STYLE_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def char_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from meshrl.tokenizer import build_char_tokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(tmp_path / "char_tok"), local_files_only=True)


@pytest.fixture
def qwen_style_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_qwen_style_tokenizer(tmp_path / "qwen_tok"), local_files_only=True)
