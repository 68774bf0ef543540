"""meshrl's torch-only GPU paths on a real GPU (the device machine: torch and CUDA, no Monarch,
vLLM or TorchTitan), each checked and measured:

- fork_after_query: a process that asks about GPUs the way meshrl does (compat.cuda_present,
  through NVML) can still fork a child that uses CUDA, as vLLM's engine core needs; the
  plain `torch.cuda.is_available()` and a real CUDA init, for comparison.
- nvml_memory: launch.memory.nvml_gpu_memory (the memory plan's GPU size) against CUDA's own figure.
- optimizer_offload: trainer/offload.py on AdamW state on the GPU: memory given back, the
  pinned round trip's time, and the next step bit-equal to one that never moved.
- staging: weightsync's StagingPool with GPU slots, a version streamed in (each tensor made,
  copied and dropped, as the publisher now streams gathered tensors): peak memory over the
  slots, and the bytes equal; the same into a pinned host slot.
- lm_head_logits: log-prob error of bf16 LM-head logits (the trainer's GPU path before
  meshrl/trainer/head.py) against float32 logits of the same bf16 operands, and of the
  head as meshrl now runs it (float32 output of the bf16 matmul), with its gradients.

    python benchmarks/gpu_torch_checks.py --out DIR   # writes DIR/gpu_torch_checks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FORK_CHILD = """
import os, sys, torch
sys.path.insert(0, {root!r})
how = sys.argv[1]
if how == "meshrl":
    from meshrl.compat import cuda_present
    asked = cuda_present()
elif how == "is_available":
    asked = torch.cuda.is_available()
else:
    torch.cuda.init(); asked = True
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda").add_(1); torch.cuda.synchronize(); os._exit(0)
    except Exception as e:
        sys.stderr.write(repr(e)[:200] + "\\n"); os._exit(1)
_, status = os.waitpid(pid, 0)
print(asked, os.waitstatus_to_exitcode(status), torch.cuda.is_initialized())
"""


def fork_after_query() -> dict:
    out = {}
    for how in ("meshrl", "is_available", "cuda_init"):
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
        p = subprocess.run([sys.executable, "-c", FORK_CHILD.format(root=ROOT), how], capture_output=True, text=True, timeout=120, env=env)
        words = p.stdout.split()
        out[how] = {
            "child_used_cuda": bool(words) and words[1] == "0",
            "parent_cuda_initialised": bool(words) and words[2] == "True",
            "stderr": p.stderr.strip().splitlines()[-1:] if p.returncode or (words and words[1] != "0") else [],
        }
    return out


def nvml_memory() -> dict:
    import torch

    from meshrl.launch.memory import nvml_gpu_memory

    return {"nvml_bytes": nvml_gpu_memory(), "cuda_bytes": torch.cuda.get_device_properties(0).total_memory}


def optimizer_offload(params_m: int = 512) -> dict:
    import torch

    from meshrl.trainer.offload import OptimizerOffload

    def setup():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(params_m * 2**20 // 64, device="cuda")) for _ in range(64)]
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
        return ps, opt

    def step(ps, opt, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ref_ps, ref_opt = setup()
    step(ref_ps, ref_opt, 1)
    step(ref_ps, ref_opt, 2)
    ref = [p.detach().clone() for p in ref_ps]
    del ref_ps, ref_opt
    torch.cuda.empty_cache()
    ps, opt = setup()
    step(ps, opt, 1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offload = OptimizerOffload()
    t0 = time.perf_counter()
    moved = offload.offload(opt)
    t_off = time.perf_counter() - t0
    torch.cuda.empty_cache()
    during = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    offload.restore()
    t_back = time.perf_counter() - t0
    after = torch.cuda.memory_allocated()
    # a second round trip reuses the pinned buffers: the steady per-step cost
    t0 = time.perf_counter()
    offload.offload(opt)
    t_off2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    offload.restore()
    t_back2 = time.perf_counter() - t0
    step(ps, opt, 2)
    equal = all(torch.equal(a, b) for a, b in zip(ps, ref))
    return {
        "params": sum(p.numel() for p in ps),
        "moved_bytes": moved,
        "allocated_before": before,
        "allocated_offloaded": during,
        "reserved_offloaded": reserved,
        "allocated_restored": after,
        "offload_s": t_off,
        "restore_s": t_back,
        "gb_per_s_out": moved / t_off / 1e9,
        "gb_per_s_back": moved / t_back / 1e9,
        "second_offload_s": t_off2,
        "second_restore_s": t_back2,
        "next_step_bit_equal": equal,
    }


def staging(tensors: int = 64, each_mb: int = 64) -> dict:
    import torch

    from meshrl.weightsync.layout import plan_layout, unpack
    from meshrl.weightsync.staging import StagingPool

    n = each_mb * 2**20 // 2

    def version(v):  # made one at a time, as gathered full tensors arrive
        for i in range(tensors):
            g = torch.Generator(device="cuda").manual_seed(v * 1000 + i)
            yield f"layers.{i}.weight", torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)

    out = {}
    for where in ("gpu", "pinned_host"):
        pool = StagingPool(lease_timeout_s=30, max_slots=4)
        pool.use_device(torch.device("cuda", 0) if where == "gpu" else None, 2 if where == "gpu" else None)
        first = list(version(1))
        layout = plan_layout(first, 256 << 20)
        pool.publish(1, layout, first)
        del first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        slot = pool.publish(2, layout, version(2))  # streamed
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak_over = torch.cuda.max_memory_allocated() - base
        got = dict(unpack(slot.flat, layout))
        equal = all(torch.equal(got[name].to("cuda"), t) for name, t in version(2))
        out[where] = {
            "model_bytes": layout.total_bytes,
            "one_tensor_bytes": n * 2,
            "peak_over_resident": peak_over,
            "stream_s": seconds,
            "bytes_equal": equal,
            "slot_device": str(slot.flat.device),
            "pinned": bool(slot.flat.is_pinned()),
        }
        del pool, slot, got
        torch.cuda.empty_cache()
    return out


def lm_head_logits(tokens: int = 2048, dim: int = 4096, vocab: int = 151936) -> dict:
    import torch

    from meshrl.trainer.head import float32_logits, head_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(dim, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, device="cuda") * (30 / dim**0.5 / 4))  # logits with a spread around 30
    h = torch.randn(tokens, dim, device="cuda").to(torch.bfloat16)
    targets = torch.randint(vocab, (tokens,), device="cuda")

    def logprobs(logits):
        return torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])

    def grads(make_logits):
        x = h.detach().clone().requires_grad_(True)
        head.weight.grad = None
        logprobs(make_logits(x)).sum().backward()
        return x.grad.float(), head.weight.grad.float()

    exact = logprobs(h.float() @ head.weight.float().T)  # float32 logits of the bf16 operands
    rounded = logprobs(head(h))  # a bf16 head: what the trainer computed before meshrl/trainer/head.py
    ref_gx, ref_gw = grads(lambda x: x.float() @ head.weight.float().T)
    float32_logits(head)
    ours = head_logits(head, h)
    gx, gw = grads(lambda x: head_logits(head, x))
    rel = lambda a, b: float((a - b).norm() / b.norm())
    return {
        "logit_abs_max": float((h.float() @ head.weight.float().T).abs().max()),
        "bf16_logprob_err_mean": float((rounded - exact).abs().mean()),
        "bf16_logprob_err_max": float((rounded - exact).abs().max()),
        "head_dtype": str(ours.dtype),
        "head_logprob_err_max": float((logprobs(ours) - exact).abs().max()),
        "head_grad_hidden_rel_err": rel(gx, ref_gx),
        "head_grad_weight_rel_err": rel(gw, ref_gw),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    import torch

    result = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    result["fork_after_query"] = fork_after_query()  # before this process touches CUDA
    result["gpu"] = torch.cuda.get_device_name(0)
    for name, check in (("nvml_memory", nvml_memory), ("optimizer_offload", optimizer_offload), ("staging", staging), ("lm_head_logits", lm_head_logits)):
        t0 = time.perf_counter()
        try:
            result[name] = check()
        except Exception as e:  # noqa: BLE001 - each check reports on its own
            result[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        result[name]["wall_s"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(result[name])[:600], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_torch_checks.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["fork_after_query"]))


if __name__ == "__main__":
    main()
