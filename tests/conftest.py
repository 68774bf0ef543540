"""Shared test helpers: tokenizers built on the spot, so no test needs a hub or a checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
import types

import pytest


def pytest_collection_finish(session):
    import gc

    gc.freeze()  # torch, vLLM and the test modules: alive until the end, never walked again


def pytest_unconfigure(config):
    import gc

    gc.unfreeze()  # the interpreter's last pass frees them as before (else nanobind reports leaks at exit)


def pytest_terminal_summary(terminalreporter):
    """The CPU the run had, under its results: learning curves and timings differ by CPU kind."""
    try:
        from benchmarks.common import machine
    except ImportError:  # run from outside the repository: no line, no failure
        return
    terminalreporter.write_line(machine_line(machine()))


def machine_line(m: dict) -> str:
    return f"machine: {m['cpu_model']}, {m['cpus']} CPUs, flags {' '.join(m['cpu_flags']) or '-'}, {m['mem_gib']} GiB"


def learning_report(metrics: list[dict], key: str = "trainer/reward_mean") -> str:
    """What a failed learning assertion prints: the whole curve, what each step trained on and
    the machine, so that a failure in CI on a CPU kind never seen here says why it did not learn."""
    from benchmarks.common import machine

    rows = [r for r in metrics if key in r]

    def series(name: str, digits: int = 3) -> list:
        return [round(r[name], digits) if name in r else None for r in rows]

    return "\n".join(
        [
            f"{key}: {series(key)}",
            f"trainer/zero_variance_groups: {series('trainer/zero_variance_groups', 2)}",
            f"trainer/masked_frac: {series('trainer/masked_frac')}  trainer/clip_frac: {series('trainer/clip_frac')}",
            f"trainer/logprob_mismatch: {series('trainer/logprob_mismatch', 5)}",
            f"trainer/grad_norm: {series('trainer/grad_norm')}  trainer/staleness_max: {series('trainer/staleness_max', 0)}",
            machine_line(machine()),
        ]
    )


def pytest_configure(config):
    # The suite's process is the controller of every in-process run: it collects young objects
    # every 100,000 allocations, as meshrl's own processes do (meshrl/collector.py), and
    # freezes what collection imported (pytest_collection_finish).
    from meshrl import collector

    collector.fewer_passes()
    # Test procs keep their output on the terminal, where pytest shows it with a failure; the
    # console tests run `meshrl` in a subprocess without this, to check the quiet default.
    # Set here, not at import: a `meshrl` subprocess that imports a test module's env or
    # reward (which may import these helpers) must keep its own console.
    os.environ.setdefault("MESHRL_VERBOSE", "1")
    # The suite kills procs on purpose. Monarch's answer to a dead proc's mesh that nothing
    # handled is to interrupt the process owning it, even when the report arrives after the
    # test that killed it is over (at teardown, or as the interpreter exits): the session then
    # ends in a KeyboardInterrupt after every test passed. Each test asserts what it expects
    # of the procs it kills; a late report is printed here instead.
    import monarch.actor

    monarch.actor.unhandled_fault_hook = _print_unhandled_mesh_failure


def _print_unhandled_mesh_failure(failure) -> None:
    lines = str(failure).splitlines()
    print(f"tests: a mesh failure no test handled: {lines[0] if lines else repr(failure)}", file=sys.stderr)


NL = "{{ '\\n' }}"  # HF renders templates with trim_blocks, which eats a literal newline after a tag
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system" + NL + "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}" + NL + NL + "{% endif %}"
    "# Tools" + NL + "<tools>"
    "{% for tool in tools %}"
    + NL
    + "{{ tool | tojson }}{% endfor %}"
    + NL
    + "</tools>"
    + NL
    + 'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>'
    + NL
    + "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system" + NL + "{{ messages[0]['content'] }}<|im_end|>" + NL + "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    # Consecutive tool results share one user turn, as Qwen's own template has them.
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    + NL
    + "<tool_response>"
    + NL
    + "{{ m['content'] }}"
    + NL
    + "</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>" + NL + "{% endif %}"
    "{% elif not (m['role'] == 'system' and loop.first) %}"
    "<|im_start|>{{ m['role'] }}" + NL + "{{ m['content'] }}<|im_end|>" + NL + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
"""A Qwen-style chat template: tool schemas in the system block, tool results as
`<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>`, `<|im_end|>` ends a turn."""


def exact_answer(prompt, response, sample):
    """A reward for runs the tests start as `meshrl` processes: 1 where the response is the
    record's answer. It lives here, not in a test module, so that the process checking it
    imports nothing heavy for it (a test module imports most of meshrl)."""
    return float(response == sample["answer"])


REWARD_GATE_ENV = "MESHRL_TEST_REWARD_GATE"


def gated_digits_reward(prompt, response, sample):
    """task:digits' reward, held while the file named by $MESHRL_TEST_REWARD_GATE exists (at
    most 120 s, and at most `scoring.timeout_s`, past which the episode fails and its group is
    delivered): a test that must act while a run still has steps to go creates the file, so
    the run stops at its next batch whatever the machine's speed, and removes it after."""
    from meshrl.tasks import get_task

    gate = os.environ.get(REWARD_GATE_ENV)
    deadline = time.monotonic() + 120
    while gate and os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return get_task("digits").reward(prompt, response, sample)


@contextlib.contextmanager
def rewards_held(gate):
    """`gated_digits_reward` holds every reward while this block runs (the `gate` file exists)."""
    gate.touch()
    try:
        yield
    finally:
        gate.unlink()


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


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The character tokenizer saved once (read only by the tests that take it)."""
    from meshrl.tokenizer import build_char_tokenizer

    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


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


# ---- a child process (torch-only checks) -------------------------------------------------------
@contextlib.contextmanager
def child_process(target, *args):
    """Run `target(*args, queue)` in a fresh (spawned) process; yields the queue it answers on,
    and stops the process on the way out."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, out))
    child.start()
    try:
        yield out
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()


GLOO_RANK = """
import importlib, os, pickle, sys, traceback
import torch.distributed as dist
module, name, rank, world, port, args, out = pickle.loads(bytes.fromhex(sys.argv[1]))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
dist.init_process_group("gloo")
try:
    result = getattr(importlib.import_module(module), name)(rank, *args)
except BaseException:
    result = RuntimeError(traceback.format_exc()[-3000:])
finally:
    dist.destroy_process_group()
with open(out, "wb") as f:
    pickle.dump(result, f)
"""


def gloo_ranks(target, world: int, *args, timeout_s: float = 240) -> list:
    """Run `target(rank, *args)` (a module-level function) on `world` fresh interpreters joined
    in one gloo process group on loopback; returns their results by rank (picklable, with no
    tensors: numpy instead). A rank that raises makes this raise. Plain subprocesses, not
    multiprocessing: its resource tracker would outlive the test as a child of pytest."""
    import pickle
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [
            subprocess.Popen([sys.executable, "-c", GLOO_RANK, pickle.dumps((target.__module__, target.__name__, r, world, port, args, outs[r])).hex()])
            for r in range(world)
        ]
        try:
            for p in procs:
                p.wait(timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(30)
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited with {procs[r].returncode} and no result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    failed = {rank: r for rank, r in enumerate(results) if isinstance(r, BaseException)}
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return results


# ---- hand-made episode groups -----------------------------------------------------------------
class FakeReplica:
    """A generator replica's stand-in for GeneratorPool's unit tests: its actor's endpoints
    (`sync_weights`, `sleep`, `wake`, `pause_generation`, `resume_generation`) record their calls; `broken`: a weight update fails;
    `sync_s`: one takes this long. `stats` answers the health check with `stalled_s` (none: it
    never answers, as a replica busy applying an update); `killed` says whether `kill_leftovers` ran."""

    def __init__(self, index: int, broken: bool = False, stalled_s: float | None = 0.0, sync_s: float = 0.0):
        self.index, self.broken, self.stopped, self.calls, self.pids = index, broken, False, [], [(1000 + index, 0)]
        self.killed = False

        def endpoint(name: str):
            async def call(*args):
                if name == "sync_weights" and self.broken:
                    raise RuntimeError("the transfer broke")
                if name == "sync_weights":
                    await asyncio.sleep(sync_s)
                self.calls.append((name, *args))

            return types.SimpleNamespace(call_one=call)

        async def stats():
            if stalled_s is None:
                await asyncio.sleep(60)
            return {"stalled_s": stalled_s, "requests_in_flight": 3}

        self.actor = types.SimpleNamespace(
            **{name: endpoint(name) for name in ("sync_weights", "sleep", "wake", "pause_generation", "resume_generation")},
            stats=types.SimpleNamespace(call_one=stats),
        )

    def kill_leftovers(self):
        self.killed = True

    @property
    def synced(self) -> list[int]:
        return [call[1] for call in self.calls if call[0] == "sync_weights"]

    async def stop(self):
        self.stopped = True

    def on_this_host(self):
        return True

    def alive(self):
        return not self.stopped


def fake_pool(config, replicas: list, spawn=None):
    """A GeneratorPool over FakeReplicas for its unit tests: `replicas` its pool, `spawn(index)`
    what it starts (default: a fresh FakeReplica)."""
    from types import SimpleNamespace

    from meshrl.controller.replicas import GeneratorPool
    from meshrl.launch.devices import plan_devices

    async def on_change():
        pass

    async def fresh(index):
        return FakeReplica(index)

    pool = GeneratorPool(config, SimpleNamespace(plan=plan_devices(config)), "unused", 0, on_change=on_change)
    pool.replicas, pool.spawn = list(replicas), spawn or fresh
    return pool


def make_group(gid: int, n: int, versions: list[int], prompt_len: int = 3, advantage: str = "grpo_no_std"):
    """A packed group of `n` single-turn episodes (group id `gid`, sample ids gid * 100 + i):
    a `prompt_len`-token prompt, then one model turn whose tokens carry `versions`; episode
    i has reward i. Advantages are filled in (`advantage` mode), as a rollout worker does."""
    from meshrl.episode import Episode, Turn, assign_advantages, pack

    episodes = [
        Episode(
            gid,
            gid * 100 + i,
            [
                Turn("env", list(range(1, prompt_len + 1))),
                Turn("model", [7] * len(versions), [-0.5] * len(versions), list(versions), reward=float(i)),
            ],
        )
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

            return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in self._need().model.named_parameters()}

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

    def __init__(self, hostnames: bool = False):
        tag = f"{os.getpid() % 100000}"
        self.names = {h: f"meshrl-{tag}-{h}" for h in self.ADDRESSES}
        self.links = {h: f"mrl{tag}{h}" for h in self.ADDRESSES}
        self.hostnames = {h: f"mrl{tag}{h}" for h in self.ADDRESSES} if hostnames else {}
        """With `hostnames`, each host has a name of its own (a UTS namespace per process
        started by `run`) that resolves, inside both hosts, to its address (an /etc/hosts of
        their own, which `ip netns exec` mounts from /etc/netns/NAME/hosts): as cluster
        nodes are named, and as Slurm and Monarch's SlurmJob reach them."""
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
            if self.hostnames:
                table = "127.0.0.1 localhost\n" + "".join(f"{self.ADDRESSES[h]} {n}\n" for h, n in self.hostnames.items())
                for name in self.names.values():
                    os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                    with open(f"/etc/netns/{name}/hosts", "w") as f:
                        f.write(table)
        except BaseException:
            self.stop()
            raise
        return self

    def command(self, host: str, cmd: list[str]) -> list[str]:
        """`cmd` as run inside `host` (with its own hostname when the hosts have names)."""
        if self.hostnames:
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[host], *cmd]
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def run(self, host: str, cmd: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                self.command(host, cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        self.procs.append(proc)
        return proc

    def worker(self, host: str, port: int, log_path, env: dict | None = None) -> subprocess.Popen:
        return self.run(host, [sys.executable, "-m", "meshrl", "worker", "--address", f"{self.ADDRESSES[host]}:{port}"], log_path, env)

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
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def kill_during_snapshot(run_dir: str, pids: list[int], step: int, timeout_s: float = 300.0) -> threading.Thread:
    """SIGKILL `pids` as soon as the snapshot of `step` is being written (its temp directory
    exists: the batch of that step was taken and trained); if the write is never seen (it
    can finish between two looks), as soon as the snapshot is complete."""
    from meshrl.trainer.snapshot import snapshot_root

    root = snapshot_root(run_dir)
    name = f"step-{step:08d}"
    seen = {}

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.isdir(os.path.join(root, f".{name}.tmp")):
                seen["during_write"] = True
                break
            if os.path.isdir(os.path.join(root, name)):
                seen["during_write"] = False
                break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.seen = seen
    thread.start()
    return thread


def kill_during_checkpoint(session, pid: int, root: str, restarts) -> dict:
    """SIGKILL trainer proc `pid` inside one of `session`'s checkpoint calls: as soon as the
    trainer's write of this step under `root` (its checkpoint directory) is seen under way,
    or, when the write finished between two looks, just before a second call, which then
    meets a dead trainer. `restarts()`: that trainer's heals so far. Returns what the call did."""
    writing = os.path.join(root, f".step-{session.version:08d}.tmp")  # trainer/checkpoint.py's temp directory
    before, seen, done = restarts(), {}, threading.Event()

    def watch():
        while not done.is_set():
            if os.path.isdir(writing):
                seen["during_write"] = True
                os.kill(pid, signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    path = session.checkpoint()
    done.set()
    thread.join(5)
    if restarts() == before:  # the write was not seen under way
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        path = session.checkpoint()
    return {"path": path, "heals": restarts() - before, "version": session.version, **seen}


def check_exported_critic(path, values, batch) -> None:
    """transformers loads the critic exported at `path` as a one-label token classifier, and
    its logit at position t equals `values` (the critic's [B, T] values of `batch`) at t + 1,
    the state before that token, on every model token; `values` must not be all zero there."""
    import torch
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(path).eval()
    assert hf.config.num_labels == 1 and type(hf).__name__.endswith("ForTokenClassification")
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"]).logits[..., 0]
    mask = batch["loss_mask"][:, 1:]
    assert values[:, 1:][mask].abs().max() > 1e-3
    assert torch.allclose(logits[:, :-1][mask], values[:, 1:][mask], atol=1e-4)


def two_host_config(run_dir, wait_s: float, defaults: dict, **sections) -> dict:
    """The small problem (8 groups of 8, one micro-batch) run across two hosts, as
    tests/test_multihost.py and tests/test_slurm.py run it: `wait_s` bounds an engine's
    start-up and the trainer's wait for a batch; `defaults` (the test module's: its launcher
    and steps), then `sections` (the test's own), are merged in, section by section."""
    cfg = {
        "batch_groups": 8,
        "generator": {"group_size": 8, "max_new_tokens": 8, "max_num_seqs": 64, "startup_timeout_s": wait_s},
        "trainer": {"micro_batch_size": 64, "checkpoint_every": 0},
        "buffer": {"get_timeout_s": wait_s},
        "weight_sync": {"timeout_s": 60},
        "logging": {"run_dir": str(run_dir), "progress": False, "tensorboard": False, "plot": False},
    }
    for layer in (defaults, sections):
        for section, values in layer.items():
            cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return cfg


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example_config(name: str, run_dir, variant: str = "small", **sections) -> dict:
    """examples/NAME/VARIANT.yaml as a dict, the suite's way: `sections` merged in section by
    section (a user's files, such as data or a teacher, are given here), the run in
    `run_dir`, no progress bar. The suite runs the examples' small variants through this."""
    import yaml

    with open(os.path.join(EXAMPLES, name, f"{variant}.yaml")) as f:
        cfg = yaml.safe_load(f)
    for section, values in {**sections, "logging": {"progress": False, **sections.get("logging", {}), "run_dir": str(run_dir)}}.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return cfg


def example_module(path: str):
    """An example's script (examples/PATH) imported as a module, so a test calls what its
    command runs without starting another interpreter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(EXAMPLES, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def tiny_qwen3_config(eos_token_id: int = 2):
    """The default model's shapes as a Hugging Face Qwen3Config (vocab 128, hidden 64, 2
    layers, head_dim 32: the smallest head the vLLM CPU attention kernels accept)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_digit_teacher(path: str | os.PathLike, seed: int = 0) -> str:
    """A distillation teacher for the default model's shapes and the character tokenizer: a
    random Qwen3 whose every next-token distribution leans to the digits (hidden dim 0
    of every embedding is a positive constant that the digits' lm_head rows read strongly),
    saved as a Hugging Face checkpoint."""
    import torch
    from transformers import Qwen3ForCausalLM

    from meshrl.tokenizer import build_char_tokenizer, load_tokenizer

    tok = load_tokenizer(build_char_tokenizer(os.path.join(str(path), "tokenizer")))
    digits = tok.convert_tokens_to_ids(list(string.digits))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        model.lm_head.weight[digits, 0] = 0.6  # about 80% of each next token's mass on the digits
    model.save_pretrained(str(path))
    return str(path)


def build_lora_base(path: str | os.PathLike, seed: int = 0, head_scale: float = 8.0, family: str = "qwen3") -> str:
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

    model, specs = build_model(ModelConfig(family=family), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    out = ckpt.export_hf(model, specs, path)
    build_char_tokenizer(out)
    return out


# ---- a throwaway two-node Slurm cluster on those hosts ---------------------------------------------
SLURM_COMMANDS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol")


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster cannot be made here, or None. `scripts/setup-slurm.sh` installs it."""
    why = netns_unavailable()
    if why:
        return why
    if shutil.which("unshare") is None:
        return "named hosts need util-linux's `unshare`"
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [c for c in SLURM_COMMANDS if shutil.which(c, path=path) is None]
    if missing:
        return f"{', '.join(missing)} not installed (bash scripts/setup-slurm.sh, as root, installs Slurm and munge)"
    return None


def trainer_pid(pids: list[int], started_by: str) -> int | None:
    """The trainer's proc among a host's `pids`: the one Monarch proc whose parent or
    grandparent has `started_by` in its command line (`meshrl worker`; Slurm's `slurm_worker`
    task, whose child is Monarch's worker), on a host where the trainer is the only role;
    None if not exactly one."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "monarch._src.actor.bootstrap_main" in p.cmdline() and any(started_by in " ".join(a.cmdline()) for a in p.parents()[:2]):
                procs.append(pid)
        except psutil.Error:
            pass
    return procs[0] if len(procs) == 1 else None


class SlurmCluster:
    """Slurm on `NetnsHosts(hostnames=True)`: munged with a fresh key on its own socket,
    slurmctld on host a, one slurmd per host, all from a slurm.conf written for the run under
    `root`. Nothing is read from or written to /etc/slurm or /etc/munge: every client command
    finds this cluster through `SLURM_CONF` (`env`), and must run inside a host (`command`):
    the controller listens on host a's address only.

    No cgroups (they cannot be delegated here): processes are tracked by their parent
    (proctrack/linuxproc), tasks are not bound (task/none), nothing is accounted. Partition
    `debug` (the default) holds both nodes; `closed` holds them too but is down, so a job
    submitted there queues and never starts. `stop()` cancels every job and ends every
    daemon; the hosts' own `stop()` kills whatever is left inside them.
    """

    PARTITION = "debug"
    CLOSED_PARTITION = "closed"
    KILL_WAIT_S = 10
    """Slurm's KillWait: seconds between a cancelled job's SIGTERM and its SIGKILL."""

    def __init__(self, hosts: NetnsHosts, root):
        if not hosts.hostnames:
            raise ValueError("a Slurm cluster needs hosts with names: NetnsHosts(hostnames=True)")
        self.hosts = hosts
        self.root = os.path.abspath(str(root))
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
        self.nodes = [hosts.hostnames[h] for h in ("a", "b")]
        self.env = {"SLURM_CONF": self.conf, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"}
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- files --
    def _write_munge_key(self) -> str:
        d = os.path.join(self.root, "munge")
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o711)  # munged wants its socket's directory searchable by all
        key = os.path.join(d, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        return key

    def _write_conf(self) -> None:
        r, (a, b) = self.root, self.nodes
        addr = self.hosts.ADDRESSES
        lines = [
            "ClusterName=meshrltest",
            f"SlurmctldHost={a}({addr['a']})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/ctld",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # no cgroups: track a job's processes by parentage, bind nothing, account nothing
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/linear",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"KillWait={self.KILL_WAIT_S}",
            "MinJobAge=5",
            "InactiveLimit=0",
            "SlurmdTimeout=30",
            f"NodeName={a} NodeAddr={addr['a']} CPUs=2 RealMemory=1000 State=UNKNOWN",
            f"NodeName={b} NodeAddr={addr['b']} CPUs=2 RealMemory=1000 State=UNKNOWN",
            f"PartitionName={self.PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName={self.CLOSED_PARTITION} Nodes=ALL MaxTime=INFINITE State=DOWN",
        ]
        os.makedirs(os.path.join(r, "ctld"), exist_ok=True)
        for n in self.nodes:
            os.makedirs(os.path.join(r, f"spool-{n}"), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        # slurmd initializes a cgroup plugin even when nothing uses it, and finds no cgroup
        # filesystem under the /sys that `ip netns exec` mounts: name the plugin (v1 mounts
        # nothing until asked) rather than let it probe, and let it mount nothing.
        with open(os.path.join(r, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    # -- lifecycle --
    def start(self, timeout: float = 60) -> "SlurmCluster":
        os.makedirs(self.root, exist_ok=True)
        try:
            key = self._write_munge_key()
            self._write_conf()
            m = os.path.join(self.root, "munge")
            self.daemons["munged"] = self.hosts.run(
                "a",
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={self.munge_socket}",
                    f"--pid-file={m}/munged.pid",
                    f"--log-file={m}/munged.log",
                    f"--seed-file={m}/munged.seed",
                ],
                os.path.join(self.root, "munged.out"),
            )
            self._wait(lambda: os.path.exists(self.munge_socket), timeout, "munged to open its socket")
            self.daemons["slurmctld"] = self.hosts.run("a", ["slurmctld", "-D", "-i", "-f", self.conf], os.path.join(self.root, "slurmctld.out"), env=self.env)
            for h in ("a", "b"):
                self.start_slurmd(h)
            self._wait(self._nodes_idle, timeout, "both nodes to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def start_slurmd(self, host: str) -> None:
        node = self.hosts.hostnames[host]
        self.daemons[f"slurmd-{host}"] = self.hosts.run(
            host, ["slurmd", "-D", "-f", self.conf, "-N", node], os.path.join(self.root, f"slurmd-{node}.out"), env=self.env
        )

    def restart_node(self, host: str, timeout: float = 90) -> None:
        """Bring back a node whose processes were all killed: a fresh slurmd, until both nodes are idle."""
        self.start_slurmd(host)
        self._wait(self._nodes_idle, timeout, f"node {host} to come back")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) waiting for {what}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")
            time.sleep(0.3)

    def _nodes_idle(self) -> bool:
        out = self.cmd("sinfo", "-h", "-N", "-p", self.PARTITION, "-o", "%N %t", check=False).stdout.split()
        return sorted(out[0::2]) == sorted(self.nodes) and all(s == "idle" for s in out[1::2])

    def logs(self, tail: int = 2000) -> str:
        out = []
        for name in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []:
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.root, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-tail:]}")
        return "\n".join(out)

    def command(self, host: str, cmd: list[str]) -> list[str]:
        return self.hosts.command(host, cmd)

    def cmd(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command, run inside host a."""
        return subprocess.run(self.hosts.command("a", list(args)), capture_output=True, text=True, check=check, timeout=timeout, env={**os.environ, **self.env})

    def processes(self, host: str, exclude: tuple[str, ...] = ()) -> list[str]:
        """`PID COMMAND` of every process inside `host`, but those whose command starts with one of `exclude`."""
        found = []
        for pid in self.hosts.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv if a]
            if words and os.path.basename(words[0]) not in exclude and " ".join(words) not in exclude:
                found.append(f"{pid} {' '.join(words)[:200]}")
        return found

    def jobs(self) -> list[str]:
        """`JOBID STATE` of every job squeue still lists."""
        return self.cmd("squeue", "-h", "-o", "%i %T").stdout.split("\n")[:-1]

    def wait_no_jobs(self, timeout: float = 60) -> list[str]:
        deadline = time.monotonic() + timeout
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return jobs

    def stop(self) -> None:
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            try:
                self.cmd("scancel", "--full", "--user=root", check=False, timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in sorted(self.daemons, key=lambda n: n == "munged"):  # munged last: the others talk to it
            proc = self.daemons[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, PermissionError):
                    pass
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        self.daemons.clear()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster (`SlurmCluster`) on fresh named hosts, for one test module."""
    why = slurm_unavailable()
    if why:
        pytest.skip(f"Slurm cluster: {why}")
    hosts = NetnsHosts(hostnames=True).start()
    cluster = SlurmCluster(hosts, tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        hosts.stop()


# ---- a generator stand-in for rollout-worker tests -----------------------------------------------
class ScriptedGenerator:
    """Stands in for a generator replica: `generate.call_one(ids, budget, temperature,
    min_version)` returns an awaitable RequestResult. `reply(ids)` gives the sampled ids (or
    raises); each token gets log-prob -0.5 and version max(min_version, self.version)."""

    def __init__(self, reply, version: int = 0, delay: float = 0.0):
        self.reply, self.version, self.delay = reply, version, delay
        self.calls: list[tuple[list[int], int, int]] = []  # (context ids, budget, min_version)
        self.generate = types.SimpleNamespace(call_one=self._call_one)
        self.generate_many = types.SimpleNamespace(call_one=self._call_many)
        self.messages = 0  # generate_many calls: one carries the turns asked for together

    def _call_one(self, ids, budget, temperature, min_version):
        self.calls.append((list(ids), budget, min_version))

        async def run():
            from meshrl.generator.engine import RequestResult

            await asyncio.sleep(self.delay)
            out = list(self.reply(list(ids)))[:budget]
            v = max(min_version, self.version)
            return RequestResult(out, [-0.5] * len(out), [v] * len(out), "stop" if out and out[-1] == 2 else "length")

        return run()

    def _call_many(self, requests, call_id=None):
        """As GeneratorActor.generate_many: a failed sample comes back as its error text."""
        self.messages += 1

        async def run():
            results = await asyncio.gather(*(self._call_one(*r) for r in requests), return_exceptions=True)
            return [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else r for r in results]

        return run()


def replies_in_order(tok, texts: list[str]):
    """reply(ids) giving `texts` in turn, each ended by the end-of-turn token."""
    left = list(texts)
    return lambda ids: tok.encode(left.pop(0), add_special_tokens=False) + [tok.eos_token_id]


def is_loopback(ip: str) -> bool:
    """Whether a socket's address is loopback (an IPv4-mapped IPv6 one too)."""
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening_sockets(proc) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every socket of the psutil `proc` that accepts from
    anyone: TCP listeners, and bound UDP sockets that are not connected to one peer."""
    import socket

    import psutil

    found = []
    for c in proc.net_connections(kind="inet"):
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            found.append(("tcp", c.laddr.ip, c.laddr.port))
        elif c.type == socket.SOCK_DGRAM and c.laddr and not c.raddr:
            found.append(("udp", c.laddr.ip, c.laddr.port))
    return found


def watch_listeners(root, seen: dict) -> None:
    """One look at the listening sockets of `root`'s whole process tree (psutil), each new one
    recorded in `seen` as (protocol, address, port) -> "pid name cmdline"."""
    import psutil

    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            for sock in listening_sockets(p):
                seen.setdefault(sock, f"{p.pid} {p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            pass  # exited meanwhile
