"""Run model-written code in a bubblewrap sandbox: isolated, bounded, nothing left behind.

    pool = SandboxPool(SandboxConfig())
    result = await pool.run("print(2**10)")            # SandboxResult(stdout="1024\\n", exit_code=0, ...)
    result = await pool.run("import x", files={"x.py": "print(1)"})
    await pool.close()

Each call runs in a fresh sandbox made by `bwrap` (bubblewrap): new user, pid, network,
mount, IPC, UTS and cgroup namespaces; the network namespace has only its own loopback,
so nothing of the host's network (not even its 127.0.0.1) is reachable. The file system
is a read-only root holding /usr and what the loader and Python read of /etc (read-only too, plus `ro_paths`), a fresh /proc of its own pid namespace, a
minimal read-only /dev, and one private tmpfs of `workspace_mb` at /tmp, which is the
working directory and HOME: the run directory, the user's home and /work do not exist in
there. The environment is cleared (PATH, HOME, LANG only), and the parent's environment
is unreadable (its /proc is not visible).

Limits, and what enforces each:
- wall time: the parent's clock from the moment the code is handed over; at the limit it
  SIGKILLs the sandbox's pid 1, and the kernel kills everything in its pid namespace.
- CPU time, memory (address space), file size, processes: setrlimit inside the sandbox,
  before any of the call's code runs (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC).
  RLIMIT_NPROC is counted per user namespace, so each sandbox has its own count; root is
  exempt from it, so when meshrl runs as root the sandbox runs as `config.uid` instead.
- workspace: the tmpfs's size; output: the parent reads at most `max_output_bytes` of
  stdout and stderr together and kills the sandbox when more comes.
Nothing survives a call: the sandbox's pid 1 (bwrap's init) exits when the program does,
which kills every process left in the namespace, and the call returns only once bwrap has
reaped it. `--die-with-parent` ends sandboxes whose parent dies.

A pool keeps `pool_size` sandboxes started (namespaces made, interpreter loaded, limits set,
waiting for code on stdin); each runs one call and is replaced, so no call sees another's
files or processes.

There is no unsandboxed fallback: `check_sandbox` (preflight) raises a ConfigError naming
the package to install when bubblewrap is missing or cannot make its namespaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

from meshrl.config import Config, ConfigError, SandboxConfig
from meshrl.rollout.bwrap import _spawn_kwargs, bwrap_argv, bwrap_path, interpreter  # noqa: F401 (interpreter: re-exported)

INSTALL_HINT = "install the Debian package bubblewrap (`apt-get install -y bubblewrap`)"
START_TIMEOUT_S = 20.0
"""Longest a sandbox may take to start (namespaces, interpreter) before the call fails."""
KILL_GRACE_S = 5.0
"""Longest to wait for bwrap to exit once its sandbox was killed."""

LIMITS = ("wall", "cpu", "memory", "processes", "file_size", "output")
"""What `SandboxResult.limit` can name: the limit that ended (or failed) the call."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status; 128 + N when signal N ended it; None when the sandbox was killed by the parent."""
    limit: str | None = None
    """Which limit ended or broke the call (one of LIMITS), or None. `wall` and `output` the
    parent enforced; `cpu` (SIGXCPU), `memory` (MemoryError / ENOMEM), `file_size` (EFBIG,
    SIGXFSZ), `processes` (fork failing with EAGAIN) are read off how the program failed."""
    duration_s: float = 0.0
    """Seconds from handing over the code to the sandbox's end."""
    truncated: bool = False
    """Output beyond `max_output_bytes` was dropped."""
    cold: bool = False
    """The call started its own sandbox (none was waiting in the pool)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    def summary(self, max_chars: int = 400) -> str:
        """One short text for a tool message: stdout when the program succeeded, else
        `error: ...` with the limit or exit status and the last line of stderr."""
        if self.ok:
            return _clip(self.stdout.rstrip("\n"), max_chars)
        why = f"{self.limit} limit" if self.limit else f"exit status {self.exit_code}"
        last = next((line for line in reversed(self.stderr.strip().splitlines()) if line.strip()), "")
        return _clip(f"error: {why}" + (f": {last.strip()}" if last else ""), max_chars)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(0, n - 3)] + "..."


class SandboxError(RuntimeError):
    """The sandbox itself failed (bwrap could not start, or did not start in time)."""


# ---- one sandbox ---------------------------------------------------------------------------------
_SIG = {128 + signal.SIGXCPU: "cpu", 128 + signal.SIGXFSZ: "file_size"}
_STDERR_LIMITS = (
    (re.compile(r"\bMemoryError\b|Cannot allocate memory|std::bad_alloc"), "memory"),
    (re.compile(r"File too large"), "file_size"),
    (re.compile(r"No space left on device"), "file_size"),
    (re.compile(r"BlockingIOError: \[Errno 11\]|Resource temporarily unavailable"), "processes"),
)


class Sandbox:
    """One started sandbox, waiting for its one call (`await Sandbox.start(config)`)."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.proc: asyncio.subprocess.Process | None = None
        self.init_pid: int | None = None  # the sandbox's pid 1 (bwrap's init), as the host sees it
        self._pidfd: int | None = None  # ... held from the start, so its pid cannot be recycled under us
        self._ready: asyncio.Future | None = None

    @classmethod
    async def start(cls, config: SandboxConfig) -> "Sandbox":
        box = cls(config)
        await box._spawn()
        return box

    async def _spawn(self) -> None:
        try:
            info_r, info_w = os.pipe()
        except OSError as e:  # out of file descriptors: this machine's failure, not the code's
            raise SandboxError(f"sandbox did not start: {type(e).__name__}: {e}") from e
        try:
            argv = bwrap_argv(self.config)
            argv[1:1] = ["--info-fd", str(info_w)]
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(info_w,),
                **_spawn_kwargs(self.config),
            )
        except BaseException as e:  # (cancelled too) no reader will close it
            os.close(info_r)
            if isinstance(e, OSError):  # no bwrap, or out of processes or descriptors: the machine's failure, not the code's
                raise SandboxError(f"sandbox did not start: {type(e).__name__}: {e}") from e
            raise
        finally:
            os.close(info_w)
        try:
            self.init_pid = await asyncio.wait_for(asyncio.to_thread(_read_child_pid, info_r), START_TIMEOUT_S)
            self._pidfd = os.pidfd_open(self.init_pid)
            ready = await asyncio.wait_for(self.proc.stdout.readexactly(1), START_TIMEOUT_S)
            if ready != b"R":
                raise SandboxError(f"sandbox did not start: unexpected {ready!r}")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as e:
            err = b""
            await self.kill()
            try:
                err = await asyncio.wait_for(self.proc.stderr.read(2000), 1.0)
            except (asyncio.TimeoutError, OSError):
                pass
            detail = err.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"sandbox did not start ({type(e).__name__}): {detail[-1] if detail else 'no output'}") from None
        except BaseException:
            await self.kill()
            raise

    def _signal(self) -> None:
        """SIGKILL the sandbox's pid 1 (the kernel then kills its whole pid namespace) and bwrap."""
        if self._pidfd is not None and not self._gone():
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    async def kill(self) -> None:
        """End the sandbox and everything in it. Returns once bwrap has exited and its pid 1
        is gone, which the kernel allows only after every other process of its pid namespace."""
        if self.proc is None:
            return
        self._signal()
        deadline = time.monotonic() + KILL_GRACE_S
        while (self.proc.returncode is None or (self._pidfd is not None and not self._gone())) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        self._close_pidfd()

    def _gone(self) -> bool:
        import select

        return bool(select.select([self._pidfd], [], [], 0)[0])

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def run(
        self,
        code: str,
        files: dict[str, str] | None = None,
        stdin: str | None = None,
        argv: list[str] | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
    ) -> SandboxResult:
        """Run `code` as __main__ in this sandbox (once). Bounded by the wall limit, its output by
        `max_output_bytes` (default the config's)."""
        assert self.proc is not None and self.proc.stdin is not None
        cfg = self.config
        _check_files(files)
        files = dict(files or {})
        if stdin is not None:
            files["stdin.txt"] = stdin
        request = json.dumps({"code": code, "files": files, "stdin": stdin, "argv": list(argv or [])}).encode()
        limit_s = min(timeout_s or cfg.wall_timeout_s, cfg.wall_timeout_s)
        started = time.monotonic()
        hit: list[str] = []
        chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        budget = [max_output_bytes or cfg.max_output_bytes]

        async def feed() -> None:
            try:
                self.proc.stdin.write(request)
                await self.proc.stdin.drain()
                self.proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the program ended (or was killed) before reading all of it

        def stop(why: str) -> None:
            if not hit:
                hit.append(why)
            self._signal()

        async def drain(stream: asyncio.StreamReader, key: str) -> None:
            # Read to EOF even past the cap (dropping it): asyncio's wait() returns only
            # once the pipes are closed, and a killed sandbox closes them at once.
            while True:
                data = await stream.read(65536)
                if not data:
                    return
                keep = data[: budget[0]]
                budget[0] -= len(keep)
                if keep:
                    chunks[key].append(keep)
                if len(keep) < len(data):
                    stop("output")

        work = asyncio.ensure_future(asyncio.gather(feed(), drain(self.proc.stdout, "out"), drain(self.proc.stderr, "err"), self.proc.wait()))
        try:
            try:
                await asyncio.wait_for(asyncio.shield(work), limit_s)
            except asyncio.TimeoutError:
                stop("wall")
                try:
                    await asyncio.wait_for(work, KILL_GRACE_S)
                except asyncio.TimeoutError:
                    pass  # wait_for cancelled it; kill() below still waits for the sandbox to be gone
        except BaseException:
            work.cancel()
            raise
        finally:
            await self.kill()  # also on cancellation; after a normal exit it waits for pid 1 to be gone
        duration = time.monotonic() - started
        stdout = b"".join(chunks["out"]).decode(errors="replace")
        stderr = b"".join(chunks["err"]).decode(errors="replace")
        code_ = self.proc.returncode
        exit_code = None if hit else (128 - code_ if code_ is not None and code_ < 0 else code_)
        limit = hit[0] if hit else _limit_from(exit_code, stderr)
        return SandboxResult(stdout, stderr, exit_code, limit, duration, truncated=bool(hit and hit[0] == "output"))


def _check_files(files: dict[str, str] | None) -> None:
    for path in files or {}:
        if os.path.isabs(path) or ".." in path.split("/") or not path.strip("/"):
            raise ValueError(f"sandbox file {path!r}: give a relative path inside the workspace")


def _limit_from(exit_code: int | None, stderr: str) -> str | None:
    if exit_code in _SIG:
        return _SIG[exit_code]
    if exit_code == 0:
        return None
    for pattern, name in _STDERR_LIMITS:
        if pattern.search(stderr[-4000:]):
            return name
    return None


def _read_child_pid(fd: int) -> int:
    """The `child-pid` of bwrap's --info-fd JSON: the sandbox's pid 1 in the host's pid
    namespace. Read to EOF: bwrap writes the JSON in pieces, and closing the pipe early would
    kill it with SIGPIPE."""
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    finally:
        os.close(fd)
    match = re.search(rb'"child-pid":\s*(\d+)', data)
    if match is None:
        raise OSError(f"bwrap wrote no child-pid to --info-fd: {data[:200]!r}")
    return int(match.group(1))


# ---- the pool -------------------------------------------------------------------------------------
class SandboxPool:
    """Runs calls in one-shot sandboxes, keeping `pool_size` of them started ahead of need.
    At most `max_concurrent` calls run at once. Use from one event loop."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        if bwrap_path() is None:
            raise SandboxError(f"bwrap not found: {INSTALL_HINT}")
        self._warm: list[asyncio.Task] = []
        self._sem: asyncio.Semaphore | None = None
        self._closed = False
        self.calls = 0
        self.cold_starts = 0
        self.pending = 0  # calls queued or running: what a new call waits behind

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.max_concurrent)
        return self._sem

    def _refill(self) -> None:
        while not self._closed and len(self._warm) < self.config.pool_size:
            self._warm.append(asyncio.ensure_future(Sandbox.start(self.config)))

    async def warm(self) -> None:
        """Start the pool's sandboxes and wait until they are ready."""
        self._refill()
        await asyncio.gather(*self._warm, return_exceptions=True)

    async def _take(self) -> tuple[Sandbox, bool]:
        """A started sandbox: a waiting one, else one started now, whose failure says why. The
        pool refills only after a take succeeds: sandboxes that fail to start (a namespace limit
        reached) are not started again without end."""
        while self._warm:
            task = self._warm.pop(0)
            try:
                box = await task
            except SandboxError:
                continue
            except BaseException:  # cancelled while it waited: a sandbox already up is killed
                if task.done() and not task.cancelled() and task.exception() is None:
                    await task.result().kill()
                raise
            self._refill()
            return box, False
        self.cold_starts += 1
        box = await Sandbox.start(self.config)
        self._refill()
        return box, True

    async def run(
        self,
        code: str,
        files: dict[str, str] | None = None,
        stdin: str | None = None,
        argv: list[str] | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
    ) -> SandboxResult:
        """Run `code` (Python source) as __main__ in a fresh sandbox, `files` (relative path ->
        text) written into its workspace first, `stdin` as its standard input. Every call is
        bounded: the start by START_TIMEOUT_S, the run by the wall limit (`timeout_s`, at most
        the config's), its stdout and stderr together by `max_output_bytes` (default the config's)."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        _check_files(files)
        self.pending += 1
        try:
            async with self._semaphore():
                self.calls += 1
                box, cold = await self._take()
                try:
                    result = await box.run(code, files=files, stdin=stdin, argv=argv, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
                finally:
                    await box.kill()  # a call that failed before running (a bad file name) ends its sandbox too
                result.cold = cold
                return result
        finally:
            self.pending -= 1

    async def close(self) -> None:
        """Kill the waiting sandboxes."""
        self._closed = True
        warm, self._warm = self._warm, []
        for task in warm:
            try:
                box = await task
            except BaseException:  # noqa: BLE001 - a sandbox that never started leaves nothing
                continue
            await box.kill()


_POOLS: dict[tuple[int, str], SandboxPool] = {}


def get_pool(config: SandboxConfig) -> SandboxPool:
    """The pool of this event loop for this sandbox config (rollout workers share one across episodes)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), json.dumps(config.__dict__, sort_keys=True, default=str))
    pool = _POOLS.get(key)
    if pool is None or pool._closed:
        pool = _POOLS[key] = SandboxPool(config)
    return pool


# ---- checks -------------------------------------------------------------------------------------
def check_sandbox(c: Config | SandboxConfig) -> None:
    """The isolation tool exists and can make a sandbox here; else ConfigError naming the fix."""
    cfg = c.rollout.sandbox if isinstance(c, Config) else c
    where = "rollout.sandbox.backend"
    if bwrap_path() is None:
        raise ConfigError(where, f"bwrap not found on PATH: {INSTALL_HINT}; model-written code never runs unsandboxed")
    python, _ = interpreter(cfg)
    if not os.access(python, os.X_OK):
        raise ConfigError("rollout.sandbox.python", f"{python!r} is not an executable interpreter: give the path of a python3")
    mounted = ["/usr", *interpreter(cfg)[1], *cfg.ro_paths]
    if not any(os.path.realpath(python).startswith(os.path.realpath(m) + "/") for m in mounted):
        raise ConfigError("rollout.sandbox.ro_paths", f"{python!r} is outside the sandbox's mounts: add its installation prefix to rollout.sandbox.ro_paths")
    for path in cfg.ro_paths:
        if not os.path.exists(path):
            raise ConfigError("rollout.sandbox.ro_paths", f"{path!r} does not exist")
    probe = bwrap_argv(cfg)
    try:
        done = subprocess.run(
            probe,
            input=json.dumps({"code": "print('ok')", "files": {}, "stdin": None, "argv": []}).encode(),
            capture_output=True,
            timeout=30,
            **_spawn_kwargs(cfg),
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(where, "bwrap did not finish a trivial program in 30 s") from None
    if done.stdout != b"Rok\n":
        err = done.stderr.decode(errors="replace").strip().splitlines()
        detail = err[-1] if err else f"exit status {done.returncode}"
        hint = (
            "user namespaces are off: enable them (sysctl user.max_user_namespaces=10000; on Debian/Ubuntu also "
            "kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0)"
            if "namespace" in detail.lower() or "permission" in detail.lower()
            else "see bwrap's message"
        )
        raise ConfigError(where, f"bwrap cannot make a sandbox here ({detail}): {hint}")
