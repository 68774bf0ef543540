"""The pure cores run where Monarch and vLLM cannot be imported.

Each module below is imported in a fresh interpreter in which `import monarch` and
`import vllm` (and any of their submodules) raise ImportError; then the cores do real work
there: a trainer step, a weight layout packed, staged and unpacked, an episode group
packed and queued, a rollout worker built. A module that starts importing Monarch or vLLM
at import time, or a core that needs them to run, fails this test with the import chain
that pulled them in. The procs that never compile import no torch._dynamo either.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PURE = [
    # config and the ground floor
    "meshrl.config",
    "meshrl.episode",
    "meshrl.pinning",
    "meshrl.metrics",
    "meshrl.logs",
    "meshrl.host",
    "meshrl.imports",
    "meshrl.tokenizer",
    "meshrl.compat",
    "meshrl.futures",
    "meshrl.errors",
    "meshrl.stability",
    # the domain and the checks that need it
    "meshrl.rollout.env",
    "meshrl.rollout.tools",
    "meshrl.rollout.chat",
    "meshrl.rollout.sandbox",
    "meshrl.rollout.coding",
    "meshrl.tasks",
    "meshrl.data",
    "meshrl.scoring",
    "meshrl.verifiers",
    "meshrl.distill",
    "meshrl.preflight",
    # the queue's policy and the rollout worker
    "meshrl.queue",
    "meshrl.queue.buffer",
    "meshrl.agent.turns",
    "meshrl.agent.worker",
    # the trainer rank
    "meshrl.trainer.policy",
    "meshrl.trainer.losses",
    "meshrl.trainer.logprobs",
    "meshrl.trainer.checkpoint",
    "meshrl.trainer.lora",
    "meshrl.trainer.model",
    "meshrl.trainer.parallelize",
    "meshrl.trainer.routing",
    # the weight path
    "meshrl.weightsync",
    "meshrl.weightsync.layout",
    "meshrl.weightsync.staging",
    "meshrl.weightsync.buffers",
    "meshrl.weightsync.bytecopy",
    "meshrl.weightsync.collective",
    "meshrl.weightsync.files",
    "meshrl.weightsync.connect",
    # the generation service (vLLM is imported when an engine starts, not before)
    "meshrl.generator.service",
    "meshrl.generator.engine",
    "meshrl.generator.weight_loading",
    # the host plan
    "meshrl.launch.hosts",
    "meshrl.launch.devices",
]

SHELLS = [
    "meshrl.trainer.actor",
    "meshrl.generator.actor",
    "meshrl.agent.actor",
    "meshrl.queue.actor",
    "meshrl.weightsync.publisher",
    "meshrl.weightsync.subscriber",
    "meshrl.launch.allocation",
]
"""The Monarch shells: with Monarch blocked these must fail to import (else the block is not working)."""

SCRIPT = r"""
import importlib, importlib.abc, sys, traceback

BLOCKED = ("monarch", "vllm")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            chain = [f"{f.filename.split('/meshrl/')[-1]}:{f.lineno}" for f in traceback.extract_stack() if "/meshrl/" in f.filename]
            raise ImportError(f"{name} is blocked; imported via {chain}")
        return None

sys.meta_path.insert(0, Block())
pure, shells = sys.argv[1].split(","), sys.argv[2].split(",")
for name in pure:
    importlib.import_module(name)
for name in shells:
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    raise SystemExit(f"{name} imported with Monarch blocked: the block does not work")

import torch
from meshrl.config import Config
from meshrl.episode import Episode, Turn, assign_advantages, pack, concat

# a trainer step on a real (tiny) TorchTitan model
from meshrl.trainer.policy import PolicyTrainer
config = Config.from_dict({"model": {"family": "qwen3"}, "trainer": {"micro_batch_size": 4}})
groups = []
for g in range(2):
    episodes = [Episode(g, g * 10 + i, [Turn("env", [1, 5, 6, 7]), Turn("model", [9, 10, 11], [-1.0] * 3, [0] * 3, reward=float(i % 2))])
                for i in range(4)]
    groups.append(assign_advantages(pack(episodes), "grpo"))
batch = concat(groups)
trainer = PolicyTrainer(config, torch.device("cpu"))
out = trainer.train_step(batch, current_version=0)
assert out["version"] == 1 and out["tokens"] == 24.0, out
named = list(trainer.sync_state_dict(torch.float32))
assert named and all(t.is_contiguous() for _, t in named)

# the weight path: plan, stage a snapshot, unpack it bit for bit
from meshrl.weightsync import StagingPool, plan_layout, unpack
layout = plan_layout(named, 1 << 20)
pool = StagingPool(lease_timeout_s=10)
pool.publish(1, layout, named)
lease = pool.acquire(1)
got = unpack(lease.slot.flat, layout)
assert all(torch.equal(t, got[name]) for name, t in named)
assert pool.release(lease)

# the queue's policy: admit, claim, put, sample
from meshrl.queue import EpisodeQueue
q = EpisodeQueue(Config.from_dict({"batch_groups": 1, "generator": {"group_size": 4}}))
claim = q.claim(0, timeout=1.0)
assert claim is not None
episodes = [Episode(claim.group_id, i, [Turn("env", [1, 2]), Turn("model", [3], [-0.1], [claim.version], reward=float(i))]) for i in range(4)]
assert q.put(claim.group_id, assign_advantages(pack(episodes), "grpo"), claim.token)
assert q.sample(1, current_version=0, timeout=1.0)["group_id"].unique().tolist() == [claim.group_id]
print("ok", len(sys.modules))
"""


def test_pure_cores_import_and_run_without_monarch_or_vllm():
    done = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(PURE), ",".join(SHELLS)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.startswith("ok"), done.stdout


def test_tensordict_imports_without_dynamo_and_marks_its_functions_once_dynamo_loads():
    """meshrl's processes import tensordict without torch._dynamo (compat.DeferredDynamoMarks);
    importing torch._dynamo afterwards gives each held function its torch.compile mark, as an
    import of tensordict with torch._dynamo loaded first does, and a mark made after it at once."""
    import textwrap

    code = textwrap.dedent("""
        import sys
        import meshrl, tensordict, tensordict.base as base, tensordict.utils as utils
        import meshrl.controller.loop, meshrl.queue, meshrl.agent.worker
        assert "torch._dynamo" not in sys.modules
        import torch._dynamo
        from torch._dynamo import trace_rules
        allowed = trace_rules._allowed_callable_ids
        assert id(utils._add_batch_dim_c) in allowed and id(base._foreach_copy_compiled) in allowed
        assert utils._lock_warn._dynamo_marked_constant
        def late(x):
            return x
        utils.allow_in_graph(late)  # tensordict's own name for the mark, called after torch._dynamo loaded
        assert id(late) in allowed
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("preset", [None, "7s"])
def test_meshrl_has_monarch_poll_its_meshes_every_second_unless_told(preset):
    """compat.monarch_prompt_supervision, as `import meshrl` applies it: Monarch's supervision
    poll (10 s by default, how late a killed proc's calls fail) is 1 s in meshrl's processes,
    read again (once) where Monarch was imported first; a value the user set is kept, unread."""
    import json
    import textwrap

    code = textwrap.dedent("""
        import json, os
        import monarch.actor
        import monarch._rust_bindings.monarch_hyperactor.config as config
        reads, reload = [], config.reload_config_from_env
        config.reload_config_from_env = lambda: (reads.append(1), reload())[1]
        import meshrl
        print(json.dumps({"poll": os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"], "reads": len(reads)}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"}
    if preset is not None:
        env["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"] = preset
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"poll": preset or "1s", "reads": 0 if preset else 1}
