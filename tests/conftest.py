"""Shared test helpers: tokenizers built on the spot, so no test needs a hub or a checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import string
import subprocess
import sys
import time

import pytest

# Test procs keep their output on the terminal, where pytest shows it with a failure; the
# console tests run `meshrl` in a subprocess without this, to check the quiet default.
os.environ.setdefault("MESHRL_VERBOSE", "1")

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


# ---- a generator actor with test-only endpoints ---------------------------------------------
_TEST_ACTORS: dict = {}


def _generator_test_actor():
    """`GeneratorActor` plus the endpoints only tests use: weights carried in the message
    (`load_weights`, small models) and the engine's weights checksum. Built on first use,
    so that test modules that never spawn one do not import Monarch and vLLM's wrapper."""
    from monarch.actor import concurrent_endpoint

    from meshrl.generator.actor import GeneratorActor

    class GeneratorTestActor(GeneratorActor):
        @concurrent_endpoint
        async def load_weights(self, version: int, tensors: dict, mode: str | None = None) -> float:
            """Apply full HF-named tensors as `version` in `mode` (default generator.update_mode);
            returns the seconds generation was held."""
            return await self._gen().update_weights(version, tensors, mode)

        @concurrent_endpoint
        async def weights_checksum(self) -> float:
            return await self._gen().engine.weights_checksum()

    GeneratorTestActor.__module__ = __name__
    GeneratorTestActor.__qualname__ = "GeneratorTestActor"
    return {"GeneratorTestActor": GeneratorTestActor}


# ---- weight sync ---------------------------------------------------------------------------------
def fetched_into_shared_buffer(named):
    """`named` (a list of (name, tensor)) as a subscriber's fetch leaves it: packed into a
    shared-memory receive buffer and handed out as version 1. Returns (the ReceiveBuffers,
    the flat buffer, the views)."""
    from meshrl.weightsync import plan_layout
    from meshrl.weightsync.buffers import ReceiveBuffers
    from meshrl.weightsync.layout import pack

    layout = plan_layout(named, 1 << 20)
    bufs = ReceiveBuffers(shared_memory=True)
    bufs.set_layout(layout)
    flat = bufs.take()
    pack(flat, layout, named)
    return bufs, flat, bufs.hand_out(1, flat)


# ---- hand-made episode groups -----------------------------------------------------------------
def make_group(gid: int, n: int, versions: list[int], prompt_len: int = 3, advantage: str = "grpo_no_std"):
    """A packed group of `n` single-turn episodes (group id `gid`, sample ids gid * 100 + i):
    a `prompt_len`-token prompt, then one model turn whose tokens carry `versions`; episode
    i has reward i. Advantages are filled in (`advantage` mode), as a rollout worker does."""
    from meshrl.episode import Episode, Turn, assign_advantages, pack

    episodes = [
        Episode(gid, gid * 100 + i, [
            Turn("env", list(range(1, prompt_len + 1))),
            Turn("model", [7] * len(versions), [-0.5] * len(versions), list(versions), reward=float(i)),
        ])
        for i in range(n)
    ]
    return assign_advantages(pack(episodes), advantage)


# ---- a trainer actor and mesh with test-only endpoints -----------------------------------------
def _trainer_test_classes() -> dict:
    """`TrainerActor` / `TrainerMesh` plus what only tests use: scoring a batch on the mesh,
    full HF weights in the message (small models) and each rank's local parameter and
    optimizer shards. Built on first use, like GeneratorTestActor; spawn them with
    `spawn_trainer(..., actor_class=InspectableTrainerActor, mesh_class=InspectableTrainerMesh)`."""
    import torch
    from monarch.actor import endpoint
    from tensordict import TensorDict

    from meshrl.trainer.actor import TrainerActor, TrainerMesh

    class InspectableTrainerActor(TrainerActor):
        @endpoint
        async def compute_logprobs(self, batch: TensorDict) -> tuple[list[int], torch.Tensor]:
            return self._need().compute_logprobs(batch)

        @endpoint
        async def get_hf_state_dict(self, dtype: str | None = None) -> dict[str, torch.Tensor] | None:
            """Full HF-named weights on rank 0 (None elsewhere). Small models only: bulk
            transfer belongs to the weight-sync transport, which iterates `hf_state_dict()` in-proc."""
            sd = dict(self._need().hf_state_dict(getattr(torch, dtype) if dtype else None))
            return sd if self._need().rank == 0 else None

        @endpoint
        async def get_params(self) -> dict[str, torch.Tensor]:
            """This rank's local shards of every parameter (tests compare them bit for bit)."""
            from torch.distributed.tensor import DTensor

            return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in self._need().model.named_parameters()}

        @endpoint
        async def get_optimizer_state(self) -> dict:
            """This rank's optimizer state with local tensors."""
            from torch.distributed.tensor import DTensor

            state = self._need().optimizer.state_dict()["state"]
            return {k: {n: (v.to_local() if isinstance(v, DTensor) else v).clone() for n, v in s.items()} for k, s in state.items()}

    class InspectableTrainerMesh(TrainerMesh):
        async def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
            """[B, T] log-probs of every model token under the current weights."""
            out = torch.zeros(batch["tokens"].shape, dtype=torch.float32)
            for rows, values in await self._all(self.actors.compute_logprobs, batch):
                if rows:
                    out[rows] = values
            return out

        async def hf_state_dict(self, dtype: str | None = None) -> dict[str, torch.Tensor]:
            return (await self._all(self.actors.get_hf_state_dict, dtype))[0]

    classes = {"InspectableTrainerActor": InspectableTrainerActor, "InspectableTrainerMesh": InspectableTrainerMesh}
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


_TEST_CLASS_BUILDERS = {
    "GeneratorTestActor": _generator_test_actor,
    "InspectableTrainerActor": _trainer_test_classes,
    "InspectableTrainerMesh": _trainer_test_classes,
}


def __getattr__(name: str):
    """`from tests.conftest import GeneratorTestActor` (and the trainer's test classes): also
    how a spawned proc finds the class, by its module path."""
    if name not in _TEST_CLASS_BUILDERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _TEST_ACTORS:
        _TEST_ACTORS.update(_TEST_CLASS_BUILDERS[name]())
    return _TEST_ACTORS[name]


# ---- two hosts on one machine: network namespaces joined by a veth pair ---------------------------
class NetnsHosts:
    """Network namespaces "hosts" A (10.77.0.1) and B (10.77.0.2), joined by a veth pair; each
    with its own loopback. `run(host, cmd)` starts a process inside one, `listeners(host)`
    lists what listens there (`ss`), `stop()` kills whatever still runs inside and deletes
    them (the veth pair goes with them)."""

    ADDRESSES = {"a": "10.77.0.1", "b": "10.77.0.2"}

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = {h: f"meshrl-{tag}-{h}" for h in self.ADDRESSES}
        self.links = {h: f"mrl{tag}{h}" for h in self.ADDRESSES}
        self.procs: list = []

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def start(self) -> "NetnsHosts":
        try:
            for h in self.names:
                self._ip("netns", "add", self.names[h])
            self._ip("link", "add", self.links["a"], "type", "veth", "peer", "name", self.links["b"])
            for h, addr in self.ADDRESSES.items():
                self._ip("link", "set", self.links[h], "netns", self.names[h])
                self._ip("-n", self.names[h], "addr", "add", f"{addr}/24", "dev", self.links[h])
                self._ip("-n", self.names[h], "link", "set", self.links[h], "up")
                self._ip("-n", self.names[h], "link", "set", "lo", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, host: str, cmd: list[str], log_path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return proc

    def worker(self, host: str, port: int, log_path) -> subprocess.Popen:
        return self.run(host, [sys.executable, "-m", "meshrl", "worker", "--address", f"{self.ADDRESSES[host]}:{port}"], log_path)

    def pids(self, host: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: str) -> None:
        """Every process inside `host`, at once: the host dies."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def listeners(self, host: str) -> set[tuple[str, str]]:
        """(protocol, local address) of every listening TCP socket and unconnected UDP socket in `host`."""
        out = subprocess.run(["ip", "netns", "exec", self.names[host], "ss", "-Hltun"], capture_output=True, text=True, timeout=30).stdout
        found = set()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 5:
                found.add((fields[0], fields[4].rsplit(":", 1)[0].strip("[]")))
        return found

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for h in self.names:
            self.kill(h)
        deadline = time.monotonic() + 30
        while any(self.pids(h) for h in self.names) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in self.names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why two network namespaces cannot be made here (not root, no `ip`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "network namespaces need iproute2 (`ip`, `ss`)"
    probe = f"meshrl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="module")
def two_hosts():
    why = netns_unavailable()
    if why:
        pytest.skip(f"two hosts on one machine: {why}")
    hosts = NetnsHosts().start()
    try:
        yield hosts
    finally:
        hosts.stop()


def build_digit_teacher(path: str | os.PathLike, seed: int = 0) -> str:
    """A distillation teacher for the default model's shapes and the character tokenizer: a
    random Qwen3 whose every next-token distribution leans to the digits (hidden dim 0
    of every embedding is a positive constant that the digits' lm_head rows read strongly),
    saved as a Hugging Face checkpoint."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from meshrl.tokenizer import build_char_tokenizer, load_tokenizer

    tok = load_tokenizer(build_char_tokenizer(os.path.join(str(path), "tokenizer")))
    digits = tok.convert_tokens_to_ids(list(string.digits))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        model.lm_head.weight[digits, 0] = 0.6  # about 80% of each next token's mass on the digits
    model.save_pretrained(str(path))
    return str(path)


def build_lora_base(path: str | os.PathLike, seed: int = 0, head_scale: float = 8.0) -> str:
    """A LoRA base for the default model's shapes and the character tokenizer: the
    from-scratch policy with its lm_head scaled by `head_scale`. A LoRA leaves the head and the final
    norm frozen, and the from-scratch head (std 0.02) caps every token's probability near
    uniform: at most 0.113 of the mass can go to the 10 digits whatever the hidden state.
    A pretrained base has a sharp head; this one stands in for it."""
    import torch

    from meshrl.config import ModelConfig
    from meshrl.tokenizer import build_char_tokenizer
    from meshrl.trainer import checkpoint as ckpt
    from meshrl.trainer.model import build_model

    model, specs = build_model(ModelConfig(), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    out = ckpt.export_hf(model, specs, path)
    build_char_tokenizer(out)
    return out
