"""Tokenizers: Hugging Face tokenizers loaded from local directories.

No hub access at run time, so the embedded default and the tests use a character-level
tokenizer that meshrl builds and saves as an ordinary Hugging Face tokenizer directory;
every other code path loads it exactly like a real model's tokenizer.

The character tokenizer carries a compact chat template (`CHAR_CHAT_TEMPLATE`) so that
multi-turn tasks run on models trained from scratch through the same chat path as real
checkpoints. Tiny models pay for every token of a turn, so the template spends three.

`check_tokenizer_dir` and `check_tokenizer` are the checks a run's tokenizer passes before
any mesh starts (meshrl/preflight.py lists them): the directory is there, it loads, and the
policy's vocabulary has a row for each of its token ids.
"""

from __future__ import annotations

import functools
import json
import os
import string
from typing import TYPE_CHECKING

from meshrl.config import ConfigError
from meshrl.errors import first_line

if TYPE_CHECKING:
    from meshrl.config import Config

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHAR_VOCAB_SIZE = 128
"""Vocab size of the character tokenizer (3 specials + printable ASCII, padded to 128)."""

CHAR_ROLES = {"system": "S", "user": "U", "assistant": "A", "tool": "T"}
CHAR_CHAT_TEMPLATE = (
    "{%- set roles = " + repr(CHAR_ROLES) + " -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in roles -%}{{ raise_exception('no role char for ' + m['role']) }}{%- endif -%}"
    "<bos>{{ roles[m['role']] }}{{ m['content'] or '' }}<eos>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<bos>A{%- endif -%}"
)
"""Chat template of the character tokenizer: each message is `<bos>` + a role char (S, U, A,
T for system, user, assistant, tool) + its content + `<eos>`, nothing else, so a turn costs
its content plus 3 tokens; the generation prompt is `<bos>A`. `<eos>` (the checkpoint's
eos_token_id) ends a turn, so a model stops by sampling it. `tools=` is ignored: a model
trained from scratch cannot discover a schema-shaped call by sampling, so its tool calls
use the compact `!` convention of `meshrl.rollout.tools.compact` instead."""


def char_vocab() -> dict[str, int]:
    """The character tokenizer's ids: `<pad>` 0, `<bos>` 1, `<eos>` 2, then one per character
    (printable ASCII, space and newline)."""
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    return vocab


def build_char_tokenizer(path: str | os.PathLike) -> str:
    """Build the character tokenizer (`char_vocab`), with `CHAR_CHAT_TEMPLATE`, and save it as
    a HF tokenizer directory at `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    assert len(vocab) <= CHAR_VOCAB_SIZE
    # BPE with no merges splits text into single characters; Fuse joins them back on decode.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    # A character it has no id for would be dropped (an env's tab or accent; text of nothing
    # but those, no ids at all): a tab reads as a space, a carriage return as nothing (CRLF as a
    # newline), anything else as "?".
    replace = [normalizers.Replace("\t", " "), normalizers.Replace("\r", ""), normalizers.Replace(Regex("[^\n -~]"), "?")]
    tok.normalizer = normalizers.Sequence(replace)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.model_max_length = 1 << 20
    fast.chat_template = CHAR_CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(str(path))
    return str(path)


UNKNOWN_ID_TEXT = "\ufffd"
KEPT_SPECIALS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
"""Tags a reply's text keeps where a tokenizer marks them special (Hermes-2-Pro's tool tags): a
tool parser reads them, and without them a model's every call read as its final answer."""


def reply_text(tokenizer, ids: list[int]) -> str:
    """Sampled token ids as the text an env, a reward or a scorer reads, specials skipped but
    KEPT_SPECIALS. An id past the tokenizer's own (a model whose vocabulary is padded beyond
    it, as the built-in character tokenizer's 99 ids are in the default's 128 rows) reads as
    U+FFFD: the tokenizer drops it, and a reply with such tokens read as the same reply without them."""
    n = len(tokenizer)
    if all(i < n for i in ids):
        return _decode(tokenizer, ids)
    parts, run = [], []
    for i in ids:
        if i < n:
            run.append(i)
            continue
        parts += [_decode(tokenizer, run), UNKNOWN_ID_TEXT]
        run = []
    return "".join(parts) + _decode(tokenizer, run)


def _decode(tokenizer, ids: list[int]) -> str:
    kept, special = _specials(tokenizer)
    if not kept.intersection(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False)


@functools.lru_cache(maxsize=16)
def _specials(tokenizer) -> tuple[frozenset[int], frozenset[int]]:
    """(the special ids of KEPT_SPECIALS, the other special ids) of `tokenizer`."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    kept = {i for i in special if tokenizer.convert_ids_to_tokens(i) in KEPT_SPECIALS}
    return frozenset(kept), frozenset(special - kept)


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""What transformers 5 writes as `tokenizer_class` for a tokenizer of no model's own class."""


def generic_tokenizer_class(path: str) -> bool:
    """Whether `AutoTokenizer` would load the tokenizer at `path` by its generic class, read
    off its files alone: no model config (`config.json`), no remote-code `auto_map`, and the
    generic class named in tokenizer_config.json. Then `AutoTokenizer.from_pretrained` only
    resolves that class by name and calls its `from_pretrained`, and `load_tokenizer` calls it
    directly: on its first use `AutoTokenizer` (transformers 5.19) imports the model registry
    (its auto-model modules, generation, and through them torch._dynamo), seconds of CPU in
    every rollout worker and the controller (python -X importtime). The character tokenizer
    of the default and the tests is such a tokenizer."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
    except (OSError, ValueError):
        return False
    return (
        isinstance(tokenizer_config, dict)
        and not os.path.exists(os.path.join(path, "config.json"))
        and "auto_map" not in tokenizer_config
        and tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
    )


def load_tokenizer(path: str | os.PathLike):
    """Load a Hugging Face tokenizer from a local directory (never from a hub)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} not found")
    if generic_tokenizer_class(str(path)):  # AutoTokenizer's pick, without its seconds of imports
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A plain-text first prompt's token ids: the text's, after the BOS the tokenizer puts first
    on its own (Llama's and Gemma's do; Qwen's and the character tokenizer put none), which a
    model trained with it expects; never an EOS a tokenizer may append. (A chat template
    writes the specials it wants in its text.)"""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos] and list(tokenizer.encode("a", add_special_tokens=True))[:1] == [bos]:
        ids.insert(0, bos)
    return ids


def check_tokenizer_dir(c: Config) -> None:
    """model.tokenizer, when set, is a directory."""
    m = c.model
    if m.tokenizer is not None and not os.path.isdir(m.tokenizer):
        raise ConfigError("model.tokenizer", f"directory {m.tokenizer!r} not found: give a local tokenizer directory, or null for the default")


def check_tokenizer(c: Config):
    """A tokenizer loads from model.tokenizer, else from model.path (none to load: the built-in
    character tokenizer), and the policy's vocabulary (its checkpoint's, else model.vocab_size)
    has an embedding row for each of its token ids. Returns the tokenizer it loaded (None for the
    built-in one), for the checks after it to read the run's prompts with."""
    m = c.model
    tokenizer_dir, field_path = (m.tokenizer, "model.tokenizer") if m.tokenizer else (m.path, "model.path")
    if tokenizer_dir is None:
        _covers(c, len(char_vocab()), "meshrl's built-in character tokenizer")
        return None

    # a directory with no tokenizer file at all is refused without importing transformers (seconds)
    def tokenizer_file(name: str) -> bool:
        return any(part in name for part in ("token", "vocab", "merges")) or name.endswith(".model")

    if os.path.isdir(tokenizer_dir) and not any(map(tokenizer_file, os.listdir(tokenizer_dir))):
        raise ConfigError(
            field_path,
            f"no tokenizer loads from {tokenizer_dir!r}: it holds no tokenizer file (tokenizer.json, tokenizer_config.json, a vocabulary, "
            "merges or a sentencepiece model); give a Hugging Face tokenizer's directory",
        )
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
        size = len(tokenizer)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the directory is the user's to fix
        raise ConfigError(
            field_path,
            f"no tokenizer loads from {tokenizer_dir!r} ({type(e).__name__}: {first_line(str(e), 160)}): "
            "give a directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer_config.json)",
        ) from None
    _covers(c, size, f"the tokenizer at {field_path}={tokenizer_dir!r}")
    return tokenizer


def _covers(c: Config, size: int, which: str) -> None:
    """The policy's vocabulary has room for the `size` token ids of its tokenizer (`which`).
    (Each model beside it covers the policy's: trainer/checks.py `check_models_vocabulary`.)"""
    if c.model.path is None:
        vocab, field_path = c.model.vocab_size, "model.vocab_size"
    else:
        from meshrl.config.hf import model_args_from_hf

        vocab, field_path = model_args_from_hf(c.model.path)[0].vocab_size, "model.path"  # it loads: check_model came first
    if vocab < size:
        fix = f"set it to at least {size}" if c.model.path is None else "give the checkpoint its own tokenizer (model.tokenizer)"
        raise ConfigError(field_path, f"its vocabulary ({vocab}) is smaller than that of {which} ({size} tokens): {fix}")
