"""Chat rendering by appending ids, tool-call parsers, tool schemas and ToolEnv. No model, no network."""

from __future__ import annotations

import asyncio

import pytest

from meshrl.rollout.chat import ChatRenderer
from meshrl.rollout.env import ModelTurn
from meshrl.rollout.tools import ToolCall, ToolEnv, compact, hermes, resolve_parser, tool_schema
from meshrl.tokenizer import CHAR_VOCAB_SIZE
from tests.conftest import NL


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def calc(expression: str) -> str:
    return str(eval(expression, {"__builtins__": {}}))


def boom(x: str = "") -> str:
    raise RuntimeError("kaboom")


async def slow() -> str:
    await asyncio.sleep(30)
    return "never"


CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
# (model text, what the env says next) per turn; the last text ends with "<" to check that a
# turn cut by length is not mistaken for one that wrote the start of its closing glue.
QWEN_TURNS = [
    (CALL, [{"role": "tool", "content": "7"}, {"role": "tool", "content": "ok"}]),
    ("It is 7.", [{"role": "user", "content": "And 1+1?"}]),
    ("2 <", [{"role": "user", "content": "Sure?"}]),
]
CHAR_TURNS = [("!3+4", [{"role": "tool", "content": "7"}]), ("7", [{"role": "user", "content": "ok?"}]), ("1<", [{"role": "user", "content": "x"}])]


def play(renderer: ChatRenderer, tok, prompt: list[dict], turns, ended: bool):
    """An episode built turn by turn as a rollout worker builds it; also returns the
    conversation as messages and where each model turn's ids were put."""
    ids = renderer.initial_ids(prompt)
    messages, spans = list(prompt), []
    for text, observation in turns:
        model_ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if ended else [])
        spans.append((len(ids), model_ids))
        ids = ids + model_ids + renderer.continuation_ids(model_ids, observation)
        messages += [{"role": "assistant", "content": text}, *observation]
    return ids, messages, spans


@pytest.mark.parametrize("ended", [True, False], ids=["end-of-turn", "cut-by-length"])
@pytest.mark.parametrize("style", ["char", "qwen"])
def test_appended_ids_render_the_whole_conversation(style, ended, char_tokenizer, qwen_style_tokenizer):
    if style == "char":
        tok, tools, turns = char_tokenizer, None, CHAR_TURNS
        prompt = [{"role": "user", "content": "3+4?"}]
    else:
        tok, tools, turns = qwen_style_tokenizer, [tool_schema(add)], QWEN_TURNS
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]
    renderer = ChatRenderer(tok, tools=tools)
    ids, messages, spans = play(renderer, tok, prompt, turns, ended)

    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids, skip_special_tokens=False) == full
    # Character-level tokenization is canonical, so the ids themselves must agree too.
    assert ids == tok.encode(full, add_special_tokens=False)
    for start, model_ids in spans:
        assert ids[start : start + len(model_ids)] == model_ids


def test_char_template_is_compact_and_keeps_the_ids(char_tokenizer):
    tok = char_tokenizer
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["a", " ", "\n"]) == [13, 97, 98]
    assert len(tok) <= CHAR_VOCAB_SIZE
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "tool", "content": "7"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos>Ss<eos><bos>Uhi<eos><bos>Ayo<eos><bos>T7<eos><bos>A"
    assert len(tok.encode("<bos>Uhi<eos>", add_special_tokens=False)) == len("hi") + 3


def test_char_tokenizer_reads_characters_it_has_no_id_for(char_tokenizer):
    """A tab or an accented letter was dropped, and text of nothing but those had no ids at all
    (an empty prompt, which the generator refuses): a tab reads as a space, the rest as "?"."""
    ids = char_tokenizer.encode("a\tb é", add_special_tokens=False)
    assert char_tokenizer.decode(ids) == "a b ?"
    assert char_tokenizer.decode(char_tokenizer.encode("a\r\nb", add_special_tokens=False)) == "a\nb"
    assert len(char_tokenizer.encode("\t\u00e9\u4e2d", add_special_tokens=False)) == 3
    assert char_tokenizer.encode("<bos>x", add_special_tokens=False) == [1, char_tokenizer.convert_tokens_to_ids("x")]  # specials stay


def test_a_text_prompt_starts_with_the_bos_its_tokenizer_puts_first(tmp_path, char_tokenizer):
    """A Llama-style tokenizer puts BOS before every text on its own, and its model expects it;
    a plain-text prompt was tokenized without it. The character tokenizer (like Qwen's) puts
    none: its prompts are as they were."""
    from tokenizers import processors

    from meshrl.tokenizer import build_char_tokenizer, load_tokenizer

    path = build_char_tokenizer(tmp_path / "llama_style")
    llama_style = load_tokenizer(path)
    llama_style.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    text = char_tokenizer.encode("ab:", add_special_tokens=False)
    assert ChatRenderer(llama_style).initial_ids("ab:") == [1, *text]
    assert ChatRenderer(llama_style).initial_ids("<bos>ab:") == [1, *text]  # written by the caller: not twice
    assert ChatRenderer(char_tokenizer).initial_ids("ab:") == text
    assert ChatRenderer(llama_style).continuation_ids([5], "cd") == char_tokenizer.encode("cd", add_special_tokens=False)  # a later text: no BOS


def test_load_tokenizer_gives_what_autotokenizer_gives(tmp_path):
    """`load_tokenizer` skips AutoTokenizer (and its imports) only where AutoTokenizer would pick
    the generic class from the tokenizer files alone, and the tokenizer it loads is the same."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from meshrl.tokenizer import build_char_tokenizer, generic_tokenizer_class, load_tokenizer
    from tests.conftest import build_qwen_style_tokenizer

    messages = [{"role": "user", "content": "hi 2+3?"}, {"role": "assistant", "content": "5"}]
    for path in (build_char_tokenizer(tmp_path / "char"), build_qwen_style_tokenizer(tmp_path / "qwen")):
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert generic_tokenizer_class(path) and type(ours) is type(auto)
        assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)
        assert ours("ab c\n")["input_ids"] == auto("ab c\n")["input_ids"] and ours.init_kwargs == auto.init_kwargs
        assert (ours.pad_token_id, ours.eos_token_id, len(ours)) == (auto.pad_token_id, auto.eos_token_id, len(auto))
    # a model's config beside it, or remote code, or a class of a model's own: AutoTokenizer decides
    with_config = shutil.copytree(tmp_path / "char", tmp_path / "with_config")
    (with_config / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    remote = shutil.copytree(tmp_path / "char", tmp_path / "remote")
    own_class = shutil.copytree(tmp_path / "char", tmp_path / "own_class")
    for folder, change in ((remote, {"auto_map": {"AutoTokenizer": [None, "tok.Tok"]}}), (own_class, {"tokenizer_class": "Qwen2Tokenizer"})):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | change))
    assert not any(generic_tokenizer_class(str(path)) for path in (with_config, remote, own_class, tmp_path / "nothing"))


def test_glue_and_specials(qwen_style_tokenizer, char_tokenizer):
    tok = qwen_style_tokenizer
    renderer = ChatRenderer(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ended = renderer.continuation_ids((5, im_end), [{"role": "user", "content": "hi"}])  # a tuple, as samplers may give
    assert tok.decode(ended, skip_special_tokens=False) == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ended.count(im_start) == 2  # a special written in the template's text is one id
    cut = renderer.continuation_ids([5], [{"role": "user", "content": "hi"}])
    assert cut == [im_end] + ended
    # The env parses calls from the turn decoded without specials: the call tags must survive.
    assert renderer.decode(tok.encode(CALL + "<|im_end|>", add_special_tokens=False)) == CALL
    assert ChatRenderer(char_tokenizer).continuation_ids([40, 2], [{"role": "tool", "content": "7"}]) == char_tokenizer.encode(
        "<bos>T7<eos><bos>A", add_special_tokens=False
    )


def test_text_and_ids_observations_are_appended_as_they_are(char_tokenizer):
    renderer = ChatRenderer(char_tokenizer)
    assert renderer.initial_ids("copy:ab=") == char_tokenizer.encode("copy:ab=", add_special_tokens=False)
    assert renderer.initial_ids([5, 6]) == [5, 6]
    assert renderer.continuation_ids([7, 2], " more") == char_tokenizer.encode(" more", add_special_tokens=False)
    assert renderer.continuation_ids([7, 2], [9, 1]) == [9, 1]
    assert renderer.continuation_ids([7, 2], []) == []
    assert renderer.decode(char_tokenizer.encode("hi<eos>", add_special_tokens=False)) == "hi"


def test_a_template_that_rewrites_a_closed_turn_is_refused(char_tokenizer):
    char_tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% if loop.last %}END{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="cannot be continued by appending"):
        ChatRenderer(char_tokenizer).continuation_ids([7], [{"role": "user", "content": "x"}])


def test_what_comes_before_the_model_turn_may_change(qwen_style_tokenizer):
    # Like Qwen3, which drops the empty think block of an assistant turn that is not the last.
    tok = qwen_style_tokenizer
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}"
        + NL
        + "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>"
        + NL
        + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
        + NL
        + "{% endif %}"
    )
    ids = ChatRenderer(tok).continuation_ids([tok.eos_token_id], [{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hermes():
    assert hermes("The answer is 7.") == []
    assert hermes(CALL) == [ToolCall("add", {"a": 3, "b": 4})]
    two = hermes(
        'a <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}, "id": "c1"}</tool_call>'
    )
    assert two == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("calc", {"expression": "2*3"}, id="c1")]
    as_string = hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    assert as_string == [ToolCall("add", {"a": 1, "b": 2})]
    for bad in (
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "argu',
    ):
        (call,) = hermes(bad)
        assert call.name == "" and "malformed tool call" in call.arguments["_error"]
    # a call drafted while thinking is no call (two of a budget of four were spent on them); nor is one still thinking
    drafted = '<think>maybe <tool_call>{"name": "add", "arguments": {"a": 9, "b": 9}}</tool_call>? no.</think>' + CALL
    assert hermes(drafted) == [ToolCall("add", {"a": 3, "b": 4})] and hermes("<think>maybe " + CALL) == []
    # a tag the text mentions before a block does not swallow the block (it read as one malformed call)
    assert hermes("Use the <tool_call> tag like this:\n" + CALL) == [ToolCall("add", {"a": 3, "b": 4})]


def test_tool_tags_a_tokenizer_marks_special_stay_in_the_replys_text(tmp_path):
    """A tokenizer that marks `<tool_call>` special (Hermes-2-Pro's does): the reply's text was
    decoded with specials skipped, the tags with them, and the parser found no call: every
    call read as the model's final answer. The tags stay; the turn's end token still goes."""
    from tokenizers import AddedToken

    from meshrl.tokenizer import load_tokenizer, reply_text
    from tests.conftest import build_qwen_style_tokenizer

    tok = load_tokenizer(build_qwen_style_tokenizer(tmp_path / "tok"))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")], special_tokens=True)
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    ids = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True).startswith('{"name"')  # what it read
    text = reply_text(tok, ids)
    assert text == call and [c.name for c in hermes(text)] == ["calc"]
    assert reply_text(tok, tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]) == "4"


def test_compact_and_resolve_parser():
    assert compact("!3*4") == [ToolCall("", {"_text": "3*4"})]
    assert compact("! 3*4 ") == [ToolCall("", {"_text": "3*4"})]
    assert compact("12") == compact("12!") == []
    assert resolve_parser("hermes") is hermes and resolve_parser("compact") is compact
    assert resolve_parser("meshrl.rollout.tools:compact") is compact
    with pytest.raises(ValueError, match="hermes, compact"):
        resolve_parser("xml")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_parser("meshrl.rollout.tools:nope")


def test_tool_schema():
    assert tool_schema(add)["function"] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "required": ["a", "b"],
            "properties": {"a": {"type": "integer", "description": "The first integer."}, "b": {"type": "integer", "description": "The second integer."}},
        },
        "return": {"type": "integer"},
    }

    def lookup(key: str, limit: int | None = None, exact: bool = True, *rest, **more):
        """Look a key up. No Args section."""

    schema = tool_schema(lookup)
    assert schema["type"] == "function"
    assert schema["function"] == {
        "name": "lookup",
        "description": "Look a key up. No Args section.",
        "parameters": {
            "type": "object",
            "required": ["key"],
            "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
        },
    }
    assert tool_schema(lambda x: x)["function"]["parameters"]["properties"] == {"x": {}}


def run_turn(env: ToolEnv, text: str):
    return asyncio.run(env.step(ModelTurn(text=text, token_ids=[], finish_reason="stop")))


def test_tool_env_answers_calls_with_tool_messages():
    env = ToolEnv([add, calc], system_prompt="Use tools.")
    assert env.reset({"prompt": "What is 3+4?", "answer": "7"}) == [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 3+4?"}]
    assert [s["function"]["name"] for s in env.tools_schema] == ["add", "calc"]
    result = run_turn(env, CALL)
    assert not result.done and result.reward == 0.0 and result.info == {"tool_calls": 1}
    assert result.observation == [{"role": "tool", "name": "add", "content": "7"}]
    assert env.tool_results == ["7"]
    final = run_turn(env, " 7 ")
    assert final.done and final.reward == 1.0
    env.reset({"prompt": [{"role": "user", "content": "hi"}], "answer": "7"})
    assert run_turn(env, "8").reward == 0.0


def test_tool_env_turns_failures_into_error_messages():
    env = ToolEnv([add, boom, slow], tool_timeout_s=0.05, max_tool_calls=5)
    env.reset({"prompt": "p", "answer": "x"})
    calls = "".join(
        f"<tool_call>{c}</tool_call>"
        for c in (
            '{"name": "boom", "arguments": {}}',
            '{"name": "slow", "arguments": {}}',
            '{"name": "nope", "arguments": {}}',
            '{"name": "add", "arguments": {"a": 1}}',
            '{"name": "add"',
            '{"name": "add", "arguments": {"a": 1, "b": 1}}',
        )
    )
    result = run_turn(env, calls)
    contents = [m["content"] for m in result.observation]
    assert contents[0] == "error: RuntimeError: kaboom"
    assert contents[1] == "error: tool 'slow' timed out after 0.05 s"
    assert contents[2] == "error: unknown tool 'nope'; the tools are add, boom, slow"
    assert contents[3].startswith("error: TypeError:")
    assert contents[4].startswith("error: malformed tool call")
    assert contents[5] == "error: tool call budget of 5 calls spent"
    assert not result.done and result.info == {"tool_calls": 5}
    assert env.tool_results == []


def test_tool_env_call_budget_and_compact_calls():
    env = ToolEnv([calc], parser="compact", max_tool_calls=2)
    env.reset({"prompt": "3*4?", "answer": "12"})
    assert run_turn(env, "!3*4").observation == [{"role": "tool", "name": "calc", "content": "12"}]
    assert run_turn(env, "!2+2").observation[0]["content"] == "4"
    spent = run_turn(env, "!1+1")  # over budget: the turn is taken as the answer
    assert spent.done and spent.reward == 0.0
    assert env.tool_results == ["12", "4"]
    env.reset({"prompt": "3*4?", "answer": "12"})
    assert env.tool_results == [] and run_turn(env, "12").reward == 1.0


def test_tool_env_score_hook():
    class LastResultEnv(ToolEnv):
        def score(self, answer_text, sample):  # a sync override is accepted too
            return float(bool(self.tool_results) and self.tool_results[-1] == answer_text)

    env = LastResultEnv([calc], parser="compact")
    env.reset({"prompt": "?"})
    run_turn(env, "!6*7")
    assert run_turn(env, "42").reward == 1.0


def test_a_slow_sync_score_leaves_the_workers_loop_and_bound_free():
    """A plain `def score` (a slow verifier) runs in a thread: the worker's event loop goes on
    with its other episodes, and the step's bound (rollout.env_timeout_s) cuts it off."""
    import threading
    import time

    release = threading.Event()

    class SlowVerifier(ToolEnv):
        def score(self, answer_text, sample):
            release.wait(10)
            return 1.0

    async def episode_and_a_tick():
        env = SlowVerifier([calc], parser="compact")
        env.reset({"prompt": "?"})
        step = asyncio.ensure_future(env.step(ModelTurn(text="42", token_ids=[], finish_reason="stop")))
        start = time.monotonic()
        await asyncio.sleep(0.05)  # another episode's turn on the same loop
        ticked = time.monotonic() - start
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(step), 0.2)  # the step's bound fires
        release.set()
        return ticked, (await step).reward

    ticked, reward = asyncio.run(episode_and_a_tick())
    assert ticked < 1.0 and reward == 1.0


def test_a_failing_sandbox_fails_the_episode_not_the_models_call():
    """A sandbox that cannot start (no namespaces left, a start past its bound) is the run's
    failure, not the model's: it raises out of the step, so the episode fails and is not
    trained on as a tool error the model caused."""
    from meshrl.rollout.sandbox import SandboxError

    def python(code: str = "") -> str:
        """Run code."""
        raise SandboxError("sandbox did not start within 30 s")

    env = ToolEnv([python], max_tool_calls=2)
    env.reset({"prompt": "p"})
    with pytest.raises(SandboxError, match="did not start"):
        run_turn(env, '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
