"""The device plan: every proc of every role gets GPUs of its own, before CUDA initialises.

The plan is pure and is tested on fake GPU counts (`launcher.gpus_per_host`); the real
procs a run spawns are then checked to start with exactly the devices the plan gave them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import pytest
import yaml

from meshrl.config import Config, ConfigError
from meshrl.launch.devices import DEVICE_ENV, NCCL_IFNAME_ENV, PLAN_ENV, plan_devices, resolve_transport, weights_on_gpu
from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(**sections) -> Config:
    return Config.from_dict(sections)


def assert_disjoint(plan) -> None:
    """No GPU of any host is held by two procs."""
    seen: dict[tuple[str, int, int], str] = {}
    for s in plan.slots:
        for gpu in s.gpus:
            key = (s.mesh, s.host, gpu)
            assert key not in seen, f"{s.role} {s.index} and {seen[key]} share GPU {gpu} of {s.mesh}[{s.host}]"
            seen[key] = f"{s.role} {s.index}"
            assert 0 <= gpu < plan.gpus_per_host


def test_one_node_of_eight_gpus(monkeypatch):
    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    plan = plan_devices(config(trainer={"procs": 4}, generator={"replicas": 2, "tp": 2}, launcher={"gpus_per_host": 8}))
    assert plan.layout == "disaggregated" and plan.hosts == {"hosts": 1}
    assert [s.gpus for s in plan.slots if s.role == "trainer"] == [(0,), (1,), (2,), (3,)]
    assert [s.gpus for s in plan.slots if s.role == "generator"] == [(4, 5), (6, 7)]
    assert_disjoint(plan)
    assert plan.idle() == {}
    # NCCL's bootstrap on loopback: every proc of a one-machine run is on this host
    assert plan.env("generator", 1) == {DEVICE_ENV: "6,7", PLAN_ENV: "generator 1", NCCL_IFNAME_ENV: "lo"}
    assert plan.env("coord") == {DEVICE_ENV: ""}  # the queue and the workers hold no GPU
    assert "generator  1      hosts[0]  6,7" in plan.table()


def test_the_shipped_gpu_config_fits_two_nodes_of_eight():
    with open(os.path.join(ROOT, "configs/qwen3-0.6b-gpu.yaml")) as f:
        plan = plan_devices(Config.from_dict(yaml.safe_load(f)))
    assert plan.hosts == {"trainer": 1, "generator": 1}
    assert sorted(s.gpus for s in plan.slots if s.role == "generator") == [(i,) for i in range(8)]  # not all on GPU 0
    assert {s.mesh for s in plan.slots if s.role == "generator"} == {"generator"}
    assert_disjoint(plan)


def test_split_hosts_round_robin_tp_and_teacher(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    plan = plan_devices(
        config(
            trainer={"procs": 16},
            generator={"replicas": 6, "tp": 2},
            distill={"teacher": str(teacher)},
            launcher={"kind": "slurm", "hosts": 4, "gpus_per_host": 8},
        )
    )
    assert plan.hosts == {"trainer": 2, "generator": 2}
    assert [(s.mesh, s.host) for s in plan.slots if s.role == "trainer"] == [("trainer", r // 8) for r in range(16)]
    gens = [s for s in plan.slots if s.role == "generator"]
    assert [s.host for s in gens] == [0, 1, 0, 1, 0, 1]  # as Allocation.host hands them out
    assert [s.gpus for s in gens if s.host == 0] == [(0, 1), (2, 3), (4, 5)]
    assert plan.slot("teacher", 0).gpus == (6, 7) and plan.slot("teacher", 0).host == 0
    assert_disjoint(plan)
    assert plan.idle() == {("generator", 1): [6, 7]}


def test_a_cpu_trainer_leaves_every_gpu_to_the_generators():
    plan = plan_devices(config(trainer={"device": "cpu"}, launcher={"gpus_per_host": 1}))
    assert plan.slot("trainer", 0).gpus == () and plan.slot("generator", 0).gpus == (0,)
    assert plan_devices(config()).layout == "cpu" and plan_devices(config()).env("generator", 0) == {}


def test_expert_parallelism_is_checked_against_the_checkpoints_experts(tmp_path):
    """trainer.ep with model.path: held to the checkpoint's family and experts, where the
    config's own (from-scratch) fields refused a MoE checkpoint as 'not a MoE model.family'
    and then by its default 4 experts."""
    import json

    from meshrl.config import ModelConfig
    from meshrl.trainer.checks import check_model
    from meshrl.trainer.model import hf_config_dict

    def checkpoint(name: str, cfg: ModelConfig) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        return str(tmp_path / name)

    moe = checkpoint("moe", ModelConfig(family="qwen3_moe", num_experts=6, experts_top_k=2))
    dense = checkpoint("dense", ModelConfig(family="qwen3"))

    def refusal(path: str, ep: int) -> ConfigError:
        c = Config.from_dict({"model": {"path": path}, "trainer": {"procs": ep, "ep": ep}})  # the config's checks let it through
        with pytest.raises(ConfigError) as info:
            check_model(c, plan_devices(c))
        return info.value

    assert refusal(moe, 2).field_path == "model.path"  # past ep: its weight files are what is missing here
    assert refusal(moe, 3).field_path == "model.path"
    wrong = refusal(moe, 4)
    assert wrong.field_path == "trainer.ep" and "its 6 experts do not split over 4" in str(wrong)
    assert "it is qwen3, not a MoE" in str(refusal(dense, 2))


def test_lora_targets_are_checked_against_the_checkpoints_family(tmp_path):
    """model.family stays qwen3 when model.path names the checkpoint: LoRA on a deepseek_v3
    checkpoint passed (its MLA projections took no adapter, and `peft` loaded the export wrong),
    and MLP-only targets on a qwen3_moe one built no adapter at all (the optimizer had none)."""
    import json

    from meshrl.config import ModelConfig
    from meshrl.trainer.checks import check_model
    from meshrl.trainer.model import hf_config_dict

    def checkpoint(name: str, cfg: ModelConfig) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        (tmp_path / name / "model.safetensors").write_bytes(b"")  # (only its name is read here)
        return str(tmp_path / name)

    def refusal(path: str, targets: list[str] | None = None) -> str:
        c = config(model={"path": path}, lora={"rank": 4, **({"targets": targets} if targets else {})})
        with pytest.raises(ConfigError) as info:
            check_model(c, plan_devices(c))
        assert info.value.field_path == "lora.targets"
        return str(info.value)

    dsv3 = checkpoint("dsv3", ModelConfig(family="deepseek_v3", num_experts=4, experts_top_k=2))
    assert "deepseek_v3's MLA projections" in refusal(dsv3)
    moe = checkpoint("moe", ModelConfig(family="qwen3_moe", num_experts=4, experts_top_k=2))
    assert "adapt no layer of a qwen3_moe model" in refusal(moe, ["gate_proj", "up_proj"])
    for fine in (config(model={"path": moe}, lora={"rank": 4}), config(model={"path": moe}, lora={"rank": 4, "targets": ["o_proj", "down_proj"]})):
        check_model(fine, plan_devices(fine))


def test_lora_on_a_moe_policy_with_a_cpu_trainer_and_gpu_generators_is_refused():
    """Each side decides by its own GPUs whether the adapter or the merged weights travel: a CPU
    trainer would send merged weights to GPU engines expecting the adapter, failing every update."""
    from meshrl.trainer.checks import check_model

    moe = {"model": {"family": "qwen3_moe", "num_experts": 4, "experts_top_k": 2}, "lora": {"rank": 4}}
    cpu_trainer = config(**moe, trainer={"device": "cpu"}, launcher={"gpus_per_host": 2})
    with pytest.raises(ConfigError, match="trainer.device: LoRA on the MoE policy .* give the trainer a GPU"):
        check_model(cpu_trainer, plan_devices(cpu_trainer))
    for fine in (
        config(**moe, launcher={"gpus_per_host": 2}),
        config(**moe),
        config(lora={"rank": 4}, trainer={"device": "cpu"}, launcher={"gpus_per_host": 2}),
    ):
        check_model(fine, plan_devices(fine))
    # a model beside the policy is judged by its own slots of the plan, not the policy's
    from meshrl.preflight import check_models

    game = {"data": {"source": "task:propose"}, "launcher": {"gpus_per_host": 4}, "lora": {"rank": 4}}
    moe_model = {"model": {"family": "qwen3_moe", "num_experts": 4, "experts_top_k": 2}}
    refused = config(**game, models=[{"name": "proposer", **moe_model, "trainer": {"device": "cpu"}}])
    with pytest.raises(ConfigError, match=r"models\[0\]\.trainer\.device: LoRA on the MoE policy"):
        check_models(refused, plan_devices(refused))
    fine = config(**game, trainer={"device": "cpu"}, models=[{"name": "proposer", **moe_model, "trainer": {"device": "cuda"}}])  # the dense policy's on CPU
    check_models(fine, plan_devices(fine))


def test_nccl_listens_on_loopback_only_where_every_host_is_this_machine(monkeypatch):
    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    split = config(launcher={"kind": "process", "hosts": 2, "gpus_per_host": 1})
    assert plan_devices(split).env("trainer", 0)[NCCL_IFNAME_ENV] == "lo"
    slurm = plan_devices(config(launcher={"kind": "slurm", "hosts": 2, "gpus_per_host": 8}))
    assert NCCL_IFNAME_ENV not in slurm.env("generator", 0)  # the cluster's interface, as its NCCL_SOCKET_IFNAME says
    monkeypatch.setenv(NCCL_IFNAME_ENV, "ib0")  # the user's choice: inherited, never overridden
    assert NCCL_IFNAME_ENV not in plan_devices(split).env("trainer", 0)


def test_colocated_plans_share_the_gpus_and_auto_picks_them_only_when_the_roles_do_not_fit(monkeypatch):
    monkeypatch.setenv(NCCL_IFNAME_ENV, "lo")
    one = plan_devices(config(launcher={"gpus_per_host": 1}))  # placement auto, one GPU: trainer and engine share it
    assert one.layout == "colocated" and one.placement == "colocate"
    assert one.slot("trainer", 0).gpus == one.slot("generator", 0).gpus == (0,)
    assert one.env("generator", 0) == {DEVICE_ENV: "0", PLAN_ENV: "generator 0"} and one.env("coord") == {DEVICE_ENV: ""}
    node = plan_devices(config(placement="colocate", trainer={"procs": 8}, generator={"replicas": 4, "tp": 2}, launcher={"gpus_per_host": 8}))
    assert [s.gpus for s in node.slots if s.role == "trainer"] == [(r,) for r in range(8)]
    assert [s.gpus for s in node.slots if s.role == "generator"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert node.idle() == {} and "colocated (placement colocate)" in node.table()
    # auto splits wherever the roles fit one GPU each, on several hosts and on CPU
    assert plan_devices(config(launcher={"gpus_per_host": 2})).placement == "split"
    assert plan_devices(config(generator={"replicas": 2}, launcher={"gpus_per_host": 2})).placement == "colocate"
    assert plan_devices(config(launcher={"kind": "process", "hosts": 2, "gpus_per_host": 1})).placement == "split"
    # two `meshrl worker` hosts (launcher.hosts left at 1, as the workers are the hosts): split, where auto colocated
    # every slot on a one-host mesh that does not exist, and the run went synchronous
    workers = {"kind": "workers", "workers": ["10.0.0.2:26600", "10.0.0.3:26600"], "address": "10.0.0.1", "gpus_per_host": 8}
    assert plan_devices(config(trainer={"procs": 8}, generator={"replicas": 8}, launcher=workers)).placement == "split"
    assert plan_devices(config()).placement == "split" and plan_devices(config(placement="colocate")).layout == "cpu"
    # what a split host leaves idle, and the count that would use it
    assert "(generator.replicas=7 would use them)" in plan_devices(config(launcher={"gpus_per_host": 8})).table()


def test_a_torchx_jobs_host_plans_the_gpus_it_was_given(monkeypatch):
    """Inside a TorchX job (launcher.kind=torchx, the controller on the job's one host) whose GPUs
    came from a named resource (`h`), not launcher.gpus_per_host: the plan had none, and the run
    trained on CPU beside the GPUs it was given."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    torchx = plan_devices(config(launcher={"kind": "torchx"}))
    assert torchx.layout != "cpu" and torchx.slot("trainer", 0).gpus == (0,) and torchx.slot("generator", 0).gpus == (1,)
    assert plan_devices(config(launcher={"kind": "slurm", "hosts": 2})).layout == "cpu"  # a cluster's hosts are not this one


def test_auto_transport_keeps_gpu_weights_on_the_gpus_and_one_cpu_host_in_shared_memory():
    def chosen(**sections) -> tuple[str, bool]:
        c = config(**sections)
        transport = resolve_transport(c)
        return transport, weights_on_gpu(plan_devices(c), transport)

    assert chosen() == ("shm", False)  # one CPU host: the generators map the trainer's snapshot
    assert chosen(launcher={"gpus_per_host": 2}) == ("collective", True)  # GPUs of their own: GPU buckets over NCCL
    assert chosen(launcher={"gpus_per_host": 1}) == ("shm", True)  # colocated on one GPU: CUDA IPC
    assert chosen(trainer={"device": "cpu"}, launcher={"gpus_per_host": 1}) == ("shm", False)  # a CPU trainer has no GPU bucket
    assert chosen(launcher={"kind": "process", "hosts": 2, "gpus_per_host": 1}) == ("collective", True)
    assert chosen(launcher={"kind": "process", "hosts": 2}) == ("collective", False)
    assert chosen(weight_sync={"transport": "rdma"}, launcher={"gpus_per_host": 2}) == ("rdma", False)  # a choice is kept
    # shm between GPUs: IPC only where every replica shares trainer rank 0's GPU
    assert chosen(weight_sync={"transport": "shm"}, launcher={"gpus_per_host": 2}) == ("shm", False)
    assert chosen(placement="colocate", trainer={"procs": 2}, generator={"replicas": 2}, launcher={"gpus_per_host": 2}) == ("shm", False)


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"placement": "colocate", "launcher": {"kind": "process", "hosts": 2}}, "placement"),
        ({"placement": "colocate", "distill": {"teacher": "/x"}}, "placement"),
        ({"weight_sync": {"transport": "shm"}, "launcher": {"kind": "process", "hosts": 2}}, "weight_sync.transport"),
    ],
)
def test_colocation_and_shm_need_one_host(sections, field):
    with pytest.raises(ConfigError) as info:
        config(**sections)
    assert info.value.field_path == field


@pytest.mark.parametrize(
    "sections, field, words",
    [
        ({"placement": "split", "launcher": {"gpus_per_host": 1}}, "generator.replicas", "set placement=colocate"),
        ({"placement": "colocate", "generator": {"replicas": 3}, "launcher": {"gpus_per_host": 2}}, "generator.replicas", "set generator.replicas=2"),
        ({"placement": "colocate", "trainer": {"procs": 4}, "launcher": {"gpus_per_host": 2}}, "trainer.procs", "set trainer.procs=2"),
        ({"placement": "colocate", "trainer": {"device": "cpu"}, "launcher": {"gpus_per_host": 2}}, "placement", "set placement=split"),
        (
            {"placement": "split", "trainer": {"procs": 4}, "generator": {"replicas": 6}, "launcher": {"gpus_per_host": 8}},
            "generator.replicas",
            "set generator.replicas=4",
        ),
        (
            {
                "placement": "split",
                "model": {"n_heads": 4, "dim": 128},
                "trainer": {"procs": 2},
                "generator": {"replicas": 2, "tp": 4},
                "launcher": {"gpus_per_host": 8},
            },
            "generator.replicas",
            "set generator.replicas=1",
        ),
        ({"trainer": {"device": "cuda"}}, "trainer.device", "no GPU was found"),
        # auto colocates on one GPU, where NCCL cannot have two ranks: the chosen transport is refused, not crashed on
        ({"weight_sync": {"transport": "collective"}, "launcher": {"gpus_per_host": 1}}, "weight_sync.transport", "set auto or shm"),
    ],
)
def test_a_plan_that_does_not_fit_names_the_field_and_the_fix(sections, field, words):
    with pytest.raises(ConfigError) as info:
        plan_devices(config(**sections))
    assert info.value.field_path == field and words in str(info.value)


def test_cli_prints_the_plan_and_refuses_one_that_does_not_fit():
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "meshrl", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)

    shown = cli("config", "plan", "configs/qwen3-0.6b-gpu.yaml")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("device plan: disaggregated (placement split), 8 GPUs per host") and "generator  7      generator[0]  7" in shown.stdout
    refused = cli("run", "--plan", "placement=split", "launcher.gpus_per_host=1")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "generator.replicas" in refused.stderr


@pytest.mark.slow
def test_trainer_procs_start_with_exactly_their_planned_devices():
    """Real trainer ranks (Monarch procs, TorchTitan model on CPU) spawned under a fake
    4-GPU plan: each proc starts with its own GPU named in its environment."""
    from meshrl.trainer.actor import spawn_trainer

    c = config(trainer={"procs": 2}, launcher={"gpus_per_host": 4})
    assert [s.gpus for s in plan_devices(c).slots if s.role == "trainer"] == [(0,), (1,)]

    async def main():
        mesh = await spawn_trainer(c, timeout_s=300)
        try:
            return await mesh.shard_info()
        finally:
            await mesh.stop()

    infos = asyncio.run(asyncio.wait_for(main(), 600))
    assert [(info["rank"], info["devices"]) for info in infos] == [(0, ["0", "trainer 0"]), (1, ["1", "trainer 1"])]


def test_trained_models_get_gpus_of_their_own_after_the_policys_roles(monkeypatch):
    """Several trained models (docs/coevolve.md) on one host of GPUs: each model's trainer ranks
    and replicas come after the policy's, on GPUs no other proc holds; each proc starts seeing
    its own; the memory plan counts each model's own shape; what does not fit names the model's field."""
    from meshrl.launch.devices import resolve_placement
    from meshrl.launch.memory import plan_memory

    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    two = [{"name": "proposer", "generator": {"replicas": 2}}, {"name": "critic_b", "trainer": {"device": "cpu"}}]
    c = config(models=two, launcher={"gpus_per_host": 6, "gpu_memory_gib": 80})
    assert resolve_placement(c)[0] == "split"  # auto: each model on devices of its own
    plan = plan_devices(c)
    assert_disjoint(plan)
    got = [(s.role, s.index, s.gpus) for s in plan.slots]
    assert got == [
        ("trainer", 0, (0,)),
        ("generator", 0, (1,)),
        ("proposer/trainer", 0, (2,)),
        ("proposer/generator", 0, (3,)),
        ("proposer/generator", 1, (4,)),
        ("critic_b/trainer", 0, ()),  # a CPU trainer holds none
        ("critic_b/generator", 0, (5,)),
    ]
    assert plan.env("proposer/generator", 1)[DEVICE_ENV] == "4" and plan.env("proposer/trainer", 0)[PLAN_ENV] == "proposer/trainer 0"
    assert [(s.role, s.gpus) for s in plan.view("proposer").slots] == [("trainer", (2,)), ("generator", (3,)), ("generator", (4,))]
    assert [s.role for s in plan.view("policy").slots] == ["trainer", "generator"]
    assert weights_on_gpu(plan.view("proposer"), "collective") and not weights_on_gpu(plan.view("critic_b"), "collective")
    assert "proposer/generator  1" in plan.table()
    memory = plan_memory(c, plan=plan)
    roles = {(g.where[2], h.role) for g in memory.gpus for h in g.holdings}
    assert {(2, "proposer/trainer"), (4, "proposer/generator")} <= roles and (0, "trainer") in roles
    for procs in (1, 3):  # several hosts: a model's trainer ranks are laid out over the policy's trainer hosts, evenly
        slurm = {"kind": "slurm", "hosts": 3, "gpus_per_host": 8}
        with pytest.raises(ConfigError) as e:
            plan_devices(config(launcher=slurm, trainer={"procs": 12}, models=[{"name": "p", "trainer": {"procs": procs}}]))
        assert e.value.field_path == "models[0].trainer.procs" and "over the 2 trainer hosts: use a multiple of 2" in str(e.value)
    with pytest.raises(ConfigError) as e:  # critic_b's replica finds no GPU left: its own field, and what the others hold
        plan_devices(config(models=two, launcher={"gpus_per_host": 5}))
    assert e.value.field_path == "models[1].generator.replicas" and "(5 of the 5 GPUs of hosts[0])" in str(e.value), str(e.value)
    big = {"vocab_size": 151936, "dim": 4096, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 12288}
    memory = plan_memory(config(models=[{"name": "big", "model": big}], launcher={"gpus_per_host": 4, "gpu_memory_gib": 80}))
    assert memory.problems[0][0] == "models[0].trainer.procs" and memory.problems[0][1].startswith("trained model big: hosts[0] GPU 2 needs")
    assert "more trainer procs" in memory.problems[0][1] and "lora.rank" in memory.problems[0][1]  # trained models may train adapters too
    adapters = plan_memory(config(models=[{"name": "big", "model": big}], lora={"rank": 8}, launcher={"gpus_per_host": 4, "gpu_memory_gib": 80}))
    (held,) = adapters.gpu("hosts", 0, 2).holdings
    lines = dict(held.lines)
    assert not adapters.problems and lines["AdamW moments (2 x float32)"] < 0.01 * lines["weights (float32)"]  # its adapters alone
    # and weight sync stages and receives its adapters alone (it staged two whole copies, 61 GiB, before)
    assert lines["weight-sync staging (2 slots)"] < 0.01 * lines["weights (float32)"]
    (engine,) = adapters.gpu("hosts", 0, 3).holdings
    assert dict(engine.lines)["weight receive buffers (2 adapter copies, outside vLLM's budget)"] < 0.01 * lines["weights (float32)"]
    taught = plan_devices(config(models=two[:1], distill={"teacher": "/x"}, launcher={"gpus_per_host": 6}))  # the policy's teacher
    assert [(s.role, s.gpus) for s in taught.slots][2:4] == [("teacher", (2,)), ("proposer/trainer", (3,))]
    assert "teacher" not in [s.role for s in taught.view("proposer").slots]
    cpu = plan_devices(config(models=two))
    assert cpu.layout == "cpu" and [s.role for s in cpu.slots][2:] == [
        "proposer/trainer",
        "proposer/generator",
        "proposer/generator",
        "critic_b/trainer",
        "critic_b/generator",
    ]


def test_the_memory_plan_counts_each_model_as_the_run_settles_placement_and_transport():
    """placement and weight_sync.transport `auto`, as preflight sees them: every model's view
    inherits the run's settled choice (pinning.settle_layout), so a model colocated on the
    policy's GPU stages its versions there too, as the run will; a model's view alone would
    resolve otherwise and leave its staging slots out."""
    from meshrl.launch.devices import resolve_placement, resolve_transport
    from meshrl.launch.memory import plan_memory

    two_b = {"vocab_size": 151936, "dim": 2048, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 6144, "dtype": "bfloat16"}
    sections = {"data": {"source": "task:propose"}, "model": two_b, "models": [{"name": "proposer"}], "generator": {"gpu_memory_utilization": 0.3}}
    c = config(**sections, launcher={"gpus_per_host": 2, "gpu_memory_gib": 80})
    assert (resolve_placement(c)[0], resolve_transport(c)) == ("colocate", "shm")
    settled = config(**sections, placement="colocate", weight_sync={"transport": "shm"}, launcher={"gpus_per_host": 2, "gpu_memory_gib": 80})
    planned, run = plan_memory(c), plan_memory(settled)
    staged = {h.role for g in planned.gpus for h in g.holdings if "weight-sync staging (2 slots)" in dict(h.lines)}
    assert staged == {"trainer", "proposer/trainer"}
    assert max(g.peak for g in planned.gpus) == max(g.peak for g in run.gpus) and planned.problems == run.problems != []


def test_colocated_models_share_the_gpus_their_trainers_step_in_turn_in_the_memory_plan(monkeypatch):
    """placement=colocate with trained models beside the policy (docs/coevolve.md): each model's
    trainer ranks and replicas on the same GPUs as the policy's; the memory plan counts every
    engine generating at once beside what each trainer keeps, and one trainer's step at a time;
    what does not fit names the budget that would, or the model's field."""
    from meshrl.launch.devices import resolve_placement
    from meshrl.launch.memory import CUDA_CONTEXT, plan_memory

    monkeypatch.setenv(NCCL_IFNAME_ENV, "lo")
    one = {"name": "proposer"}
    c = config(placement="colocate", models=[one], generator={"gpu_memory_utilization": 0.4}, launcher={"gpus_per_host": 1, "gpu_memory_gib": 80})
    plan = plan_devices(c)
    assert plan.layout == "colocated" and [(s.role, s.gpus) for s in plan.slots] == [
        ("trainer", (0,)),
        ("generator", (0,)),
        ("proposer/trainer", (0,)),
        ("proposer/generator", (0,)),
    ]
    assert [(s.role, s.gpus) for s in plan.view("proposer").slots] == [("trainer", (0,)), ("generator", (0,))]
    assert plan.env("proposer/generator", 0) == {DEVICE_ENV: "0", PLAN_ENV: "proposer/generator 0"}
    memory = plan_memory(c, plan=plan)
    (gpu,) = memory.gpus
    assert [h.role for h in gpu.holdings] == ["trainer", "generator", "proposer/trainer", "proposer/generator"] and not memory.problems
    trainers, engines = gpu.holdings[0::2], gpu.holdings[1::2]
    kept = sum(h.while_generating for h in trainers)
    stepping = max(h.total - h.while_generating for h in trainers) + kept + 2 * CUDA_CONTEXT  # one trainer's step at a time
    assert gpu.peak == max(stepping, kept + sum(h.total for h in engines)) < sum(h.total for h in gpu.holdings)
    # a proposer accumulating its held steps' gradients (trainer.pace.accumulate) keeps them while the engines generate
    accumulating = {"name": "proposer", "trainer": {"pace": {"every": 4, "accumulate": True}}}
    c2 = config(placement="colocate", models=[accumulating], generator={"gpu_memory_utilization": 0.4}, launcher={"gpus_per_host": 1, "gpu_memory_gib": 80})
    (gpu2,) = plan_memory(c2, plan=plan_devices(c2)).gpus
    grads = dict(gpu2.holdings[2].lines)["gradients (float32)"]
    assert gpu2.holdings[2].while_generating == pytest.approx(trainers[1].while_generating + grads) and grads > 0
    assert gpu2.holdings[0].while_generating == trainers[0].while_generating  # the policy's, unpaced, frees them
    # at vLLM's default budget (half the GPU each) two engines cannot fit: the budget that would, in one line
    crowded = plan_memory(config(placement="colocate", models=[one], launcher={"gpus_per_host": 1, "gpu_memory_gib": 80}))
    ((field, why),) = crowded.problems
    assert field == "placement" and "policy, proposer: their 2 engines generate at once" in why and "at most 0.46" in why, why
    fits = plan_memory(
        config(placement="colocate", models=[one], generator={"gpu_memory_utilization": 0.46}, launcher={"gpus_per_host": 1, "gpu_memory_gib": 80})
    )
    assert not fits.problems, fits.problems
    # where one trainer's step beside what the other keeps is what overflows, the budgets are not the fix
    from meshrl.launch.memory import GiB, GPUPlan, Holding, MemoryPlan, _colocated_models

    def trainer(role: str) -> Holding:  # a 60 GiB step that keeps 20 GiB while the engines generate
        return Holding(role, 0, [("weights (float32)", 20 * GiB), ("activations", 40 * GiB)], kept={"weights (float32)"})

    engines = [Holding(role, 0, [("vLLM budget (5% of the GPU)", 4 * GiB)]) for role in ("generator", "proposer/generator")]
    stepping = MemoryPlan(80 * GiB, [GPUPlan(("hosts", 0, 0), [trainer("trainer"), engines[0], trainer("proposer/trainer"), engines[1]])], {}, True, [])
    _colocated_models(c, stepping)
    ((field, why),) = stepping.problems
    assert field == "placement" and "a trainer's step beside what the other trainers keep" in why and "gpu_memory_utilization" not in why, why
    # a scorer on the shared GPU (a judge, a reward model, a PRM) never sleeps: held through the trainer's step too
    prm = Holding("scorer", 0, [("PRM weights and AdamW", 15 * GiB)])
    shared = GPUPlan(("hosts", 0, 0), [trainer("trainer"), engines[0], prm])
    assert shared.peak == 60 * GiB + CUDA_CONTEXT + 15 * GiB  # the step, the engine asleep, the scorer resident
    assert GPUPlan(("hosts", 0, 0), [trainer("trainer"), engines[0]]).peak == 60 * GiB + CUDA_CONTEXT
    for model, field in (({"trainer": {"procs": 2}}, "models[0].trainer.procs"), ({"generator": {"replicas": 2}}, "models[0].generator.replicas")):
        with pytest.raises(ConfigError) as e:  # laid out as the policy's: within the host's GPUs
            plan_devices(config(placement="colocate", models=[{**one, **model}], launcher={"gpus_per_host": 1}))
        assert e.value.field_path == field and "placement=split" in str(e.value), str(e.value)
    # auto: split where every model's roles fit GPUs of their own, else colocated where they fit sharing, never with a critic
    assert [resolve_placement(config(models=[one], launcher={"gpus_per_host": g}))[0] for g in (1, 3, 4)] == ["colocate", "colocate", "split"]
    gae = {**one, "trainer": {"loss": {"advantage": "gae"}}}
    assert resolve_placement(config(models=[gae], launcher={"gpus_per_host": 2}))[0] == "split"
    assert resolve_placement(config(models=[one]))[0] == "split"  # on CPU cores, placement=colocate when asked


def test_a_frozen_model_holds_gpus_for_its_replicas_alone(monkeypatch, tmp_path):
    """models[i].frozen on GPUs: its replicas alone in the device plan (split after the policy's
    roles, or colocated on the policy's GPUs), an engine with no weight-sync buffers in the
    memory plan, and `auto` counting its replicas alone; too few GPUs names its replicas."""
    from meshrl.launch.devices import resolve_placement
    from meshrl.launch.memory import plan_memory

    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    frozen = {"name": "user", "frozen": True, "model": {"path": conftest.build_digit_teacher(tmp_path / "user")}, "generator": {"replicas": 2}}
    c = config(models=[frozen], launcher={"gpus_per_host": 4, "gpu_memory_gib": 80})
    assert resolve_placement(c)[0] == "split"  # 1 + 1 + its 2 replicas fit GPUs of their own
    plan = plan_devices(c)
    assert [(s.role, s.gpus) for s in plan.slots] == [("trainer", (0,)), ("generator", (1,)), ("user/generator", (2,)), ("user/generator", (3,))]
    memory = plan_memory(c, plan=plan)
    (held,) = memory.gpu("hosts", 0, 2).holdings
    assert held.role == "user/generator" and not any("receive" in what for what, _ in held.lines) and not memory.problems, held.lines
    trained = plan_memory(config(models=[{**frozen, "frozen": False, "generator": {"replicas": 1}}], launcher={"gpus_per_host": 4, "gpu_memory_gib": 80}))
    assert any("receive" in what for h in trained.gpu("hosts", 0, 3).holdings for what, _ in h.lines)  # a trained model's engine receives
    with pytest.raises(ConfigError) as e:
        plan_devices(config(models=[frozen], placement="split", launcher={"gpus_per_host": 3}))
    assert e.value.field_path == "models[0].generator.replicas" and "frozen model user needs 2 GPUs" in str(e.value), str(e.value)
    shared = config(models=[frozen], placement="colocate", generator={"gpu_memory_utilization": 0.3}, launcher={"gpus_per_host": 2, "gpu_memory_gib": 80})
    slots = [(s.role, s.gpus) for s in plan_devices(shared).slots]
    assert slots == [("trainer", (0,)), ("generator", (0,)), ("user/generator", (0,)), ("user/generator", (1,))]
    assert resolve_placement(config(models=[frozen], launcher={"gpus_per_host": 2}))[0] == "colocate"


def test_trainer_hosts_are_sized_for_the_critic_and_the_trained_models_beside_the_policy():
    """Trainer hosts were counted from trainer.procs alone, though the critic and each trained
    model's ranks land on them: an 8-rank PPO trainer with its critic on 8-GPU hosts was refused
    at every launcher.hosts ("raise launcher.hosts"), and two 8-rank trainers likewise."""
    from meshrl.launch.hosts import plan_hosts

    slurm = {"kind": "slurm", "gpus_per_host": 8}
    ppo = {"trainer": {"procs": 8, "loss": {"advantage": "gae"}}, "generator": {"replicas": 8}}
    assert plan_hosts(config(**ppo, launcher={**slurm, "hosts": 3})) == {"trainer": 2, "generator": 1}
    plan = plan_devices(config(**ppo, launcher={**slurm, "hosts": 3}))
    assert_disjoint(plan)
    assert sorted({s.role for s in plan.slots}) == ["critic", "generator", "trainer"]
    with pytest.raises(ConfigError, match="leave none for the generators after 2 trainer hosts"):
        plan_hosts(config(**ppo, launcher={**slurm, "hosts": 2}))
    two = {"trainer": {"procs": 8}, "generator": {"replicas": 8}, "models": [{"name": "proposer", "generator": {"replicas": 8}}]}
    assert plan_hosts(config(**two, launcher={**slurm, "hosts": 4})) == {"trainer": 2, "generator": 2}
    assert_disjoint(plan_devices(config(**two, launcher={**slurm, "hosts": 4})))


def test_ppos_critic_gets_a_gpu_beside_a_gpu_trainer_and_is_planned(monkeypatch):
    """trainer.loss.advantage=gae: the critic's proc holds one GPU on the trainer's first host
    beside a GPU trainer (none beside a CPU trainer), starts seeing it alone, and the memory
    plan counts it; a host too small for it says so in one line naming the critic."""
    from meshrl.launch.memory import plan_memory

    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    gae = {"trainer": {"procs": 2, "loss": {"advantage": "gae"}}, "generator": {"replicas": 2}}
    c = config(**gae, launcher={"gpus_per_host": 5, "gpu_memory_gib": 80})
    plan = plan_devices(c)
    assert_disjoint(plan)
    assert [(s.role, s.gpus) for s in plan.slots] == [("trainer", (0,)), ("trainer", (1,)), ("critic", (2,)), ("generator", (3,)), ("generator", (4,))]
    assert plan.env("critic", 0)[DEVICE_ENV] == "2" and plan.env("critic", 0)[PLAN_ENV] == "critic 0"
    memory = plan_memory(c, plan=plan)
    (critic,) = memory.gpu("hosts", 0, 2).holdings
    assert critic.role == "critic" and dict(critic.lines)["weights (float32)"] > 0 and "weight-sync staging (2 slots)" not in dict(critic.lines)
    assert "critic 0:" in memory.table() and not memory.problems
    # it runs packed to trainer.micro_batch_tokens and checkpointed as the policy: counted so
    from meshrl.launch.holdings import critic_holding
    from meshrl.launch.shape import model_shape

    long = config(trainer={**gae["trainer"], "micro_batch_tokens": 4096, "activation_checkpoint": "full"}, launcher={"gpus_per_host": 5, "gpu_memory_gib": 80})
    lines = dict(critic_holding(long, model_shape(long)).lines)
    assert "activations (full checkpointing, 4096 tokens)" in lines, sorted(lines)
    with pytest.raises(ConfigError) as e:
        plan_devices(config(**gae, launcher={"gpus_per_host": 4}))
    assert "+ the critic 1" in str(e.value), str(e.value)
    cpu_trainer = plan_devices(config(trainer={"device": "cpu", "loss": {"advantage": "gae"}}, launcher={"gpus_per_host": 1}))
    assert plan_devices(config(trainer={"loss": {"advantage": "gae"}})).slot("critic", 0).gpus == () == cpu_trainer.slot("critic", 0).gpus
    assert cpu_trainer.env("critic", 0)[DEVICE_ENV] == ""  # a CPU critic beside GPU generators sees no GPU (critic_actor.py: on the CPU)
    # critic.procs=2: a GPU each, FSDP's shards counted: half the weights and AdamW state of the one-proc critic's
    two = config(**gae, critic={"procs": 2}, launcher={"gpus_per_host": 6, "gpu_memory_gib": 80})
    plan = plan_devices(two)
    assert_disjoint(plan)
    assert [(s.role, s.index, s.gpus) for s in plan.slots if s.role == "critic"] == [("critic", 0, (2,)), ("critic", 1, (3,))]
    assert plan.env("critic", 1)[DEVICE_ENV] == "3"
    halves = [dict(h.lines) for gpu in (2, 3) for h in plan_memory(two, plan=plan).gpu("hosts", 0, gpu).holdings]
    assert all(h["weights (float32)"] == pytest.approx(dict(critic.lines)["weights (float32)"] / 2) for h in halves)
    with pytest.raises(ConfigError) as e:
        plan_devices(config(**gae, critic={"procs": 2}, launcher={"gpus_per_host": 5}))
    assert "+ the critic 2" in str(e.value), str(e.value)
    # beside co-evolving models (docs/coevolve.md): the policy's critic after the policy's trainer,
    # each model's roles after the policy's, and none for a model (its advantage is a group's)
    grpo = [{"name": "proposer", "trainer": {"procs": 1, "loss": {"advantage": "grpo"}}, "generator": {"replicas": 1}}]
    models = config(**gae, models=grpo, launcher={"gpus_per_host": 7, "gpu_memory_gib": 80})
    plan = plan_devices(models)
    assert_disjoint(plan)
    assert [(s.role, s.gpus) for s in plan.slots][2:] == [
        ("critic", (2,)),
        ("generator", (3,)),
        ("generator", (4,)),
        ("proposer/trainer", (5,)),
        ("proposer/generator", (6,)),
    ]
    memory = plan_memory(models, plan=plan)
    assert not memory.problems and [h.role for h in memory.gpu("hosts", 0, 2).holdings] == ["critic"]
    # a model that trains by gae too (here inheriting the policy's): a critic of its own, after its trainer
    own = config(
        **gae, models=[{"name": "proposer", "trainer": {"procs": 1}, "generator": {"replicas": 1}}], launcher={"gpus_per_host": 8, "gpu_memory_gib": 80}
    )
    plan = plan_devices(own)
    assert_disjoint(plan)
    assert [(s.role, s.gpus) for s in plan.slots][5:] == [("proposer/trainer", (5,)), ("proposer/critic", (6,)), ("proposer/generator", (7,))]
    assert plan.env("proposer/critic", 0)[DEVICE_ENV] == "6" and [s.role for s in plan.view("proposer").slots] == ["trainer", "critic", "generator"]
    memory = plan_memory(own, plan=plan)
    assert not memory.problems and [h.role for h in memory.gpu("hosts", 0, 6).holdings] == ["proposer/critic"]
    with pytest.raises(ConfigError) as e:  # one GPU short: the model's field, its critic named
        plan_devices(config(**gae, models=[{"name": "proposer", "trainer": {"procs": 1}, "generator": {"replicas": 1}}], launcher={"gpus_per_host": 7}))
    assert e.value.field_path == "models[0].generator.replicas" and "its critic's critic.procs" in str(e.value), str(e.value)


def test_an_implicit_prm_gets_a_gpu_beside_a_gpu_trainer_and_is_planned(monkeypatch):
    """PRIME's PRM (a scorer that trains): one GPU of its own beside a GPU trainer, after the
    trainer's and the generators' (scorer row 0), counted as a float32 model trained on whole
    batches beside its frozen reference; beside a CPU trainer it holds none (the coordinator's proc)."""
    from meshrl.launch.devices import scorer_slots
    from meshrl.launch.memory import plan_memory

    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    prm = {"data": {"source": "task:digits_sparse"}, "scoring": {"scorers": [{"kind": "prm", "batch_size": 8}]}}
    c = config(**prm, launcher={"gpus_per_host": 3, "gpu_memory_gib": 80})
    plan = plan_devices(c)
    assert_disjoint(plan)
    assert [(s.role, s.gpus) for s in plan.slots] == [("trainer", (0,)), ("generator", (1,)), ("scorer", (2,))]
    assert plan.env("scorer", 0)[DEVICE_ENV] == "2" and scorer_slots(c) == [(0, 0)]
    (held,) = plan_memory(c, plan=plan).gpu("hosts", 0, 2).holdings
    lines = dict(held.lines)
    assert held.role == "scorer" and lines["KL reference weights (float32)"] == lines["weights (float32)"] > 0  # pi_ref beside it
    assert "activations (none checkpointing, 2048 tokens)" in lines  # batch_size 8 x model.max_seq_len 256
    # a batch holds whole groups, at least one: 16 rows where a group is larger than batch_size
    wide = config(**prm, generator={"group_size": 16}, launcher={"gpus_per_host": 3, "gpu_memory_gib": 80})
    (held,) = plan_memory(wide, plan=plan_devices(wide)).gpu("hosts", 0, 2).holdings
    assert "activations (none checkpointing, 4096 tokens)" in dict(held.lines)
    cpu = config(**prm, trainer={"device": "cpu"}, launcher={"gpus_per_host": 2})
    assert scorer_slots(cpu) == [] and [s.role for s in plan_devices(cpu).slots] == ["trainer", "generator"]


def test_a_prm_sharded_over_two_procs_gets_a_gpu_for_each_and_half_of_each_holding(monkeypatch):
    """scoring.scorers[].procs=2 beside a GPU trainer: two scorer rows, one GPU each (the
    replica's procs start seeing slots 2 and 3), each planned with half the PRM's weights,
    pi_ref's and AdamW's state, and half a batch's rows."""
    from meshrl.launch.devices import scorer_slots
    from meshrl.launch.memory import plan_memory

    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    one, two = (
        config(
            **{"data": {"source": "task:digits_sparse"}, "scoring": {"scorers": [{"kind": "prm", "batch_size": 8, "procs": n}]}},
            launcher={"gpus_per_host": 4, "gpu_memory_gib": 80},
        )
        for n in (1, 2)
    )
    plan = plan_devices(two)
    assert_disjoint(plan)
    assert [(s.role, s.gpus) for s in plan.slots][2:] == [("scorer", (2,)), ("scorer", (3,))] and scorer_slots(two) == [(0, 0), (0, 0)]
    held = [plan_memory(two, plan=plan).gpu("hosts", 0, g).holdings[0] for g in (2, 3)]
    alone = dict(plan_memory(one, plan=plan_devices(one)).gpu("hosts", 0, 2).holdings[0].lines)
    for h in held:
        lines = dict(h.lines)
        assert h.role == "scorer" and lines["weights (float32)"] == pytest.approx(alone["weights (float32)"] / 2, rel=0.01)
        assert lines["KL reference weights (float32)"] == lines["weights (float32)"] and "activations (none checkpointing, 1024 tokens)" in lines


def test_a_colocated_prm_gets_its_procs_on_distinct_gpus_or_is_refused_in_one_line(monkeypatch):
    """placement=colocate lays a PRM's ranks round-robin over the host's GPUs: each on a GPU of
    its own (one NCCL group cannot hold two ranks on one GPU), or, with more procs than GPUs,
    refused on its `procs` field."""
    monkeypatch.delenv(NCCL_IFNAME_ENV, raising=False)
    prm = {"data": {"source": "task:digits_sparse"}, "placement": "colocate", "trainer": {"procs": 2}}
    plan = plan_devices(config(**prm, scoring={"scorers": [{"kind": "prm", "procs": 2}]}, launcher={"gpus_per_host": 2}))
    assert sorted(s.gpus for s in plan.slots if s.role == "scorer") == [(0,), (1,)]
    with pytest.raises(ConfigError) as e:
        plan_devices(config(**prm, scoring={"scorers": [{"kind": "prm", "procs": 3}]}, launcher={"gpus_per_host": 2}))
    assert e.value.field_path == "scoring.scorers[0].procs" and "set procs=2 or fewer" in str(e.value) and "\n" not in str(e.value)


def test_the_memory_plan_counts_weight_syncs_copies_in_host_memory():
    """What weight sync holds in host memory, per host: the trainer's staging slots where they
    are not on a GPU, and what the generators receive into host memory (rdma and files: up to 3
    copies per replica; a collective with a CPU peer: up to 3 per engine proc, each of a tp engine's)."""
    from meshrl.launch.memory import plan_memory

    gpus = {"gpus_per_host": 4, "gpu_memory_gib": 80}
    nccl = plan_memory(config(launcher=gpus, weight_sync={"transport": "collective"}))
    export = dict(nccl.host_ram["hosts", 0])["export on rank 0"]  # the model's bytes in model.dtype, as it is sent
    assert not [w for w, _ in nccl.host_ram["hosts", 0] if "weight" in w]  # staged and received on the GPUs
    rdma = dict(plan_memory(config(launcher=gpus, weight_sync={"transport": "rdma"}, generator={"replicas": 2})).host_ram["hosts", 0])
    assert rdma["weight-sync staging on rank 0 (up to 4 slots)"] == 4 * export
    assert rdma["weight receive buffers of 2 replicas (up to 3 copies per receiving proc)"] == 2 * 3 * export
    files = dict(plan_memory(config(launcher=gpus, weight_sync={"transport": "files"}, generator={"tp": 2})).host_ram["hosts", 0])
    assert files["weight receive buffers of 1 replica (up to 3 copies per receiving proc)"] == 3 * export  # the replica's subscriber reads each file
    gloo = plan_memory(config(launcher=gpus, trainer={"device": "cpu"}, weight_sync={"transport": "collective"}, generator={"tp": 2}))
    assert dict(gloo.host_ram["hosts", 0])["weight receive buffers of 1 replica (up to 3 copies per receiving proc)"] == 2 * 3 * export
    shm = dict(plan_memory(config(launcher=gpus, weight_sync={"transport": "shm"})).host_ram["hosts", 0])
    assert "weight-sync staging on rank 0 (up to 4 slots)" in shm and not [w for w in shm if "receive" in w]  # engines read the trainer's slots
    assert "hosts[0] host RAM:" in nccl.table() and "weight receive buffers" in plan_memory(config(launcher=gpus, weight_sync={"transport": "rdma"})).table()


def test_a_cpu_run_gives_each_rank_and_replica_a_core_at_least(monkeypatch, tmp_path):
    """`trainer.procs: 64` on a 2-core machine passed every check, then started 64 ranks, each
    importing torch on a share of a core, until the start timed out two minutes later."""
    from meshrl.preflight import preflight

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    base = {"logging": {"run_dir": str(tmp_path)}, "contracts": {"probe": False}, "launcher": {"gpus_per_host": 0}, "trainer": {"device": "cpu"}}
    for field, override, fix in (
        ("trainer.procs", {"trainer": {"procs": 64, "device": "cpu"}}, "64 procs on this machine's 2 cores, without a GPU: at most 2"),
        ("generator.replicas", {"generator": {"replicas": 3}}, "3 procs on this machine's 2 cores"),
        ("models[0].trainer.procs", {"models": [{"name": "proposer", "trainer": {"procs": 4}}], "data": {"source": "task:propose"}}, "4 procs"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"{field}: {fix}")):
            preflight(Config.from_dict({**base, **override}))
