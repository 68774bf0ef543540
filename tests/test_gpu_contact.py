"""GPU start-up conditions made on a CPU machine (issue 41): what a generator proc asks of
CUDA before vLLM starts, the GPUs a proc is given under a preset CUDA_VISIBLE_DEVICES, and
the plans refused at preflight because they cannot start on GPUs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from meshrl.config import Config, ConfigError
from meshrl.launch.devices import plan_devices
from tests import conftest

# A fresh interpreter where torch believes it was built with CUDA and NVML sees one GPU;
# the CUDA runtime's device count (what marks later forks as unable to use CUDA) records
# its callers instead of answering.
FAKE_GPU = textwrap.dedent("""
    import os, sys, traceback, torch
    asked = []
    def runtime_count():
        asked.append("".join(traceback.format_stack(limit=6)))
        return 1
    torch.cuda._is_compiled = lambda: True
    torch._C._cuda_getDeviceCount = runtime_count
    torch.cuda._device_count_nvml = lambda: 1
    torch.cuda._cached_device_count = None
""")


def test_a_generator_proc_asks_for_gpus_without_initialising_cuda(tmp_path):
    """Everything a generator proc runs before vLLM starts its engine core (a fork on GPU):
    the engine's settings (sleep mode, routed-expert capture), LoRA's check, the staging
    pool. None may ask the CUDA runtime, or the forked engine core cannot use CUDA."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"eos_token_id": 2}')
    code = FAKE_GPU + textwrap.dedent(f"""
        from meshrl.compat import cuda_present, vllm_runs_lora_on
        from meshrl.config import GeneratorConfig
        from meshrl.generator.engine import VLLMEngine
        from meshrl.weightsync.staging import StagingPool
        engine = VLLMEngine(GeneratorConfig(return_routed_experts=True), {str(ckpt)!r}, sleep_mode=True)
        assert engine.sleep_mode and not engine.capture_routing, "the fake GPU was not seen"
        assert vllm_runs_lora_on(moe=True) and StagingPool(10.0).pinned and cuda_present()
        assert not torch.cuda.is_initialized()
        print("runtime asked:", len(asked))
        print("".join(asked))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "runtime asked: 0" in out.stdout, out.stdout


def test_the_fake_gpu_would_catch_a_runtime_query():
    """The check above can fail: a bare torch.cuda.is_available() asks the runtime."""
    code = FAKE_GPU + "torch.cuda.is_available(); print('runtime asked:', len(asked))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in __import__("os").environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"},
    )
    assert "runtime asked: 1" in out.stdout, out.stdout + out.stderr


def test_procs_get_the_controllers_gpus_under_a_preset_visible_devices(monkeypatch):
    """A job given GPUs 4,5 of a shared node: its procs see 4 and 5, never 0 and 1 (CUDA
    reads a proc's CUDA_VISIBLE_DEVICES as physical indices)."""
    from meshrl.launch.devices import DEVICE_ENV

    monkeypatch.setenv(DEVICE_ENV, "4,5")
    plan = plan_devices(Config.from_dict({"placement": "split"}))
    assert plan.gpus_per_host == 2
    assert plan.env("trainer", 0)[DEVICE_ENV] == "4" and plan.env("generator", 0)[DEVICE_ENV] == "5"
    monkeypatch.setenv(DEVICE_ENV, "GPU-aaaa,GPU-bbbb,-1,GPU-cccc")  # UUIDs; CUDA stops at -1
    plan = plan_devices(Config.from_dict({"placement": "split"}))
    assert plan.gpus_per_host == 2 and plan.env("generator", 0)[DEVICE_ENV] == "GPU-bbbb"


def test_process_stand_in_hosts_hold_disjoint_gpus_of_the_machine(monkeypatch):
    """launcher.kind=process: stand-in hosts on one machine. Trainer rank 0 and generator
    replica 0 are each GPU 0 of their own host, and must be different GPUs of the machine."""
    from meshrl.launch.devices import DEVICE_ENV

    monkeypatch.setenv(DEVICE_ENV, "0,1,2,3")
    cfg = {"launcher": {"kind": "process", "hosts": 2, "gpus_per_host": 2}, "trainer": {"procs": 2}, "generator": {"replicas": 2}}
    plan = plan_devices(Config.from_dict(cfg))
    assert plan.slot("trainer", 0).gpus == plan.slot("generator", 0).gpus == (0,)  # each host's own numbering
    seen = [plan.env(role, i)[DEVICE_ENV] for role in ("trainer", "generator") for i in range(2)]
    assert seen == ["0", "1", "2", "3"]
    with pytest.raises(ConfigError, match="launcher.gpus_per_host"):
        plan_devices(Config.from_dict({**cfg, "launcher": {**cfg["launcher"], "gpus_per_host": 4}}))  # 8 GPUs wanted, 4 here


def test_deepseek_v3_on_gpu_generators_needs_a_half_precision_dtype(tmp_path):
    from meshrl.preflight import preflight

    def cfg(dtype: str, gpus: int) -> Config:
        return Config.from_dict(
            {"model": {"family": "deepseek_v3", "dtype": dtype}, "launcher": {"gpus_per_host": gpus}, "logging": {"run_dir": str(tmp_path / "run")}}
        )

    with pytest.raises(ConfigError, match="model.dtype") as info:
        preflight(cfg("float32", 2))
    assert "bfloat16" in str(info.value)
    preflight(cfg("bfloat16", 2))
    preflight(cfg("float32", 0))  # vLLM's CPU MLA backend takes float32


def test_drift_quantiles_hold_past_torch_quantiles_limit():
    """A rank's loss tokens of long traces pass 2^24, where torch.quantile raises (after the
    optimizer step had been taken)."""
    import torch

    from meshrl.trainer.drift import quantiles

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    want = torch.quantile(x.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
    assert quantiles(x, [0.01, 0.5, 0.99]) == pytest.approx(want)
    big = torch.arange(2**24 + 2, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        torch.quantile(big, 0.5)
    assert quantiles(big, [0.5]) == [pytest.approx((2**24 + 1) / 2)]


def test_the_kl_reference_scores_in_eval_mode():
    import torch

    from meshrl.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(Config.from_dict({"trainer": {"loss": {"kl_coef": 0.1}}, "lora": {"rank": 4, "dropout": 0.1}}), torch.device("cpu"))
    assert trainer.model.training and not trainer.ref_model.training


# ---- the GPU memory plan -------------------------------------------------------------------
QWEN3 = {  # config.json shapes of Qwen3-0.6B, -8B and -32B
    "0.6B": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "intermediate_size": 3072, "tie_word_embeddings": True},
    "8B": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "intermediate_size": 12288, "tie_word_embeddings": False},
    "32B": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64, "intermediate_size": 25600, "tie_word_embeddings": False},
}
GIB = 2**30


def qwen3_config(tmp_path, size: str, **sections) -> Config:
    import json

    path = tmp_path / size
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, **QWEN3[size]})
    )
    base = {
        "model": {"path": str(path), "max_seq_len": 4096, "dtype": "bfloat16"},
        "trainer": {"device": "cuda", "micro_batch_tokens": 8192, "activation_checkpoint": "full"},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return Config.from_dict(base)


def test_memory_plan_parameters_match_the_published_sizes(tmp_path):
    from meshrl.launch.shape import model_shape

    # Qwen3's model cards: 0.6B (0.44B without embeddings), 8.2B, 32.8B
    for size, billions in (("0.6B", 0.596), ("8B", 8.19), ("32B", 32.76)):
        assert model_shape(qwen3_config(tmp_path, size)).params / 1e9 == pytest.approx(billions, rel=0.005)


def test_memory_plan_of_0_6b_colocated_on_one_gpu(tmp_path):
    """One 80 GiB GPU, trainer and engine taking turns. By hand, P = 596.0M parameters:
    the trainer's step holds 16 B/param of float32 weights, gradients and AdamW moments
    (8.88 GiB), two bf16 staging slots (2.22 GiB), the blocks FSDP gathers (2 blocks bf16 +
    one fp32, and the 155.6M-parameter tied head in bf16: 0.41 GiB), 8192 tokens of full
    checkpointing (28 layers x 1024 x 2 B kept, plus one block's 4x1024 + 6x2048 + 4x1024 +
    4x3072 values x 2 B: 0.94 GiB), the LM head's float32 chunk and hidden states (1.77 GiB),
    one gathered tensor (0.29 GiB) and a 0.5 GiB context: about 15.0 GiB. While the engine
    generates it keeps weights, AdamW and slots (2.22 + 4.44 + 2.22 + 0.5 GiB) beside the
    engine's 40 GiB budget and context: 49.9 GiB, the peak."""
    from meshrl.launch.memory import plan_memory

    plan = plan_memory(qwen3_config(tmp_path, "0.6B", launcher={"gpus_per_host": 1, "gpu_memory_gib": 80}))
    gpu = plan.gpu("hosts", 0, 0)
    trainer = next(h for h in gpu.holdings if h.role == "trainer")
    assert gpu.colocated and not plan.problems and not plan.offload_optimizer
    assert trainer.total / GIB == pytest.approx(15.0, rel=0.05)
    assert gpu.peak / GIB == pytest.approx(49.9, rel=0.05)


def test_memory_plan_of_8b_on_eight_gpus_and_its_refusal_on_one(tmp_path):
    """8 GPUs of 80 GiB, 4 trainer ranks and 4 engines. By hand, P = 8.19B: rank 0 holds 16 B
    x P / 4 (30.5 GiB), two bf16 staging slots (30.5 GiB), gathered blocks (2.6 GiB), 8192
    tokens fully checkpointed (36 x 4096 x 2 B kept + one block's 4x4096 + 6x4096 + 4x1024 +
    4x12288 values x 2 B: 3.69 GiB), LM head chunk and hidden states (1.87 GiB), a gathered
    embedding (1.16 GiB) and its context: 70.8 GiB; ranks 1-3 39.2 GiB. Each engine: its 40 GiB
    budget, context and the collective transport's two receive copies (30.5 GiB): 71.0 GiB.
    Colocated on one GPU, the trainer's step alone needs 16 B x 8.19B = 122 GiB: refused."""
    from meshrl.launch.memory import check_memory, plan_memory

    plan = plan_memory(
        qwen3_config(tmp_path, "8B", launcher={"gpus_per_host": 8, "gpu_memory_gib": 80}, placement="split", trainer={"procs": 4}, generator={"replicas": 4})
    )
    assert not plan.problems
    assert plan.gpu("hosts", 0, 0).peak / GIB == pytest.approx(70.8, rel=0.05)
    assert plan.gpu("hosts", 0, 1).peak / GIB == pytest.approx(39.2, rel=0.05)
    assert plan.gpu("hosts", 0, 4).peak / GIB == pytest.approx(71.0, rel=0.05)
    (tmp_path / "one").mkdir()
    with pytest.raises(ConfigError, match=r"trainer.procs: .*GPU 0 needs .* for the trainer's step alone"):
        check_memory(qwen3_config(tmp_path / "one", "8B", launcher={"gpus_per_host": 1, "gpu_memory_gib": 80}))


def test_memory_plan_of_32b_on_two_hosts_of_eight(tmp_path):
    """2 hosts x 8 GPUs of 80 GiB: 8 trainer ranks on one, two engines of tp=4 on the other,
    weights over RDMA (host buffers). By hand, P = 32.76B: each trainer rank holds 16 B x P / 8
    (61.0 GiB), gathered blocks (5.1 GiB), 4096 tokens fully checkpointed (64 x 5120 x 2 B kept +
    one block's 4x5120 + 6x8192 + 4x1024 + 4x25600 values x 2 B: 1.65 GiB), LM head chunk and
    hidden states (1.82 GiB) and its context: 70.1 GiB. Each engine GPU: 40 GiB budget (its
    weights 32.76B x 2 B / 4 = 15.3 GiB) and context: 40.5 GiB. The collective transport would
    put two whole copies (122 GiB) on trainer rank 0's GPU and on every engine GPU: refused,
    naming the transport."""
    from meshrl.launch.memory import check_memory, plan_memory

    sections = dict(
        launcher={"kind": "slurm", "hosts": 2, "gpus_per_host": 8, "gpu_memory_gib": 80},
        placement="split",
        trainer={"procs": 8, "micro_batch_tokens": 4096},
        generator={"replicas": 2, "tp": 4},
    )
    plan = plan_memory(qwen3_config(tmp_path, "32B", weight_sync={"transport": "rdma"}, **sections))
    assert not plan.problems
    assert plan.gpu("trainer", 0, 0).peak / GIB == pytest.approx(70.1, rel=0.05)
    assert plan.gpu("generator", 0, 0).peak / GIB == pytest.approx(40.5, rel=0.05)
    (tmp_path / "collective").mkdir()
    with pytest.raises(ConfigError, match=r"weight_sync.transport: .*two whole copies of the model"):
        check_memory(qwen3_config(tmp_path / "collective", "32B", weight_sync={"transport": "collective"}, **sections))
    assert "memory plan: 80.0 GiB per GPU" in plan.table() and "GPUs 0-7, each" in plan.table()
    # an engine GPU over-full by vLLM's own budget (over rdma): named by that budget, not the transport it already avoids
    (tmp_path / "budget").mkdir()
    full = qwen3_config(
        tmp_path / "budget", "32B", weight_sync={"transport": "rdma"}, **{**sections, "generator": {"replicas": 2, "tp": 4, "gpu_memory_utilization": 0.95}}
    )
    with pytest.raises(ConfigError, match=r"vLLM's budget and its CUDA context outgrow the GPU: lower it to at most 0\.94") as info:
        check_memory(full)
    assert info.value.field_path == "generator.gpu_memory_utilization"


def test_offloaded_adamw_state_frees_its_storage_checkpoints_and_trains_on(tmp_path):
    """Colocated on a GPU, AdamW's state waits in host memory while the engines generate:
    its device storage is given back, a checkpoint taken meanwhile saves the host copy, and
    the next step restores it and trains exactly as if it had stayed (on CPU here: the same
    storage moves, between host buffers)."""
    import torch

    from meshrl.trainer.policy import PolicyTrainer
    from tests.test_trainer import CPU, make_batch, make_config

    kept, moved = PolicyTrainer(make_config(), CPU), PolicyTrainer(make_config(), CPU)
    for trainer in (kept, moved):
        trainer.train_step(make_batch(seed=0), current_version=0)
    states = [v for s in moved.optimizer.state.values() for v in s.values() if v.numel() > 1]
    before = {id(v): v.clone() for v in states}
    assert moved._offload.offload(moved.optimizer, include_cpu=True) >= sum(v.numel() * 4 for v in states)
    assert all(v.untyped_storage().nbytes() == 0 for v in states)  # the device storage is given back
    assert all(
        torch.equal(moved.optimizer.state[p]["exp_avg"], kept.optimizer.state[q]["exp_avg"])  # host copies in its place
        for p, q in zip(moved.optimizer.state, kept.optimizer.state)
    )
    path = moved.save_checkpoint(str(tmp_path / "ckpt"))  # from host memory
    a, b = kept.train_step(make_batch(seed=1), current_version=1), moved.train_step(make_batch(seed=1), current_version=1)
    assert a["loss"] == b["loss"] and all(torch.equal(x, y) for x, y in zip(kept.model.parameters(), moved.model.parameters()))
    assert all(v.untyped_storage().nbytes() > 0 for v in states) and not moved._offload.offloaded
    fresh = PolicyTrainer(make_config(), CPU)
    fresh.load_checkpoint(path)
    restored = [v for s in fresh.optimizer.state.values() for v in s.values() if v.numel() > 1]
    assert all(torch.equal(r, before[id(v)]) for r, v in zip(restored, states))
    buffers = len(moved._offload._host)  # a load (a heal, a resume) makes new state dicts: the same pinned buffers serve them
    moved.load_checkpoint(path)
    moved._offload.offload(moved.optimizer, include_cpu=True)
    assert len(moved._offload._host) == buffers


def test_scaling_generators_past_the_device_plan_says_so():
    import asyncio
    from types import SimpleNamespace

    from meshrl.controller.replicas import GeneratorPool

    config = Config.from_dict({"launcher": {"gpus_per_host": 2}, "placement": "split", "trainer": {"device": "cuda"}})
    pool = GeneratorPool(config, SimpleNamespace(plan=plan_devices(config)), "unused", 0, on_change=None)
    with pytest.raises(ValueError, match=r"GPUs to 1 generator replica\(s\): scale to at most 1"):
        asyncio.run(pool.scale(2, 0))


def test_float32_attention_on_gpus_is_refused_by_the_memory_plan(tmp_path):
    """trainer.compute_dtype=float32 on GPU leaves attention the math kernel: 8192 tokens of
    0.6B (16 heads) keep 8192 x 4096 x 16 x 4 B x 2 scores per layer, 28 layers: 112 GiB."""
    from meshrl.launch.memory import check_memory

    with pytest.raises(ConfigError, match=r"trainer.compute_dtype: .*float32 attention scores.*bfloat16"):
        check_memory(
            qwen3_config(
                tmp_path, "0.6B", launcher={"gpus_per_host": 1, "gpu_memory_gib": 80}, trainer={"compute_dtype": "float32", "activation_checkpoint": "none"}
            )
        )


def test_a_teacher_or_judge_its_engine_cannot_hold_is_refused_by_the_memory_plan(tmp_path):
    """Only the policy's engine was checked against vLLM's budget: a 32B teacher (61 GiB of
    bf16 weights) beside a 0.6B policy at gpu_memory_utilization 0.5 of 80 GiB planned a KV
    cache of 0 tokens and passed, then its engine failed to start; a judge likewise."""
    from meshrl.launch.memory import plan_memory

    teacher = qwen3_config(tmp_path, "32B").model.path
    sections = {"launcher": {"gpus_per_host": 4, "gpu_memory_gib": 80}, "generator": {"gpu_memory_utilization": 0.5}}
    cases = {
        "plain": ({}, None),
        "teacher": ({"distill": {"teacher": teacher}}, "the teacher's"),
        "judge": ({"scoring": {"scorers": [{"kind": "judge", "path": teacher, "template": "Rate {response}"}]}}, "judge scoring.scorers[0]'s"),
    }
    for name, (extra, whose) in cases.items():
        (tmp_path / name).mkdir()
        problems = plan_memory(qwen3_config(tmp_path / name, "0.6B", **sections, **extra)).problems
        if whose is None:
            assert not problems, problems
        else:
            assert [f for f, _ in problems] == ["generator.gpu_memory_utilization"] and f"cannot hold {whose} weights" in problems[0][1], problems


def _checkpoint_rank(rank: int, path: str):
    import meshrl.trainer.policy as policy
    from tests.test_trainer import CPU, make_batch

    built_on = []
    build = policy.build_model
    policy.build_model = lambda cfg, device, **kw: built_on.append(str(device)) or build(cfg, device, **kw)
    rows = []
    for wrapped in ({}, {"activation_checkpoint": "full"}):
        trainer = policy.PolicyTrainer(_checkpoint_config(path, procs=2, **wrapped), CPU, rank, 2)
        row = trainer.train_step(make_batch(seed=0, version=0), current_version=0)
        rows.append((row["loss"], row["grad_norm"], row["kl"]))
    # compiled blocks too take the checkpoint's weights (built, not run: compiling is the GPU's)
    compiled = policy.PolicyTrainer(_checkpoint_config(path, procs=2, activation_checkpoint="full", compile=True), CPU, rank, 2)
    embedding = compiled.model.state_dict()["tok_embeddings.weight"].full_tensor()
    return built_on[:2], rows, embedding.numpy()


def _checkpoint_config(path: str, **trainer) -> Config:
    return Config.from_dict({"model": {"path": path}, "trainer": {"loss": {"kl_coef": 0.05}, **trainer}})


@pytest.mark.slow  # two gloo procs
def test_a_checkpoint_is_sharded_before_it_is_materialised(tmp_path):
    """On a trainer mesh a checkpoint's model (and its KL reference) is built on the meta
    device, sharded, then materialised and loaded shard by shard, and trains as one whole
    process loaded the usual way does: under activation checkpointing too, and compiled."""
    from meshrl.trainer.policy import PolicyTrainer
    from tests.conftest import build_lora_base, gloo_ranks
    from tests.test_trainer import CPU, make_batch

    path = build_lora_base(tmp_path / "base", head_scale=1.0)
    results = gloo_ranks(_checkpoint_rank, 2, path)
    whole = PolicyTrainer(_checkpoint_config(path), CPU)
    embedding = whole.model.state_dict()["tok_embeddings.weight"].clone().numpy()  # (before its step moves it)
    want = whole.train_step(make_batch(seed=0, version=0), current_version=0)
    for built_on, rows, loaded in results:
        assert built_on == ["meta", "meta"]  # the policy and the reference
        # with activation checkpointing (or compiled blocks) the wrappers' parameter names read
        # as missing from the checkpoint, and every sharded run with a checkpoint failed to start
        for loss, grad_norm, kl in rows:
            assert loss == pytest.approx(want["loss"], abs=1e-6) and grad_norm == pytest.approx(want["grad_norm"], rel=1e-4)
            assert kl == pytest.approx(want["kl"], abs=1e-7)
        assert (loaded == embedding).all()


def _reference_rank(rank: int, path: str):
    from meshrl.trainer.policy import PolicyTrainer
    from tests.test_trainer import CPU

    trainer = PolicyTrainer(_checkpoint_config(path), CPU, rank, 1)
    return {
        name: b.full_tensor().numpy() if hasattr(b, "full_tensor") else b.numpy()
        for name, b in trainer.ref_model.named_buffers()
        if name.endswith("expert_bias_E")
    }


@pytest.mark.slow  # a gloo proc
def test_a_sharded_kl_reference_keeps_the_checkpoints_router_bias(tmp_path):
    """A DeepSeek-V3 checkpoint on a trainer mesh (built on the meta device, then materialised):
    its KL reference holds the checkpoint's router biases (`expert_bias_E`, a buffer), as the
    policy does, where it kept the zeros of its initialisation and routed otherwise from step 0."""
    import numpy as np

    from meshrl.config import ModelConfig
    from meshrl.trainer import checkpoint as ckpt
    from meshrl.trainer.model import build_model
    from tests.conftest import gloo_ranks
    from tests.test_deepseek_export import _perturb

    model, specs = build_model(ModelConfig(family="deepseek_v3", n_layers=2), seed=1)
    _perturb(model, seed=2)
    path = ckpt.export_hf(model, specs, tmp_path / "hf")
    want = {name: b.numpy() for name, b in model.named_buffers() if name.endswith("expert_bias_E")}
    (got,) = gloo_ranks(_reference_rank, 1, str(path))
    assert want and sorted(got) == sorted(want) and any(np.abs(b).max() > 0.1 for b in want.values())
    for name, b in want.items():
        np.testing.assert_array_equal(got[name], b)


def test_a_replica_that_missed_a_version_never_generates_again():
    """A replica whose weight update failed, and whose replacement failed too, leaves the pool
    at once (asleep at level 2 it would otherwise wake on dropped weights under its old
    version); the next health check spawns the replica that is missing."""
    import asyncio
    from types import SimpleNamespace

    from meshrl.controller.replicas import GeneratorPool

    Replica = conftest.FakeReplica
    changes = []

    async def on_change():
        changes.append(1)

    config = Config.from_dict({"generator": {"replicas": 2}})
    pool = GeneratorPool(config, SimpleNamespace(plan=plan_devices(config)), "unused", 0, on_change=on_change)
    good, bad = Replica(0), Replica(1, broken=True)
    pool.replicas = [good, bad]
    spawned = []

    async def spawn(index):
        if not spawned:
            spawned.append(None)
            raise RuntimeError("no GPU free yet")
        fresh = Replica(index)
        spawned.append(fresh)
        return fresh

    pool.spawn = spawn
    asyncio.run(pool.update(3))
    assert pool.replicas == [good] and bad.stopped and good.synced == [3] and changes
    asyncio.run(pool.check(3))
    assert [r.index for r in pool.replicas] == [0, 1] and pool.replicas[1] is spawned[1] and spawned[1].synced == [3]


def test_a_sleeping_pool_replaces_a_dead_replica_once_it_wakes():
    """placement=colocate: a replica that dies while the pool sleeps for a trainer's step is
    not replaced then (its replacement's engine would start awake on the devices the trainer
    steps on, and nothing generates meanwhile) but at the first health check after `wake`;
    a frozen model's replicas sleep keeping their weights, which nothing would load again."""
    import asyncio
    from types import SimpleNamespace

    from meshrl.controller.replicas import GeneratorPool

    Replica = conftest.FakeReplica

    async def on_change():
        pass

    async def spawn(index):
        return Replica(index)

    config = Config.from_dict({"generator": {"replicas": 2}})
    for frozen in (False, True):
        pool = GeneratorPool(config, SimpleNamespace(plan=plan_devices(config)), "unused", 0, on_change=on_change, frozen=frozen)
        pool.replicas, pool.spawn = [Replica(0), Replica(1)], spawn
        asyncio.run(pool.sleep(keep_weights=False))
        assert all(r.calls == [("sleep", frozen)] for r in pool.replicas)  # level 2 unless frozen
        dead = pool.replicas[1]
        dead.stopped = True
        asyncio.run(pool.check(4))
        assert pool.replicas[1] is dead and pool.replaced == 0  # asleep: left for after the step
        asyncio.run(pool.wake())
        asyncio.run(pool.check(4))
        fresh = pool.replicas[1]
        assert fresh is not dead and pool.replaced == 1 and fresh.calls == ([] if frozen else [("sync_weights", 4)]), fresh.calls
