"""Workarounds for Monarch, TorchTitan, vLLM and tensordict, each one small function with its reason.

Each can be dropped once upstream handles its case. Callers apply them explicitly; two are
applied by `meshrl/__init__.py` as meshrl is imported, before torch loads (so this module
imports no torch at the top): `DeferredDynamoMarks` and `monarch_prompt_supervision`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# ---- tensordict ----
class DeferredDynamoMarks(importlib.abc.MetaPathFinder):
    """Imports tensordict with its torch.compile marks held until torch._dynamo is imported.

    tensordict 0.15 marks a few functions as it is imported (`torch.compiler.allow_in_graph`,
    `assume_constant_result`), and each mark imports torch._dynamo, as long again as torch
    itself, in procs that never compile (the queue, the rollout workers, the controller).
    Both marks return their function unchanged; held here, each is applied as soon as
    torch._dynamo is imported (at once when it already is: tensordict keeps the recorders it
    imported by name). Where torch._dynamo loads first (a generator, after vLLM), none is held.
    """

    def __init__(self) -> None:
        self.held: list[tuple[str, object]] = []

    def find_spec(self, name, path=None, target=None):
        if name not in ("tensordict", "torch._dynamo") or (name == "tensordict" and "torch._dynamo" in sys.modules):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or type(spec.loader) not in (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader):
            return None  # a loader of a kind shared between modules (a zip): imported as without this
        run = spec.loader.exec_module  # this spec's own loader, made for it by PathFinder
        spec.loader.exec_module = lambda module: self._holding(run, module) if name == "tensordict" else (run(module), self._mark(module))
        return spec

    def _holding(self, run, module) -> None:
        import torch.compiler

        marks = {mark: getattr(torch.compiler, mark) for mark in ("allow_in_graph", "assume_constant_result")}
        for mark in marks:
            setattr(torch.compiler, mark, lambda fn, mark=mark: self.held.append((mark, fn)) or self._mark() or fn)
        try:
            run(module)
        finally:
            for mark, fn in marks.items():
                setattr(torch.compiler, mark, fn)
            self._mark()  # torch._dynamo imported meanwhile: what was held after it is marked now

    def _mark(self, loaded=None) -> None:  # `loaded`: torch._dynamo just run, still marked initializing by importlib
        dynamo = loaded or sys.modules.get("torch._dynamo")
        if dynamo is None or (loaded is None and getattr(dynamo.__spec__, "_initializing", False)):
            return
        held, self.held = self.held, []
        for mark, fn in held:
            try:
                getattr(dynamo, mark)(fn)
            except Exception as e:  # noqa: BLE001 - an unmarked function compiles slower, never wrongly; an import must not fail
                import logging

                logging.getLogger("meshrl").warning("torch.compile mark %s of %r not applied (%s: %s)", mark, fn, type(e).__name__, e)


# ---- CUDA ----
def cuda_present() -> bool:
    """Whether this process can use a GPU, asked without initialising CUDA in it.

    `torch.cuda.is_available()` goes through the CUDA runtime's device count unless
    PYTORCH_NVML_BASED_CUDA_CHECK is set, and a process that did that cannot use CUDA in a
    child it forks afterwards. vLLM on GPU forks its engine core, and `import vllm` sets the
    NVML check itself, too late for a generator proc that asked first: the engine core then
    fails with "Cannot re-initialize CUDA in forked subprocess".
    So every question meshrl asks before vLLM starts goes through NVML.
    """
    import torch

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.is_available()


# ---- Monarch ----
def monarch_unprefixed_logs() -> None:
    """Leave meshrl's log records as they were written.

    Once a process holds a Monarch context, Monarch's `_ActorFilter` sits on every logging
    handler and rewrites `record.msg` in place to "[actor=NAME] msg", once per handler the
    record passes: a warning that reaches both the console and a log file reads
    "[actor=<root>] [actor=<root>] ...", and pytest's capture sees it three times. meshrl's
    lines name their role themselves (one log file per role), so the prefix is turned off
    (`prefix_python_logs_with_actor`, a plain module setting)."""
    import monarch._src.actor.config as monarch_config

    monarch_config.prefix_python_logs_with_actor = False


def monarch_prompt_supervision(poll: str = "1s") -> None:
    """Have Monarch notice a dead proc within `poll`, not 10 s.

    Monarch's mesh controllers ask each actor mesh's procs for their state every
    HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY (10 s by default); a call to a proc killed
    meanwhile fails only then, so every heal and replacement started up to 10 s late. One
    state query per mesh per `poll` is little beside a run's own messages. A value set in the
    environment is kept; procs spawned from here inherit it. Monarch reads its config as it is
    imported: if it was, the read is done again."""
    if "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY" in os.environ:
        return
    os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"] = poll
    if "monarch" in sys.modules:
        from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

        reload_config_from_env()


def spawn_owned_by_caller(procs, name: str, actor_class, *args):
    """Spawn `actor_class` on `procs` from the calling process, which then owns its mesh.

    In Monarch 0.7 a mesh spawned inside a proc has its mesh controller there. A message from
    it that a caller cannot take is returned; if the proc died first, the return is
    undeliverable too, and the caller's mailbox ends its process ("client received
    undeliverable message: crashing"). Spawned from the controller, the mesh's controller
    lives in the process that outlives every proc it calls."""
    return procs.spawn(name, actor_class, *args)


def endpoint_for_callers_that_may_die(method):
    """A concurrent endpoint whose answer is dropped, with a warning, when its caller is gone.

    Monarch 0.7 hands an undeliverable reply back to the actor that sent it and fails that
    actor (`_handle_undeliverable_message` is never called for endpoint replies). A generator
    and the episode queue answer many rollout workers; one that dies or is stopped first
    would take the replica, or the whole queue, down with it. So the endpoint answers on an
    explicit port that does not return undeliverable messages. Callers see a plain endpoint:
    `actor.method.call_one(*args) -> result`, errors as ActorError.
    """
    import logging

    from monarch.actor import ActorError, concurrent_endpoint

    async def answer(self, port, *args, **kwargs) -> None:
        port.return_undeliverable = False
        try:
            try:
                result = await method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the caller's error, as a plain endpoint sends it
                port.exception(ActorError(e, f"Actor call {method.__qualname__} failed."))
                return
            port.send(result)
        except Exception as e:  # noqa: BLE001 - raising here would fail the actor
            logging.getLogger("meshrl").warning("%s: could not answer a call (%s: %s)", method.__qualname__, type(e).__name__, str(e)[:200])

    answer.__name__, answer.__qualname__, answer.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return concurrent_endpoint(explicit_response_port=True)(answer)


# ---- TorchTitan on CPU ----
def titan_use_sdpa_attention(model_config, sdpa_class) -> None:
    """Swap every layer's inner attention config for SDPA that also takes packed rows (in place).

    TorchTitan's models take only `flex` (no backward on CPU) or `varlen` (flash attention)
    for packed documents, and its SDPA refuses masks. A right-padded row is one causal sequence,
    where causal SDPA runs anywhere; packed rows carry `VarlenMetadata`, which `sdpa_class`
    (meshrl/trainer/attention.py) attends document by document.
    """
    for layer in list(model_config.layers) + list(getattr(model_config, "mtp_layers", None) or []):
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = sdpa_class.Config()


def titan_use_cpu_device_type() -> None:
    """Make TorchTitan's global `device_type` "cpu" when no accelerator is present.

    `torchtitan.tools.utils` falls back to "cuda" without an accelerator, and ParallelDims
    builds its DeviceMesh (the MoE dispatcher its buffers) on it; each import's copy is patched.
    """
    if cuda_present():
        return
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils, token_dispatcher):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def titan_force_sum_reduction(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce gradients with SUM (then divide): with a gradient divide factor it asks
    for ReduceOp.PREMUL_SUM, which gloo rejects."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def titan_float32_islands_under_cpu_autocast(model: torch.nn.Module) -> int:
    """Run attention and RMSNorm in float32 while the matmuls autocast to bf16 (in place).

    CPU autocast runs SDPA in bf16, whose CPU flash-attention backward is several times slower
    than float32's; a bf16 input with float32 RMSNorm weights misses the fused kernel ("Mismatch
    dtype between input and weight"). Matmuls, where bf16 pays (AMX), stay bf16. Returns how many.
    """
    import torch
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm

    wrapped = 0
    for module in model.modules():
        if isinstance(module, (ScaledDotProductAttention, RMSNorm)):
            inner = module.forward

            def forward(*tensors, _inner=inner, **kwargs):
                with torch.autocast("cpu", enabled=False):
                    return _inner(*(t.float() if torch.is_tensor(t) else t for t in tensors), **kwargs)

            module.forward = forward
            wrapped += 1
    return wrapped


# ---- vLLM on CPU ----
def vllm_cpu_defaults(startup_timeout_s: float | None = None) -> None:
    """Environment defaults for vLLM engines started from this process (call before importing vllm).

    VLLM_CPU_KVCACHE_SPACE: the CPU backend reserves this many GiB of KV cache per engine
    (its default is sized for a dedicated server); several engines share small machines,
    so default to 1 GiB unless the user set it. VLLM_ENGINE_READY_TIMEOUT_S: vLLM's own
    bound on the engine-core handshake, read once when vLLM is imported; set it from
    generator.startup_timeout_s so a stuck start-up fails instead of hanging.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if startup_timeout_s is not None:
        os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(int(max(1, startup_timeout_s))))


def vllm_async_llm(engine_args):
    """`AsyncLLM.from_engine_args(engine_args)`; a one-worker CPU engine's engine-core process
    is forked from this one instead of spawned (MESHRL_VLLM_FORK=0 in the environment: spawned).

    vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn while it builds the config, so
    that each worker sets up its OpenMP threads in a fresh process. A spawned engine core
    imports torch and vLLM again, single-threaded, before it loads a model: most of an engine's
    start on a small machine (benchmarks/README.md section 22), for the same decode speed. One
    worker only: its OpenMP threads start fresh in the forked process, as in a spawned one;
    tensor-parallel workers keep vLLM's choice. This heap is frozen while it forks (`gc.freeze`):
    the engine core's full collections (five as vLLM loads the model and freezes its own heap)
    then skip all it inherits. It inherits every descriptor of its Monarch proc too; the
    controller stops a replica's engine processes by pid (`Member.kill_leftovers`).
    """
    import gc

    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    config = engine_args.create_engine_config()
    kwargs = dict(enable_log_requests=engine_args.enable_log_requests, disable_log_stats=engine_args.disable_log_stats)
    if not current_platform.is_cpu() or engine_args.tensor_parallel_size != 1 or os.environ.get("MESHRL_VLLM_FORK", "1") == "0":
        return AsyncLLM.from_vllm_config(config, **kwargs)
    gc.freeze()
    try:
        with _environment_set("VLLM_WORKER_MULTIPROC_METHOD", "fork"):
            return AsyncLLM.from_vllm_config(config, **kwargs)
    finally:
        gc.unfreeze()  # this process's garbage stays collectable


def vllm_cpu_eager_token_ranks() -> None:
    """The sampler of the vLLM worker this runs in (a collective_rpc) counts token ranks eagerly.

    vLLM 0.32's sampler counts each sampled token's rank with a function under torch.compile,
    even in an eager engine: inductor compiles it at the engine's first request for log-probs,
    which every engine's first rollouts wait on, again in each replaced replica. Eager, the
    expression gives the same counts; it runs in blocks of rows, whose boolean and int64
    temporaries (the fusion compiling spares) stay small (a prefill chunk's prompt log-probs
    come through it too). meshrl never reads the ranks.
    """
    import torch
    import vllm.v1.sample.sampler as sampler

    def count(x: torch.Tensor, values: torch.Tensor, rows: int = 32) -> torch.Tensor:
        return torch.cat([(a >= b).sum(-1) for a, b in zip(x.split(rows), values.split(rows))])

    sampler.batched_count_greater_than = count


def vllm_engine_holds_sigterm(holder, hold: bool) -> bool:
    """Keep SIGTERM ignored in a vLLM engine process (`hold`), or give vLLM its own handler
    back (not `hold`, before the engine's shutdown, which stops its processes with SIGTERM).

    vLLM's engine core and workers install a SIGTERM handler that shuts the engine down, over
    the SIG_IGN slurm_worker gives them. Slurm's warning SIGTERM reaches every process of the
    job: engines died while the run finished its step, a weight update hung, and the interrupt
    checkpoint waited behind it. Runs as a worker RPC in the process's main thread, the only
    one that can set a handler (returns whether it is there). With tp > 1 the engine core is not held.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    if hold:
        holder._meshrl_vllm_sigterm = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif getattr(holder, "_meshrl_vllm_sigterm", None) is not None:
        signal.signal(signal.SIGTERM, holder._meshrl_vllm_sigterm)
        holder._meshrl_vllm_sigterm = None
    return True


def vllm_runs_lora_on(moe: bool) -> bool:
    """Whether the generators can run the policy's LoRA adapter (adapter-only weight sync).

    vLLM's CPU backend runs every MoE layer of a LoRA-enabled engine through its Triton MoE
    kernel, even with adapters on attention alone, which the CPU build lacks: there a MoE
    policy's LoRA is synced merged into its full weights, and the generators run no adapter.
    """
    return not moe or cuda_present()


def vllm_cpu_moe_prepack_after_reload(model: torch.nn.Module, loaded: set[str]) -> int:
    """Re-run the CPU MoE prepack on the expert layers an in-place reload just wrote.

    vLLM's CPU experts prepack their weights (`process_weights_after_loading`); `reload_weights`
    skips that for a second load (unquantized_fused_moe_method._setup_kernel), so checkpoint-layout
    values land in the packed storage and the experts compute garbage. Only the layers with weights
    in `loaded` (HF names) are repacked, the others must not be twice; returns how many.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or not hasattr(module, "w13_weight"):
            continue
        prefix = name[: name.index(".experts") + len(".experts")] if ".experts" in name else name
        if any(w.startswith(prefix + ".") for w in loaded):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def vllm_cpu_single_worker_executor(tensor_parallel_size: int):
    """The in-process worker executor for a one-worker CPU engine; None where vLLM's own
    choice stands (a GPU, or several CPU workers).

    vLLM's CPU platform replaces "uni" with the multiprocess executor, so each worker sets up its
    OpenMP threads in a fresh process; under `AsyncLLM` the engine core already is one, and the
    extra process costs every decode step a hand-off (a spin-waited shared-memory queue). In
    process the outputs are the same, its threads bound to every core; the class is named.
    """
    from vllm.platforms import current_platform

    if tensor_parallel_size != 1 or not current_platform.is_cpu():
        return None
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


# ---- torch.distributed: listen only where asked ----
def tcp_store_listening_on(host: str, timeout, port: int = 0):
    """A TCPStore server (`is_master=True`) that listens on `host`'s address only.

    torch 2.13's TCPStore server listens on every interface whatever host it is given
    (`ss -ltn` shows `*:PORT` for "127.0.0.1"), and it answers any client without
    credentials: a single-host run would be reachable from the network. The constructor
    also takes a socket that is already listening (`master_listen_fd`): we bind that one to
    `host` (a name: its first address) and `port` (0: a free one). A wildcard host is refused.
    """
    import ipaddress
    import socket

    from torch.distributed import TCPStore

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(addr[0].split("%")[0]).is_unspecified:
        raise ValueError(f"refusing to listen on the wildcard address {addr[0]!r} (host {host!r}): name this host's own address")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    # The store owns the socket from here (it closes it when the server stops).
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach())


@contextlib.contextmanager
def gloo_default_device_on_loopback():
    """Gloo groups created inside this block with gloo's default device, in this process or
    in processes started inside it (they inherit its environment), listen on loopback.

    Without an explicit device, a gloo group listens on the address this host's name
    resolves to (or on GLOO_SOCKET_IFNAME's interface): a routable address on many hosts.
    Code that creates its groups through `init_process_group` or `new_group` (vLLM's engine,
    TorchTitan) cannot pass a device; the environment variable, read as each group is
    created, is the one way in. Use it only where every member of those groups is on this
    host. The previous value is restored on exit.
    """
    import socket

    import psutil

    loopback = [name for name, addrs in psutil.net_if_addrs().items() if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)]
    with _environment_set("GLOO_SOCKET_IFNAME", loopback[0] if loopback else "lo"):
        yield


@contextlib.contextmanager
def nccl_errors_raise():
    """NCCL groups created inside this block raise their errors (a timed-out or failed
    collective) in the caller and abort their communicators, instead of torch's default
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), which tears the process down: a dead generator must
    cost the weight sync a reconnect, not the trainer its process. Read at each group's creation."""
    with _environment_set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):  # CleanUpOnly: abort, raise, keep the process
        yield


@contextlib.contextmanager
def _environment_set(name: str, value: str):
    """`name`=`value` in this process's environment inside the block, as before it after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


async def openenv_unread_message(client, timeout_s: float = 1.0) -> str | None:
    """The message still waiting, unread, on an OpenEnv client's WebSocket (None if none).

    openenv-core 0.3.0: a server at its `max_concurrent_envs` sends CAPACITY_REACHED and
    closes the socket at once, so the client's reset fails with ConnectionClosed and the
    refusal is left unread; the client has no public way to read it: this reads `_ws`.
    """

    ws = getattr(client, "_ws", None)
    if ws is None:
        return None
    try:
        return str(await asyncio.wait_for(ws.recv(), timeout_s))
    except Exception:  # noqa: BLE001 - nothing readable
        return None


# ---- Monarch on Slurm 22.05 ----
def squeue_json_job(squeue_json: str, job_id: str) -> dict | None:
    """Job `job_id` from the output of `squeue --job JOB_ID --json`, in the shape Monarch's
    `SlurmJob` reads; None when squeue does not list it.

    SlurmJob takes the first job of that output, reads its `job_state` as a list and its
    hosts from `job_resources.nodes.allocation[].name` (Slurm 24.05 and later). Slurm 22.05
    (Debian 12's) ignores `--job` in JSON and lists every job it holds, finished ones too,
    so SlurmJob took another job for its own and cancelled its own; it writes `job_state`
    as a string and the hosts as `job_resources.allocated_nodes[].nodename` (a list, or a
    dict by index), where SlurmJob fails. So the job is picked by id and rewritten into the
    newer shape (newer output passes unchanged). `meshrl.launch.slurm`'s SlurmJob reads this.
    """
    jobs = [j for j in json.loads(squeue_json).get("jobs", []) if str(j.get("job_id")) == str(job_id)]
    return slurm_job_info_newer_shape(jobs[0]) if jobs else None


def slurm_job_info_newer_shape(job: dict | None) -> dict | None:
    """One job of `squeue --json` with `job_state` a list and the allocated hosts under
    `job_resources.nodes.allocation[].name` (see `squeue_json_job`)."""
    if not job:
        return job
    job = dict(job)
    if isinstance(job.get("job_state"), str):
        job["job_state"] = [job["job_state"]]
    resources = dict(job.get("job_resources") or {})
    if not isinstance(resources.get("nodes"), dict):
        nodes = resources.get("allocated_nodes") or []
        nodes = list(nodes.values()) if isinstance(nodes, dict) else nodes
        resources["nodes"] = {"allocation": [{"name": n["nodename"]} for n in nodes if "nodename" in n]}
        job["job_resources"] = resources
    return job
