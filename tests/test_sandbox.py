"""The sandbox for model-written code: real bubblewrap, real processes, and attacks on it.

Every attack runs through the `python` tool of a ToolEnv episode, as a policy would send
it: the episode must get an error observation (or nothing it should not have) and zero
reward, the host must be untouched, the next call must work, and no process may survive.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from meshrl.config import Config, ConfigError, SandboxConfig, validate
from meshrl.rollout.bwrap import ETC
from meshrl.rollout import sandbox as sb
from meshrl.rollout.coding import CodeEnv, PythonToolEnv, extract_code, repl_code, run_tests
from meshrl.rollout.env import ModelTurn


def _unavailable() -> str | None:
    try:
        sb.check_sandbox(SandboxConfig())
    except ConfigError as e:
        return str(e)
    return None


_WHY = _unavailable()
if _WHY:
    pytest.skip(f"sandbox tests: {_WHY}", allow_module_level=True)

LIMITS = SandboxConfig(
    pool_size=2, max_concurrent=4, wall_timeout_s=3.0, cpu_time_s=2, memory_mb=256, max_processes=16, max_file_mb=4, workspace_mb=16, max_output_bytes=32768
)
SECRET = "meshrl-fake-secret-7f3a91"


def _config() -> Config:
    return Config.from_dict({"data": {"source": "task:pyexpr"}, "rollout": {"tool_parser": "compact", "sandbox": LIMITS.__dict__}})


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop

    async def close_all():
        for key, p in list(sb._POOLS.items()):
            if key[0] == id(loop):
                await p.close()
                del sb._POOLS[key]

    loop.run_until_complete(close_all())
    loop.close()
    assert _live_children() == [], "sandbox processes outlived the tests"


@pytest.fixture(scope="module")
def pool(loop):
    async def make():
        p = sb.get_pool(LIMITS)
        await p.warm()
        return p

    return loop.run_until_complete(make())


def _live_children() -> list[str]:
    """Live (not zombie) processes whose parent is this test process and that run bwrap."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and "bwrap" in cmd:
            found.append(f"{pid} {cmd[:80]}")
    return found


def _processes_matching(marker: str) -> list[str]:
    """Live processes anywhere on the host whose command line contains `marker`."""
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if marker in line and not line.lstrip().startswith("Z") and "ps -eo" not in line]


class Episode:
    """One ToolEnv episode against the sandbox: a tool call with the attack, then an answer."""

    def __init__(self, loop):
        self.loop = loop
        self.env = PythonToolEnv(_config(), parser="compact", max_tool_calls=1)
        self.env.reset({"prompt": "q", "answer": "42"})

    def call(self, code: str) -> str:
        result = self.loop.run_until_complete(self.env.step(ModelTurn("!" + code, [], "stop", 0)))
        assert not result.done
        return result.observation[0]["content"]

    def answer(self, text: str = "7") -> float:
        result = self.loop.run_until_complete(self.env.step(ModelTurn(text, [], "stop", 1)))
        assert result.done
        return result.reward


def attack(loop, pool, code: str) -> tuple[str, sb.SandboxResult, float]:
    """(tool observation, the sandbox's result, the episode's reward); then checks that the
    run goes on (a plain call works) and that nothing the call started is alive."""
    ep = Episode(loop)
    calls = pool.calls
    content = ep.call(code)
    assert pool.calls == calls + 1  # get_pool gave the env this loop's pool for this config
    reward = ep.answer()
    assert reward == 0.0
    after = loop.run_until_complete(pool.run("print(6*7)"))
    assert after.ok and after.stdout == "42\n", after
    assert len(_live_children()) <= LIMITS.pool_size  # only the pool's waiting sandboxes
    return content, ep.env.last_result, reward


# ---- the runner --------------------------------------------------------------------------------
def test_a_call_returns_output_status_and_files(loop, pool):
    r = loop.run_until_complete(
        pool.run(
            "import sys, helper\nprint(helper.X, sys.stdin.read(), sys.argv[1:])\nsys.exit(3)",
            files={"helper.py": "X = 5", "data/a.txt": "x"},
            stdin="in",
            argv=["-v"],
        )
    )
    assert (r.stdout, r.exit_code, r.limit, r.ok) == ("5 in ['-v']\n", 3, None, False)
    r = loop.run_until_complete(pool.run("1/0"))
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and r.summary().startswith("error: exit status 1: ZeroDivisionError")
    r = loop.run_until_complete(pool.run("print('before it failed')\n1/0"))  # what a failing program printed is kept
    assert r.exit_code == 1 and r.stdout == "before it failed\n", r
    with pytest.raises(ValueError, match="relative path"):
        loop.run_until_complete(pool.run("pass", files={"../x": ""}))


def test_the_sandbox_sees_no_host_and_an_empty_environment(loop, pool):
    code = (
        "import os, socket, json\n"
        "print(json.dumps([sorted(os.environ), os.getcwd(), os.getuid(), [n for _, n in socket.if_nameindex()],\n"
        "                  sorted(os.listdir('/')), sorted(p for p in os.listdir('/proc') if p.isdigit()), os.listdir('/tmp'),\n"
        "                  sorted(os.listdir('/etc'))]))"
    )
    r = loop.run_until_complete(pool.run(code))
    assert r.ok, r
    env, cwd, uid, interfaces, root, pids, workspace, etc = json.loads(r.stdout)
    assert set(etc) <= set(ETC) | {n for n in etc if n.startswith("python3")}, etc  # not the host's configuration and credentials
    assert set(env) <= {"HOME", "LANG", "LC_CTYPE", "PATH", "PWD", "PYTHONUNBUFFERED"} and cwd == "/tmp" and workspace == []
    assert uid != 0 and interfaces == ["lo"] and pids == ["1", "2"]  # bwrap's init and the program
    assert not {"root", "home", "work", "run", "mnt", "opt"} & set(root), root


def test_calls_run_concurrently_each_in_a_fresh_sandbox(loop, pool):
    async def many():
        return await asyncio.gather(*(pool.run(f"import os\nopen('f', 'a').write('x')\nprint(len(open('f').read()), {i})") for i in range(6)))

    results = loop.run_until_complete(many())
    assert [r.stdout for r in results] == [f"1 {i}\n" for i in range(6)]  # no call sees another's files


def test_a_cancelled_call_leaves_nothing(loop, pool):
    async def cancel():
        task = asyncio.ensure_future(pool.run("import time\ntime.sleep(30)  # meshrl-cancel-marker"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(cancel())
    assert _processes_matching("meshrl-cancel-marker") == []


def test_sandboxes_that_stop_starting_fail_the_call_with_bwraps_reason_and_are_not_started_again_without_end(monkeypatch):
    """The pool filled once, then bwrap fails (a namespace limit reached): a call tries the
    waiting sandboxes and one start of its own, then fails with bwrap's message, where it had
    started sandboxes in a loop until the step's timeout and said only that."""
    starts = []

    async def failing(config):
        starts.append(1)
        raise sb.SandboxError("bwrap: Creating new namespace failed: No space left on device")

    monkeypatch.setattr(sb.Sandbox, "start", staticmethod(failing))
    pool = sb.SandboxPool(LIMITS)

    async def call():
        pool._refill()  # the pool's waiting sandboxes, each failing as it starts
        return await asyncio.wait_for(pool.run("print(1)"), 10)

    with pytest.raises(sb.SandboxError, match="No space left on device"):
        asyncio.run(call())
    assert len(starts) == LIMITS.pool_size + 1, len(starts)


def test_a_sandbox_the_machine_cannot_spawn_fails_its_episode_not_the_models_call(monkeypatch):
    """Out of processes (EAGAIN under a container's pid limit) or descriptors at bwrap's spawn:
    the OSError reached the model as its tool call's output, and the policy was trained on the
    machine's failure as its own code's. A SandboxError fails the episode."""

    async def no_processes(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(sb.asyncio, "create_subprocess_exec", no_processes)
    with pytest.raises(sb.SandboxError, match="did not start: BlockingIOError"):
        asyncio.run(sb.Sandbox.start(LIMITS))
    fresh = asyncio.new_event_loop()  # a pool of its own, no sandbox started before the patch
    try:
        with pytest.raises(sb.SandboxError, match="BlockingIOError"):
            Episode(fresh).call("print(1)")
    finally:
        fresh.close()


# ---- attacks -----------------------------------------------------------------------------------
def test_attack_connect_to_a_loopback_port_of_the_host(loop, pool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        content, result, _ = attack(loop, pool, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert content.startswith("error:") and "ConnectionRefusedError" in content
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
        content, _, _ = attack(loop, pool, "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
        assert content.startswith("error:") and "unreachable" in content
    finally:
        server.close()


def test_attack_read_a_planted_file_and_a_secret_in_the_environment(loop, pool, tmp_path, monkeypatch):
    planted = tmp_path / "planted-secret.txt"
    planted.write_text(SECRET)
    planted.chmod(0o644)
    monkeypatch.setenv("MESHRL_FAKE_SECRET", SECRET)
    content, _, _ = attack(loop, pool, f"print(open({str(planted)!r}).read())")
    assert content.startswith("error:") and "FileNotFoundError" in content and SECRET not in content
    content, _, _ = attack(loop, pool, f"print(open({os.path.abspath(__file__)!r}).read())")  # the checkout
    assert content.startswith("error:") and "FileNotFoundError" in content
    search = (
        "import os, glob\n"
        "seen = [os.environ.get('MESHRL_FAKE_SECRET')]\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try: seen.append(open(p, 'rb').read().decode(errors='replace'))\n"
        "    except OSError: pass\n"
        f"if any(s and {SECRET!r} in s for s in seen): print('LEAKED')\n"
        "raise SystemExit('no secret here')"
    )
    content, _, _ = attack(loop, pool, search)
    assert content == "error: exit status 1: no secret here"


def test_attack_write_outside_the_workspace(loop, pool, tmp_path):
    targets = [
        "/etc/meshrl-pwned",
        "/usr/meshrl-pwned",
        "/meshrl-pwned",
        "/dev/meshrl-pwned",
        "/proc/meshrl-pwned",
        str(tmp_path / "meshrl-pwned"),
        os.path.join(os.getcwd(), "meshrl-pwned"),
    ]
    code = (
        f"wrote = []\nfor t in {targets!r}:\n"
        "    try:\n        open(t, 'w').write('x'); wrote.append(t)\n"
        "    except OSError:\n        pass\n"
        "raise SystemExit(f'wrote {wrote}' if wrote else 'every write refused')"
    )
    content, _, _ = attack(loop, pool, code)
    assert content == "error: exit status 1: every write refused"
    assert not any(os.path.exists(t) for t in targets)


def test_attack_fork_bomb_is_capped_by_the_process_limit(loop, pool):
    # Can fail: without RLIMIT_NPROC in force (e.g. the sandbox running as root) all 200 forks succeed.
    count = (
        "import os, time\nn = 0\nfor _ in range(200):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
        "raise SystemExit(f'forked {n}')"
    )
    content, _, _ = attack(loop, pool, count)
    forked = int(re.search(r"forked (\d+)", content).group(1))
    assert 0 < forked < LIMITS.max_processes, content
    started = time.monotonic()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    content, result, _ = attack(loop, pool, bomb)
    assert content.startswith("error:") and result.limit in ("wall", "cpu", "processes")
    assert time.monotonic() - started < LIMITS.wall_timeout_s + 10


def test_attack_memory_bomb(loop, pool):
    content, result, _ = attack(loop, pool, "x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
    assert content.startswith("error: memory limit") and result.limit == "memory"
    content, result, _ = attack(loop, pool, "open('big', 'wb').write(b'x' * (64 << 20))")  # the workspace is RAM too
    assert content.startswith("error:") and result.limit == "file_size"


def test_attack_infinite_loop(loop, pool):
    content, result, _ = attack(loop, pool, "while True:\n    pass")
    assert content.startswith("error:") and result.limit in ("cpu", "wall")
    assert result.duration_s < LIMITS.wall_timeout_s + 2


def test_attack_100_mb_of_output(loop, pool):
    started = time.monotonic()
    content, result, _ = attack(loop, pool, "import sys\nsys.stdout.write('x' * (100 << 20))")
    assert content.startswith("error: output limit") and result.limit == "output" and result.truncated
    assert len(result.stdout) + len(result.stderr) <= LIMITS.max_output_bytes
    assert time.monotonic() - started < LIMITS.wall_timeout_s


def test_attack_kill_the_parent(loop, pool):
    code = (
        f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, {os.getppid()}, 1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
        "os.kill(-1, signal.SIGKILL)"
    )
    content, result, _ = attack(loop, pool, code)
    assert content.startswith("error:")  # the sandbox killed itself; this process and its parent live on


def test_attack_sleep_past_the_timeout(loop, pool):
    content, result, _ = attack(loop, pool, "import time\ntime.sleep(600)")
    assert content == "error: wall limit" and result.limit == "wall"
    assert LIMITS.wall_timeout_s <= result.duration_s < LIMITS.wall_timeout_s + 2


def test_attack_leave_a_background_process_behind(loop, pool):
    marker = f"{4242 + os.getpid() % 1000}.25"
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        f"    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
        "print('started')"
    )
    content, result, _ = attack(loop, pool, code)
    assert content == "started"  # it ran; and then none of it may outlive the call
    assert _processes_matching(f"sleep {marker}") == []


# ---- the tool, the coding task, config --------------------------------------------------------------
def test_hidden_tests_score_the_fraction_passed(loop, pool):
    asserts = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]
    assert loop.run_until_complete(run_tests(pool, "def f(x): return 2 * x", asserts)) == (2, 3)
    io = [{"input": "3", "output": "9"}, {"input": "4\n", "output": "16"}, {"input": "x", "output": "?"}]
    assert loop.run_until_complete(run_tests(pool, "print(int(input()) ** 2)", io)) == (2, 3)
    assert loop.run_until_complete(run_tests(pool, "import os; os._exit(0)", asserts + io)) == (0, 6)
    # an `exec` of the solution's own (or the builtins replaced) passed every assert; `from __future__` opens its code
    for hack in ("def exec(*a, **k): pass\ndef f(x): return 0", "import builtins\nbuiltins.exec = lambda *a: None\ndef f(x): return 0"):
        assert loop.run_until_complete(run_tests(pool, hack, asserts)) == (0, 3)
    assert loop.run_until_complete(run_tests(pool, "from __future__ import annotations\ndef f(x: int) -> int: return 2 * x", asserts)) == (2, 3)
    assert loop.run_until_complete(run_tests(pool, "def f(x):\n    return 2 * x  # \U0001f642", asserts)) == (2, 3)  # past U+FFFF
    # a solution's `if __name__ == "__main__":` block read the empty stdin and failed every assert;
    # it runs where the input/output tests run it as a program
    main = "def f(x): return 2 * x\nif __name__ == '__main__':\n    print(f(int(input())))"
    assert loop.run_until_complete(run_tests(pool, main, [*asserts, {"input": "5", "output": "10"}])) == (3, 4)
    # an expected output past the tool's output cap: cut at the cap, a right program scored 0
    lines = "\n".join(str(i) for i in range(8000))
    assert len(lines) > LIMITS.max_output_bytes
    big = [{"input": "8000", "output": lines}]
    assert loop.run_until_complete(run_tests(pool, "print(*range(int(input())), sep='\\n')", big)) == (1, 1)
    assert loop.run_until_complete(run_tests(pool, "while True: print('x' * 1000)", big)) == (0, 1)  # still bounded
    assert extract_code("try:\n```python\nprint(1)\n```\nok") == "print(1)\n"
    assert repl_code("2+3") != "2+3" and repl_code("x = 1") == "x = 1"


def test_code_env_episode(loop, pool):
    env = CodeEnv(_config(), parser="compact", max_tool_calls=1)
    env.reset({"prompt": "square", "tests": ["assert f(2) == 4", "assert f(3) == 9"]})
    tool = loop.run_until_complete(env.step(ModelTurn("!2**10", [], "stop", 0)))
    assert tool.observation[0]["content"] == "1024"
    done = loop.run_until_complete(env.step(ModelTurn("```python\ndef f(x):\n    return x * x\n```", [], "stop", 1)))
    assert done.done and done.reward == 1.0


def test_tiny_tasks_reward_through_the_sandbox(loop):
    from meshrl.tasks import TASKS

    config = _config()
    sample = {"prompt": [{"role": "user", "content": "3**4%7"}], "answer": "4"}
    env = TASKS["pyexpr"].env(config)
    env.reset(sample)
    assert loop.run_until_complete(env.step(ModelTurn("!", [], "stop", 0))).observation[0]["content"] == "4"
    assert loop.run_until_complete(env.step(ModelTurn("4", [], "stop", 1))).reward == 1.0
    rewards = {}
    for answer in ("x+2", "x*2", "2", "(("):
        env = TASKS["code"].env(config)
        env.reset({"prompt": "0:2 1:3", "tests": [f"assert f({x})=={x + 2}" for x in range(5)], "template": "f=lambda x:{answer}"})
        rewards[answer] = loop.run_until_complete(env.step(ModelTurn(answer, [], "stop", 0))).reward
    assert rewards == {"x+2": 1.0, "x*2": 0.2, "2": 0.2, "((": 0.0}


def test_config_limits_are_checked():
    with pytest.raises(ConfigError, match="rollout.sandbox.max_processes"):
        validate(Config.from_dict({"rollout": {"sandbox": {"max_processes": 1}}}))
    with pytest.raises(ConfigError, match="rollout.sandbox.uid"):
        validate(Config.from_dict({"rollout": {"sandbox": {"uid": 0}}}))
    with pytest.raises(ConfigError, match="rollout.sandbox.backend"):
        Config.from_dict({"rollout": {"sandbox": {"backend": "none"}}})


def test_a_run_evaluated_on_a_sandboxed_task_has_its_sandbox_checked():
    """eval.source of a task that runs model-written code (played with its own env) needs the
    sandbox as much as training on it does: preflight checks it, where only the training source
    was looked at and a broken bwrap showed as failed evaluations during the run."""
    from meshrl.tasks import needs_sandbox

    assert not needs_sandbox(Config.from_dict({"data": {"source": "task:digits"}}))
    assert needs_sandbox(Config.from_dict({"data": {"source": "task:digits"}, "eval": {"source": "task:pyexpr", "every": 5}}))
    assert needs_sandbox(Config.from_dict({"data": {"source": "task:pyexpr"}, "rollout": {"tool_parser": "compact"}}))


def test_a_missing_bwrap_stops_the_run_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = str(tmp_path)  # no bwrap on it
    done = subprocess.run(
        [sys.executable, "-m", "meshrl", "run", "data.source=task:pyexpr", "rollout.tool_parser=compact", f"logging.run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rollout.sandbox.backend" in lines[0] and "bubblewrap" in lines[0], done.stderr
