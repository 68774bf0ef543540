"""CPU placement: parsing, per-proc selection, and pinning every thread of a process."""

import os
import subprocess
import sys
import textwrap

import pytest

from meshrl.config import Config
from meshrl.config.cpus import cpus_for, parse_cpu_lists
from meshrl.pinning import resolve_cpus, vllm_threads_bind


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


def auto(cores, **sections):
    config = Config.from_dict({"trainer": {"device": "cpu"}, **sections})
    return resolve_cpus(config, cores)


def test_auto_splits_the_cores_between_the_roles():
    assert auto([0, 1]) == ("0", "1")  # the 2-core default: one core each
    assert auto(list(range(8))) == ("0,1,2,3", "4,5,6,7")
    assert auto(list(range(8)), generator={"replicas": 2}) == ("0,1,2,3", "4,5|6,7")
    assert auto(list(range(8)), trainer={"device": "cpu", "procs": 2, "dp_shard": 2}) == ("0,1|2,3", "4,5,6,7")
    assert auto(list(range(4)), model={"n_heads": 3, "dim": 96}, generator={"replicas": 1, "tp": 3}) == ("0", "1,2,3")  # tp workers need a core each
    # sync mode too: each role runs alone on its half (see meshrl/pinning.py)
    assert auto([0, 1], buffer={"depth": 0, "max_lag": 0}, generator={"update_mode": "block"}) == ("0", "1")


def test_auto_yields_to_explicit_settings_gpus_and_small_hosts():
    assert auto([0, 1, 2, 3], trainer={"device": "cpu", "cpus": "0"}) == ("0", "1,2,3")  # the generators take what is left
    assert auto([0, 1, 2, 3], generator={"cpus": "1"}) == ("0,2,3", "1")
    assert auto([0, 1, 2, 3], trainer={"device": "cpu", "cpus": ""}, generator={"cpus": ""}) == ("", "")
    assert auto([0]) == ("", "")  # one core: nothing to split
    assert auto([0, 1], generator={"tp": 2}) == ("", "")  # no core left for the trainer
    assert auto([0, 1], launcher={"kind": "slurm"}) == ("", "")  # hosts this process cannot see
    assert resolve_cpus(Config.from_dict({"trainer": {"device": "cuda"}}), [0, 1]) == ("", "")


def test_the_process_launchers_trainer_ranks_pin_to_lists_of_their_own():
    """The process launcher's stand-in hosts are all this machine: `auto` splits its cores one
    list a trainer rank, and each rank took its host's local-rank list, so with one rank a
    stand-in both took the first (cores 2 and 3 idle). By rank there; by local rank on real hosts."""
    from meshrl.config.cpus import trainer_cpus

    spec, _ = auto(list(range(8)), trainer={"device": "cpu", "procs": 2}, launcher={"kind": "process", "hosts": 4})
    assert spec == "0,1|2,3"
    assert [trainer_cpus(spec, "process", rank, 0) for rank in (0, 1)] == [[0, 1], [2, 3]]
    assert [trainer_cpus("0-3|4-7", "slurm", rank, rank % 2) for rank in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2  # each host's own


def test_yaml_number_is_a_cpu_list():
    assert Config.from_dict({"trainer": {"cpus": 0}}).trainer.cpus == "0"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_moves_every_thread_and_sizes_torch():
    # A fresh process with threads already running (like a Monarch proc): all end up pinned.
    code = textwrap.dedent("""
        import os, threading, time, torch
        from meshrl.pinning import pin_this_process
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


def test_auto_on_cpu_colocates_a_trainer_bound_run_and_splits_the_default():
    """placement=auto with no GPU: the default tiny model overlaps its roles on their own
    cores; a 25M-parameter model with short answers (trainer-bound) takes turns on all of them."""
    from meshrl.launch.devices import COLOCATE_ABOVE_GFLOP, resolve_placement, trainer_gflop_per_step

    default = Config.from_dict({})
    assert trainer_gflop_per_step(default) < COLOCATE_ABOVE_GFLOP / 4 and resolve_placement(default, 0)[0] == "split"
    big = {"model": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1536}}
    heavy = Config.from_dict(big)
    assert trainer_gflop_per_step(heavy) > 4 * COLOCATE_ABOVE_GFLOP
    placement, why = resolve_placement(heavy, 0)
    assert placement == "colocate" and "GFLOP" in why
    # never where colocation cannot be, or where the user placed the roles
    for other in (
        {"trainer": {"cpus": "0"}, "generator": {"cpus": "1"}},
        {"weight_sync": {"transport": "collective"}},
        {"launcher": {"kind": "workers", "workers": ["127.0.0.1:1", "127.0.0.1:2"], "address": "127.0.0.1"}},
    ):
        cfg = Config.from_dict({**big, **other})
        assert resolve_placement(cfg, 0)[0] == "split", other
    assert resolve_placement(Config.from_dict({**big, "placement": "split"}), 0)[0] == "split"
