"""CPU placement: parsing, per-proc selection, and pinning every thread of a process."""

import os
import subprocess
import sys
import textwrap

import pytest

from meshrl.config import Config
from meshrl.placement import cpus_for, parse_cpu_lists, vllm_threads_bind


def test_parse_and_select():
    assert parse_cpu_lists("") == []
    assert parse_cpu_lists("0-2,5|7, 6") == [[0, 1, 2, 5], [6, 7]]
    assert cpus_for("", 3) is None
    assert cpus_for("0|1", 3) == [1]  # proc i takes list i modulo the count
    assert vllm_threads_bind([4, 5, 6, 7], 2) == "4,5|6,7"
    with pytest.raises(ValueError):
        parse_cpu_lists("a")
    with pytest.raises(ValueError):
        vllm_threads_bind([1], 2)


def test_yaml_number_is_a_cpu_list():
    assert Config.from_dict({"trainer": {"cpus": 0}}).trainer.cpus == "0"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_moves_every_thread_and_sizes_torch():
    # A fresh process with threads already running (like a Monarch proc): all end up pinned.
    code = textwrap.dedent("""
        import os, threading, time, torch
        from meshrl.placement import pin_this_process
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()
        pin_this_process([1])
        masks = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        child = threading.Thread(target=lambda: masks.setdefault("child", os.sched_getaffinity(0))); child.start(); child.join()
        stop.set(); t.join()
        assert all(m == {1} for m in masks.values()), masks
        assert torch.get_num_threads() == 1
        print("ok", len(masks))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr
