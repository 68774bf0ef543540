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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"})
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
        return Config.from_dict({"model": {"family": "deepseek_v3", "dtype": dtype}, "launcher": {"gpus_per_host": gpus},
                                 "logging": {"run_dir": str(tmp_path / "run")}})

    with pytest.raises(ConfigError, match="model.dtype") as info:
        preflight(cfg("float32", 2))
    assert "bfloat16" in str(info.value)
    preflight(cfg("bfloat16", 2))
    preflight(cfg("float32", 0))  # vLLM's CPU MLA backend takes float32


def test_drift_quantiles_hold_past_torch_quantiles_limit():
    """A rank's loss tokens of long traces pass 2^24, where torch.quantile raises (after the
    optimizer step had been taken)."""
    import torch

    from meshrl.trainer.policy import _quantiles

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    want = torch.quantile(x.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
    assert _quantiles(x, [0.01, 0.5, 0.99]) == pytest.approx(want)
    big = torch.arange(2**24 + 2, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        torch.quantile(big, 0.5)
    assert _quantiles(big, [0.5]) == [pytest.approx((2**24 + 1) / 2)]


def test_the_kl_reference_scores_in_eval_mode():
    import torch

    from meshrl.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(Config.from_dict({"trainer": {"loss": {"kl_coef": 0.1}}, "lora": {"rank": 4, "dropout": 0.1}}), torch.device("cpu"))
    assert trainer.model.training and not trainer.ref_model.training
