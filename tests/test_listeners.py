"""A single-host run opens no socket that another host could reach.

Starts a short real run (`meshrl.run` in a subprocess of its own), lists the listening
sockets of its whole process tree while it trains (the controller with the weight-sync
store, the trainer, generator and coordinator procs, vLLM's engine process) and fails
naming every one bound to anything but loopback: a wildcard (0.0.0.0, ::) or a routable
address.
"""

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN_TIMEOUT_S = 240.0
POLL_S = 0.3
RUN = "import json, sys, meshrl; meshrl.run(json.loads(sys.argv[1]))"


def small_run(run_dir) -> dict:
    return {
        "steps": 3,
        "batch_groups": 2,
        "generator": {"group_size": 4, "max_new_tokens": 8, "max_num_seqs": 8},
        "trainer": {"micro_batch_size": 8, "checkpoint_every": 0},
        # the transport that listens most: a store in the controller and a gloo group (a
        # one-host run's default, shm, opens no socket for weights)
        "weight_sync": {"transport": "collective"},
        "logging": {"run_dir": str(run_dir), "progress": False, "plot": False, "tensorboard": False},
    }


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening(proc: psutil.Process) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every socket of `proc` that accepts from anyone: TCP
    listeners, and bound UDP sockets that are not connected to one peer."""
    found = []
    for c in proc.net_connections(kind="inet"):
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            found.append(("tcp", c.laddr.ip, c.laddr.port))
        elif c.type == socket.SOCK_DGRAM and c.laddr and not c.raddr:
            found.append(("udp", c.laddr.ip, c.laddr.port))
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:80]}"
    except psutil.Error:
        return str(proc.pid)


def stop_tree(procs: dict[int, psutil.Process], session: int) -> None:
    """Kill every process seen in the run's tree or still in its session, and reap them."""
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session:
                procs.setdefault(p.pid, p)
        except (OSError, psutil.Error):
            pass
    for p in procs.values():
        try:
            p.kill()  # psutil checks the pid was not reused since it was seen
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=30)


def test_single_host_run_listens_on_loopback_only(tmp_path):
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen(
            [sys.executable, "-c", RUN, json.dumps(small_run(tmp_path / "run"))], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    root = psutil.Process(run.pid)
    procs = {run.pid: root}
    seen: dict[tuple[str, str, int], str] = {}  # (protocol, address, port) -> owning process
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while run.poll() is None and time.monotonic() < deadline:
            try:
                procs.update((p.pid, p) for p in root.children(recursive=True))
            except psutil.Error:
                pass
            for p in list(procs.values()):
                try:
                    for sock in listening(p):
                        seen.setdefault(sock, describe(p))
                except psutil.Error:
                    pass  # exited meanwhile
            time.sleep(POLL_S)
        timed_out = run.poll() is None
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            try:
                run.wait(20)
            except subprocess.TimeoutExpired:
                pass
        stop_tree(procs, run.pid)
        run.wait()
    tail = log_path.read_text(errors="replace")[-3000:]
    assert not timed_out, f"the run took over {RUN_TIMEOUT_S:.0f}s:\n{tail}"
    assert run.returncode == 0, f"the run failed ({run.returncode}):\n{tail}"
    # The controller hosts the weight-sync store for the whole run: if the watch did not
    # see it, it saw nothing.
    assert any(owner.startswith(f"{run.pid} ") for owner in seen.values()), f"no listener of the controller was seen: {seen}"
    exposed = [f"{proto} {ip}:{port} (pid {owner})" for (proto, ip, port), owner in sorted(seen.items()) if not is_loopback(ip)]
    assert not exposed, "sockets reachable from other hosts:\n" + "\n".join(exposed)
