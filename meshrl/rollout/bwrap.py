"""The bubblewrap command line of one sandbox: what it isolates, what it mounts, its limits.

meshrl/rollout/sandbox.py runs sandboxes made from it (the module docstring there says what
each namespace, mount and limit is for); this file is only the command and the boot script
the sandbox's interpreter runs first.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from typing import Any

from meshrl.config import SandboxConfig

# Runs as `python3 -I -c BOOT LIMITS` inside the sandbox: limits first, then a ready byte on
# stdout, then the request (JSON on stdin) and the call's code as __main__.
BOOT = r"""
import os, sys, resource, json
for name, soft, hard in json.loads(sys.argv[1]):
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.write(1, b"R")
def _request():
    req = json.loads(sys.stdin.buffer.read())
    for path, data in req["files"].items():
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(data)
    fd = os.open("stdin.txt" if req["stdin"] is not None else "/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = open(0, "r", closefd=False)
    sys.argv = ["main.py", *req["argv"]]
    sys.path.insert(0, os.getcwd())  # as `python main.py` in the workspace: its files import
    return compile(req["code"], "main.py", "exec")
def _main(code):
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"})
    except SystemExit:
        raise
    except BaseException as e:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)
try:
    _code = _request()
except SyntaxError as e:
    import traceback
    traceback.print_exception(type(e), e, None)
    os._exit(1)
_main(_code)
"""


# ---- the command line ---------------------------------------------------------------------------
def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def interpreter(config: SandboxConfig) -> tuple[str, list[str]]:
    """(python path inside the sandbox, host paths to mount read-only for it)."""
    if config.python != "auto":
        return config.python, []
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3", []
    prefix = os.path.realpath(sys.base_prefix)
    return os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"), [prefix]


ETC = (
    "alternatives", "ca-certificates", "ca-certificates.conf", "group", "host.conf", "hosts", "ld.so.cache", "ld.so.conf",
    "ld.so.conf.d", "locale.alias", "localtime", "mime.types", "nsswitch.conf", "os-release", "passwd", "pki", "protocols",
    "services", "ssl", "timezone",
)  # fmt: skip
"""What of the host's /etc a sandbox sees (read-only): what the loader, Python and its standard
library read. Not the rest: /etc holds the host's configuration and credentials (pip.conf's
index tokens, gitconfig, an ssh or munge key readable by the sandbox's user)."""


def etc_paths() -> list[str]:
    """ETC's entries that exist on this host, and Debian's /etc/python3.X (its sitecustomize)."""
    paths = [os.path.join("/etc", name) for name in ETC] + sorted(glob.glob("/etc/python3*"))
    return [p for p in paths if os.path.exists(p)]


def _as_root() -> bool:
    return os.geteuid() == 0


def bwrap_argv(config: SandboxConfig) -> list[str]:
    """The bwrap command line of one sandbox, up to and including the interpreter's arguments."""
    python, extra = interpreter(config)
    argv = [bwrap_path() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for path in etc_paths():
        argv += ["--ro-bind", path, path]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in [*extra, *config.ro_paths]:
        argv += ["--ro-bind", path, path]
    # fmt: off
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(config.workspace_mb << 20), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
             "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONUNBUFFERED", "1"]
    # fmt: on
    limits = [
        ("RLIMIT_CPU", config.cpu_time_s, config.cpu_time_s + 1),
        ("RLIMIT_AS", config.memory_mb << 20, config.memory_mb << 20),
        ("RLIMIT_FSIZE", config.max_file_mb << 20, config.max_file_mb << 20),
        ("RLIMIT_NPROC", config.max_processes, config.max_processes),
        ("RLIMIT_NOFILE", 256, 256),
        ("RLIMIT_CORE", 0, 0),
    ]
    # -u: -I ignores PYTHONUNBUFFERED, and what a failing program printed would be lost
    return argv + ["--", python, "-I", "-u", "-c", BOOT, json.dumps(limits)]


def _spawn_kwargs(config: SandboxConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"env": {}, "close_fds": True, "start_new_session": True}
    if _as_root():
        kwargs.update(user=config.uid, group=config.uid, extra_groups=[])
    return kwargs
