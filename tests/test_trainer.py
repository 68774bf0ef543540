"""The TorchTitan trainer: log-probs, HF export, FSDP2 / EP meshes on real Monarch procs, DCP.

References are computed in this process with the same code on one rank (no
torch.distributed), so every mesh result is compared against the single-process value.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from meshrl.config import Config, ConfigError, LossConfig, ModelConfig
from meshrl.episode import Episode, Turn, assign_advantages, pack
from meshrl.trainer import policy as trainer_policy
from meshrl.trainer import checkpoint as ckpt
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.packing import micro_batch_count, rank_rows
from meshrl.trainer.policy import PolicyTrainer
from meshrl.trainer.logprobs import token_logprobs
from meshrl.trainer.losses import CORRECTIONS, policy_loss
from meshrl.trainer.model import build_model, model_args_from_hf
from tests.conftest import InspectableTrainerActor, InspectableTrainerMesh

CPU = torch.device("cpu")


def make_batch(groups: int = 4, group_size: int = 4, seed: int = 0, version: int = 0, turns: int = 1):
    """A scored rollout batch (episode.pack) of random tokens with ragged prompts and responses.

    With `turns` > 1 the episodes are multi-turn: model turns separated by env turns (tool
    results, replies) of ragged length, and some episodes end with an env turn."""
    rng = random.Random(seed)
    episodes, sid = [], 0
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(rng.randrange(3, 8))]
        for _ in range(group_size):
            ep = Episode(g, sid, [Turn("env", prompt)])
            for t in range(turns):
                if t:
                    ep.turns.append(Turn("env", [rng.randrange(3, 100) for _ in range(rng.randrange(1, 6))]))
                n = rng.randrange(2, 12)
                ep.turns.append(
                    Turn(
                        "model",
                        [rng.randrange(3, 100) for _ in range(n)],
                        [-4 * rng.random() for _ in range(n)],
                        [max(0, version - rng.randrange(0, 2))] * n,
                        reward=rng.random() / turns,
                    )
                )
            if turns > 1 and rng.random() < 0.5:
                ep.turns.append(Turn("env", [rng.randrange(3, 100) for _ in range(rng.randrange(1, 4))]))
            episodes.append(ep)
            sid += 1
    return assign_advantages(pack(episodes), "grpo")


def make_config(family: str = "qwen3", procs: int = 1, **trainer) -> Config:
    return Config.from_dict({"model": {"family": family}, "trainer": {"procs": procs, "micro_batch_size": 3, **trainer}})


def run(loop, coro, timeout: float = 300):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def spawn_inspectable(config: Config):
    """A trainer mesh with the test-only endpoints (tests.conftest) on top of the production ones."""
    return spawn_trainer(config, actor_class=InspectableTrainerActor, mesh_class=InspectableTrainerMesh)


# ---- single process ----------------------------------------------------------------------
def test_rank_rows_split_whole_groups_and_micro_batches_match():
    td = make_batch(groups=5, group_size=3)
    shares = [rank_rows(td, r, 2) for r in range(2)]
    assert shares[0] == list(range(9)) and shares[1] == list(range(9, 15))  # 3 + 2 groups
    assert micro_batch_count(td, 2, 4) == 3  # rank 0: 9 rows -> 3 micro-batches; rank 1 pads
    assert rank_rows(td, 0, 1) == list(range(15))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_direct_log_softmax(temperature):
    model, _ = build_model(ModelConfig(family="qwen3"), seed=3)
    batch = make_batch(turns=2)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    lp, ent = token_logprobs(model, tokens, mask, temperature, with_entropy=True, chunk_size=7)
    logits = model(tokens).float() / temperature
    ref_all = F.log_softmax(logits[:, :-1], -1)
    ref = torch.zeros_like(lp)
    ref[:, 1:] = ref_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ref_ent = torch.zeros_like(lp)
    ref_ent[:, 1:] = -(ref_all.exp() * ref_all).sum(-1)
    ref, ref_ent = ref * mask, ref_ent * mask
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()
    # gradients through the checkpointed chunks equal the direct ones
    g1 = torch.autograd.grad(lp.sum(), model.lm_head.weight)[0]
    g2 = torch.autograd.grad(ref.sum(), model.lm_head.weight)[0]
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("top_k, top_p", [(20, 0.9), (-1, 0.9), (20, 1.0), (3, 0.5), (1, 1.0)])
def test_sampling_mask_replays_vllms_truncation(top_k, top_p):
    """With top-k / top-p the trainer scores each token under vLLM's own truncated and
    renormalised distribution (vLLM's PyTorch rule, called here as the reference); a
    sampled token outside the kept set keeps its full log-prob and counts as a miss."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    model, _ = build_model(ModelConfig(family="qwen3"), seed=3)
    batch = make_batch(turns=2)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    misses: list = []
    lp, _ = token_logprobs(model, tokens, mask, 0.7, chunk_size=7, top_k=top_k, top_p=top_p, misses=misses)
    with torch.no_grad():
        logits = model(tokens).float()[:, :-1] / 0.7
    flat = logits.reshape(-1, logits.shape[-1])
    n = flat.shape[0]
    truncated = apply_top_k_top_p_pytorch(flat.clone(), torch.full((n,), top_k) if top_k > 0 else None, torch.full((n,), top_p) if top_p < 1 else None)
    processed = F.log_softmax(truncated, -1).view_as(logits).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    full = F.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    inside = processed.isfinite()
    ref = torch.zeros_like(lp)
    ref[:, 1:] = torch.where(inside, processed, full)
    scored = mask.clone()
    scored[:, 0] = False
    torch.testing.assert_close(lp[scored], ref[scored], atol=1e-5, rtol=1e-5)
    assert misses[0].item() == (~inside & scored[:, 1:]).sum().item()
    assert (~inside & scored[:, 1:]).any() and (top_k == 1 or (inside & scored[:, 1:]).any())  # both cases (top_k 1: random tokens are rarely the greedy one)
    assert (lp[scored] >= full[scored[:, 1:]] - 1e-6).all()  # renormalised over fewer tokens: never less likely


def test_sampling_mask_changes_nothing_without_truncation():
    model, _ = build_model(ModelConfig(family="qwen3"), seed=3)
    batch = make_batch(turns=2)
    a, _ = token_logprobs(model, batch["tokens"], batch["loss_mask"], 1.0)
    b, _ = token_logprobs(model, batch["tokens"], batch["loss_mask"], 1.0, top_k=-1, top_p=1.0, misses=[])
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, family):
    from transformers import AutoModelForCausalLM

    model, specs = build_model(ModelConfig(family=family), seed=1)
    out = ckpt.export_hf(model, specs, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(3, 100, (2, 24))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4
    # and back: HF dir -> ModelConfig + weights through TorchTitan's adapter
    cfg, overrides = model_args_from_hf(out)
    assert (cfg.family, cfg.dim, cfg.n_layers) == (family, 64, 2)
    model2, specs2 = build_model(cfg, seed=9, hf_overrides=overrides)
    ckpt.load_hf(model2, specs2, out)
    with torch.no_grad():
        assert torch.equal(model2(tokens), model(tokens))


def test_an_export_names_its_own_dtype_over_a_transformers_5_source_config(tmp_path):
    """A checkpoint saved by transformers 5 names its dtype as `dtype`, which transformers reads
    before `torch_dtype`: an export in another dtype names the export's, under both keys."""
    from transformers import AutoConfig

    model, specs = build_model(ModelConfig(family="qwen3"), seed=1)
    source = tmp_path / "source"
    fields = dict(specs.hf_config)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(source)
    assert json.loads((source / "config.json").read_text())["dtype"] == "float32"
    out = ckpt.export_hf(model, specs, tmp_path / "hf", dtype=torch.bfloat16, source_config=source / "config.json")
    written = json.loads(open(os.path.join(out, "config.json")).read())
    assert (written["dtype"], written["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16


def test_an_export_with_its_tokenizer_is_whole_or_not_at_all(tmp_path):
    """hf/final (the run's export, its tokenizer beside the weights): an export that fails
    after the weights are written (here at its tokenizer) leaves the previous one whole and
    nothing half-written beside it."""
    from meshrl.controller import checkpoint as checkpoints

    from tests.conftest import build_qwen_style_tokenizer

    model, specs = build_model(ModelConfig(family="qwen3"), seed=1)

    class Trainer:
        async def export_hf(self, path, base_dir):
            return ckpt.export_hf(model, specs, path)

    run_dir, tokenizer = tmp_path / "run", build_qwen_style_tokenizer(tmp_path / "tokenizer")
    final = run_dir / "hf" / "final"
    assert asyncio.run(checkpoints.export_hf(Trainer(), str(final), str(run_dir), tokenizer)) == str(final)
    files = sorted(os.listdir(final))
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(files)
    with pytest.raises(Exception):
        asyncio.run(checkpoints.export_hf(Trainer(), str(final), str(run_dir), str(tmp_path / "no-tokenizer")))
    assert sorted(os.listdir(final)) == files and os.listdir(final.parent) == ["final"]


def test_a_llama_3_2_checkpoint_tied_and_rope_scaled_loads_with_transformers_logits(tmp_path):
    """A Llama 3.2-style checkpoint made by transformers: tied embeddings (no lm_head in its
    files, where the load failed after the meshes started) and `llama3` rope scaling (dropped,
    so the trainer's log-probs were apart from vLLM's, which applies it). Another scaling is
    refused by name rather than trained on silently."""

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf_config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True, rms_norm_eps=1e-5,
    )  # fmt: skip
    hf = LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path / "llama", safe_serialization=True)
    cfg, overrides = model_args_from_hf(tmp_path / "llama")
    assert cfg.family == "llama3" and overrides["tie"] and overrides["rope_scaling"]["factor"] == 8.0
    model, specs = build_model(cfg, seed=9, hf_overrides=overrides)
    ckpt.load_hf(model, specs, str(tmp_path / "llama"))
    tokens = torch.randint(3, 128, (2, 96))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="llama3 rope_type 'yarn' is not mapped onto TorchTitan"):
        model_args_from_hf(tmp_path / "llama")


@pytest.mark.parametrize("turns", [1, 3])
def test_micro_batches_sum_to_the_full_batch_loss(turns):
    batch = make_batch(version=2, turns=turns)  # token versions 1 and 2
    small = PolicyTrainer(make_config(micro_batch_size=3), CPU)
    whole = PolicyTrainer(make_config(micro_batch_size=64), CPU)
    a, b = small.train_step(batch, current_version=2), whole.train_step(batch, current_version=2)
    assert a["version"] == b["version"] == 1
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
    assert a["tokens"] == float(batch["loss_mask"].sum())
    assert a["staleness_max"] == 1.0 and 0 < a["staleness_mean"] < 1  # lags 0 / 1
    assert a["reward_mean"] == pytest.approx(float(batch["reward"].mean()))  # the trained batch's own


GARBAGE = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 7.0, -123.0, 0.0])


def garbage_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return GARBAGE[torch.randint(len(GARBAGE), x.shape, generator=g)].to(x.dtype)


def after_last_model_token(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] True after each row's last model token: context for no model token."""
    last = torch.where(mask, torch.arange(mask.shape[1]), -1).amax(dim=1, keepdim=True)
    return torch.arange(mask.shape[1]) > last


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_env_tokens_never_train_in_the_loss(correction, aggregation):
    """Whatever the per-token inputs hold at env positions (prompt, tool results, replies,
    padding): the loss is the same, and its gradient there is exactly zero."""
    batch = make_batch(turns=3, seed=5)
    mask = batch["loss_mask"]
    env = ~mask
    assert env[:, batch["prompt_len"].max() :].any() and mask.any()  # env tokens between model turns
    cfg = LossConfig(correction=correction, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    g = torch.Generator().manual_seed(1)
    lp = torch.where(mask, batch["sampler_logprobs"] + 0.3 * torch.randn(mask.shape, generator=g), 0.0)
    inputs = {  # as the trainer has them: log-probs and entropies 0 off the scored positions
        "logprobs": lp,
        "sampler": batch["sampler_logprobs"],
        "prox": torch.where(mask, lp + 0.1 * torch.randn(mask.shape, generator=g), 0.0),
        "ref": torch.where(mask, lp - 0.2 * torch.rand(mask.shape, generator=g), 0.0),
        "entropy": torch.where(mask, torch.rand(mask.shape, generator=g), 0.0),
    }

    def loss_and_grad(values):
        logprobs = values["logprobs"].clone().requires_grad_()
        loss, _ = policy_loss(
            logprobs,
            values["sampler"],
            batch["advantage"],
            mask,
            cfg,
            prox_logprobs=values["prox"],
            ref_logprobs=values["ref"],
            entropy=values["entropy"],
            token_count=int(mask.sum()),
            seq_count=int(mask.any(1).sum()),
        )
        loss.backward()
        return loss.detach(), logprobs.grad

    loss, grad = loss_and_grad(inputs)
    assert torch.isfinite(loss) and (grad[env] == 0).all()
    assert (grad[mask] != 0).any()
    changed = {k: torch.where(env, garbage_like(v, seed=i), v) for i, (k, v) in enumerate(inputs.items())}
    loss2, grad2 = loss_and_grad(changed)
    assert torch.equal(loss, loss2)
    assert torch.equal(grad[mask], grad2[mask]) and (grad2[env] == 0).all()


def test_env_tokens_never_train_in_a_train_step(monkeypatch):
    """A PolicyTrainer step on multi-turn episodes: garbage sampler log-probs at every env
    position, and other ids where they are context for no model token, leave the loss and
    every parameter gradient unchanged; the loss has zero gradient on the trainer's
    log-probs at env positions."""
    batch = make_batch(turns=3, seed=2, version=1)
    mask = batch["loss_mask"]
    changed = batch.clone()
    changed["sampler_logprobs"] = torch.where(mask, batch["sampler_logprobs"], garbage_like(batch["sampler_logprobs"], 3))
    trailing = after_last_model_token(mask)
    assert trailing.any() and (trailing & (batch["tokens"] != 0)).any()  # env turns and padding after the last model turn
    changed["tokens"] = torch.where(trailing, torch.randint(3, 100, mask.shape), batch["tokens"])
    assert not torch.equal(changed["tokens"], batch["tokens"])

    seen = []

    def spy(logprobs, sampler_logprobs, advantage, loss_mask, cfg, **kwargs):
        logprobs.retain_grad()
        seen.append((logprobs, loss_mask.clone()))
        return policy_loss(logprobs, sampler_logprobs, advantage, loss_mask, cfg, **kwargs)

    monkeypatch.setattr(trainer_policy, "policy_loss", spy)
    steps = []
    for b in (batch, changed):
        trainer = PolicyTrainer(make_config(), CPU)
        out = trainer.train_step(b, current_version=1)
        steps.append((out, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    (a, grads_a), (b, grads_b) = steps
    assert a["tokens"] == b["tokens"] == float(mask.sum())
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["mismatch"] == b["mismatch"]
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert len(seen) == 2 * micro_batch_count(batch, 1, 3)
    for logprobs, loss_mask in seen:
        assert logprobs.grad is not None
        assert (logprobs.grad[~loss_mask] == 0).all()  # env tokens: exactly no gradient
        assert (logprobs.grad[loss_mask] != 0).any()


def test_a_step_off_the_trainers_pace_keeps_weights_and_optimizer_and_moves_the_version(tmp_path):
    """trainer.pace {every: 2, offset: 1}: step 1 holds, step 2 updates (as an unpaced
    trainer's first step does, on the same batch), step 3 holds. A held step reports the
    same loss an update would have taken, with no gradient and nothing moved. A snapshot by
    DCP (a GPU trainer's) of the held step gives the optimizer no state (torch's state dict
    would make it one by a step of lr 0), and a trainer restored from it updates alike."""
    from meshrl.trainer.snapshot import Snapshots, load_snapshot

    paced, plain = PolicyTrainer(make_config(pace={"every": 2, "offset": 1}), CPU), PolicyTrainer(make_config(), CPU)
    start = {n: p.detach().clone() for n, p in paced.model.named_parameters()}
    first, second = make_batch(seed=3, version=0), make_batch(seed=4, version=1)
    held = paced.train_step(first, current_version=0)
    assert held["version"] == 1 and held["updated"] == 0.0 and held["grad_norm"] == 0.0 and held["weight_version"] == 0.0
    assert held["tokens"] == float(first["loss_mask"].sum()) and math.isfinite(held["loss"])
    assert held["loss"] == plain.train_step(first, current_version=0)["loss"]  # the loss an update would have taken
    assert all(torch.equal(p, start[n]) for n, p in paced.model.named_parameters())
    assert not paced.optimizer.state and all(p.grad is None for p in paced.model.parameters())
    snaps = Snapshots(str(tmp_path / "snapshots"), 1, blocking=False)
    snaps.start(1, paced.model, paced.optimizer, paced.scheduler)
    restored = PolicyTrainer(make_config(pace={"every": 2, "offset": 1}), CPU)
    assert not paced.optimizer.state and load_snapshot(snaps.finish(), restored.model, restored.optimizer, restored.scheduler) == 1
    restored.step = 1
    restored.train_step(second, current_version=1)
    moved = paced.train_step(second, current_version=1)
    assert all(torch.equal(p, q) for p, q in zip(paced.model.parameters(), restored.model.parameters()))
    assert moved["version"] == 2 and moved["updated"] == 1.0 and moved["grad_norm"] > 0 and moved["weight_version"] == 1.0
    fresh = PolicyTrainer(make_config(), CPU)
    fresh.train_step(second, current_version=1)  # an unpaced trainer's first update, on that batch: the same weights
    reference = dict(fresh.model.named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in paced.model.named_parameters())
    assert not all(torch.equal(p, start[n]) for n, p in paced.model.named_parameters())
    after = {n: p.detach().clone() for n, p in paced.model.named_parameters()}
    third = paced.train_step(make_batch(seed=5, version=2), current_version=2)
    assert third["updated"] == 0.0 and third["weight_version"] == 1.0  # its own version: the updates it made
    assert paced.step == 3 and all(torch.equal(p, after[n]) for n, p in paced.model.named_parameters())


def test_a_snapshot_on_a_full_disk_is_an_error_not_a_sigbus(tmp_path, monkeypatch):
    """A snapshot's files were made sparse (truncate) and filled through a shared mapping: on a
    full disk the copy's page fault killed the trainer by SIGBUS, healed into the same death
    until its restarts ran out, with no word of the disk. Their blocks are taken first: ENOSPC
    is an OSError, said."""
    import errno

    from meshrl.trainer.snapshot import Snapshots

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    model = torch.nn.Linear(2, 1)
    snaps = Snapshots(str(tmp_path / "snapshots"), 1, blocking=True)
    with pytest.raises(OSError, match="No space left on device"):
        snaps.start(1, model, torch.optim.AdamW(model.parameters()), None)
        snaps.finish()


def test_an_export_killed_while_it_removes_the_last_one_leaves_a_whole_one(tmp_path, monkeypatch):
    """An export replaced the last one by removing it (gigabytes: seconds) and then renaming
    the new one in: a kill in the removal (Slurm's KillWait, the OOM killer) left neither
    whole. The last one is set aside by a rename first, and removed once the new one is in."""
    import shutil

    from meshrl.trainer import checkpoint as ckpt

    out = str(tmp_path / "final")
    ckpt.write_hf_dir({"w": torch.zeros(2)}, {"v": 1}, out)
    real = shutil.rmtree

    def killed(path, *args, **kwargs):  # removes one file of a directory with files, then the process is gone
        files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else []
        if files:
            os.remove(files[0])
            raise KeyboardInterrupt
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_hf_dir({"w": torch.ones(2)}, {"v": 2}, out)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"] and json.load(open(os.path.join(out, "config.json"))) == {"v": 2}


def test_the_same_step_saved_again_replaces_the_first_whole(tmp_path):
    """A run's last step checkpointed, then its final checkpoint at the same step: the second
    save sets the first aside until it is in place, and leaves one complete checkpoint."""
    from meshrl.trainer import checkpoint as ckpt

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    first = ckpt.save_checkpoint(tmp_path, 3, model, opt)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert ckpt.save_checkpoint(tmp_path, 3, model, opt) == first and ckpt.checkpoint_step(tmp_path) == 3
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000003"]
    fresh = torch.nn.Linear(2, 1)
    ckpt.load_checkpoint(first, fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.weight, model.weight)
    os.replace(first, tmp_path / ".step-00000003.old")  # a save cut short between its two renames: the one set aside is read
    assert ckpt.checkpoint_step(tmp_path) == 3


def test_a_step_with_nothing_in_the_loss_moves_the_version_and_not_the_weights():
    """Every row failed (or a game's model had none of its own: model_rows' stand-in): AdamW's
    momentum and decay would move the weights on a zero gradient; the step makes no update."""
    for packed in (0, 256):  # rows of no tokens packed (trainer.micro_batch_tokens): each still a document
        trainer = PolicyTrainer(make_config(micro_batch_tokens=packed), CPU)
        _step_with_nothing_in_the_loss(trainer)


def test_a_step_whose_gradient_is_not_finite_writes_nothing_into_the_weights():
    """One NaN sampler log-prob on a trained token made the loss NaN, and AdamW wrote NaN into
    every weight; the update is skipped now (`trainer/nonfinite`), as the critic's and the PRM's."""
    trainer = PolicyTrainer(make_config(), CPU)
    trainer.train_step(make_batch(seed=3, version=0), current_version=0)
    bad = make_batch(seed=4, version=1)
    row, col = bad["loss_mask"].nonzero()[0].tolist()
    bad["sampler_logprobs"][row, col] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.train_step(bad, current_version=1)
    assert out["nonfinite"] == 1.0 and out["updated"] == 0.0 and out["version"] == 2
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    out = trainer.train_step(make_batch(seed=5, version=2), current_version=2)
    assert out["nonfinite"] == 0.0 and out["updated"] == 1.0 and math.isfinite(out["grad_norm"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _step_with_nothing_in_the_loss(trainer):
    from meshrl.episode import model_rows

    trainer.train_step(make_batch(seed=3, version=0), current_version=0)  # AdamW has momentum now
    game = make_batch(seed=4, version=1)
    game["model"] = torch.zeros(game.batch_size, dtype=torch.int64)  # all the policy's: a proposer's step has none
    empty = model_rows(game, 1)
    assert not empty["loss_mask"].any() and empty["reward"].tolist() == [0.0]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.train_step(empty, current_version=1)
    assert out["version"] == 2 and out["updated"] == 0.0 and out["reward_mean"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.train_step(make_batch(seed=5, version=2), current_version=2)["updated"] == 1.0


def test_a_paced_trainer_that_accumulates_updates_on_the_rows_of_its_held_steps_too(tmp_path):
    """trainer.pace {every: 2, offset: 1, accumulate: true}: step 1 holds (its weights kept) and
    keeps its gradients, through a colocated release of the trainer's memory; step 2 updates as
    an unpaced trainer's one step on the two batches together: the loss's mean over all their
    tokens (the batches' token counts differ). A restore drops the held gradients."""
    pace = {"every": 2, "offset": 1, "accumulate": True}
    paced, plain = PolicyTrainer(make_config(pace=pace), CPU), PolicyTrainer(make_config(), CPU)
    start = {n: p.detach().clone() for n, p in paced.model.named_parameters()}
    both = make_batch(groups=8, seed=3, version=0)
    first, second = both[:16], both[16:]  # four groups of four each
    assert first["loss_mask"].sum() != second["loss_mask"].sum()
    held = paced.train_step(first, current_version=0)
    assert held["updated"] == 0.0 and held["update_steps"] == 0.0 and paced.held == 1
    assert all(torch.equal(p, start[n]) for n, p in paced.model.named_parameters()) and not paced.optimizer.state
    assert all(p.grad is not None for p in paced.model.parameters())
    paced.release_memory()  # colocated: the held gradients stay
    assert all(p.grad is not None for p in paced.model.parameters())
    stepped = {}  # each trainer's gradient as its optimizer steps

    def capture(trainer, name):
        trainer.optimizer.register_step_pre_hook(lambda *_: stepped.__setitem__(name, [p.grad.clone() for p in trainer.model.parameters()]))

    capture(paced, "paced")
    capture(plain, "plain")
    moved = paced.train_step(second, current_version=1)
    assert moved["updated"] == 1.0 and moved["update_steps"] == 2.0 and paced.held == 0
    together = plain.train_step(both, current_version=0)
    assert moved["grad_norm"] == pytest.approx(together["grad_norm"], rel=1e-5)
    for a, b in zip(stepped["paced"], stepped["plain"]):  # the same gradient, but for summation order
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    # AdamW's first step is about lr x sign(g): where a gradient is within its rounding of 0 the two
    # orders of summation can step either way (1.4e-4 apart on an AMD EPYC without AVX-512), so
    # the weights are compared where the gradient is clear of it (there 6e-7 apart on that CPU)
    reference = dict(plain.model.named_parameters())
    for (n, p), g in zip(paced.model.named_parameters(), stepped["plain"]):
        clear = g.abs() > 1e-4 * g.abs().max()
        assert torch.allclose(p[clear], reference[n][clear], atol=1e-5), n
    assert not all(torch.allclose(p, start[n]) for n, p in paced.model.named_parameters())
    paced.train_step(make_batch(seed=5, version=2), current_version=2)  # held again: gradients kept
    assert paced.held == 1
    assert paced.load_checkpoint(paced.save_checkpoint(str(tmp_path))) == 3
    assert paced.held == 0 and all(p.grad is None for p in paced.model.parameters())


def test_a_paced_trainer_counts_its_lag_in_weight_updates_not_held_versions():
    """Under trainer.pace a held step moves the version and not the weights: a token's lag (the
    trust regions of clip_against=versions, the staleness metrics, the fresh/previous drift
    metrics) counts the updates since it was sampled, for every pace (against a count by hand)."""
    from meshrl.config import PaceConfig
    from meshrl.episode import weight_lags

    for every, steps, offset in [(1, 1, 0), (2, 1, 1), (4, 1, 0), (5, 2, 3), (3, 3, 2)]:
        pace = PaceConfig(every=every, steps=steps, offset=offset)
        for version in range(12):
            versions = torch.arange(version + 2)  # one past `version`: never negative
            want = [sum(pace.updates(s) for s in range(v + 1, version + 1)) for v in versions.tolist()]
            assert weight_lags(versions, version, pace).tolist() == want, (every, steps, offset, version)
            # the newest update at or before it: where an accumulating trainer's heal restores
            assert pace.last_update(version) == max([s for s in range(1, version + 1) if pace.updates(s)], default=0)
    # every 2 from step 2 (steps 2, 4, ... update): at version 2 a token of version 0 is one update behind, not two
    batch = make_batch(seed=6, version=1)
    assert set(batch["versions"][batch["loss_mask"]].tolist()) == {0, 1}
    paced, plain = PolicyTrainer(make_config(pace={"every": 2, "offset": 1}), CPU), PolicyTrainer(make_config(), CPU)
    paced.step = plain.step = 2
    assert paced.train_step(batch, current_version=2)["staleness_max"] == 1.0
    assert plain.train_step(batch, current_version=2)["staleness_max"] == 2.0


def test_bf16_compute_on_cpu_tracks_float32_and_keeps_float32_state():
    batch = make_batch(version=1)
    fp32 = PolicyTrainer(make_config(), CPU)
    bf16 = PolicyTrainer(make_config(compute_dtype="bfloat16"), CPU)
    assert fp32.compute_dtype == torch.float32 and bf16.compute_dtype == torch.bfloat16
    # matmuls run bf16; attention and RMSNorm run float32 (compat: slow bf16 CPU kernels), and
    # the LM head's logits are float32 (meshrl/trainer/head.py)
    from torchtitan.models.common.attention import ScaledDotProductAttention

    seen: dict[str, set] = {}
    for module in bf16.model.modules():  # meshrl's attention is TorchTitan's SDPA that also takes packed rows
        kind = "ScaledDotProductAttention" if isinstance(module, ScaledDotProductAttention) else type(module).__name__
        kind = "LM head" if module is bf16.model.lm_head else kind
        if kind in ("ScaledDotProductAttention", "RMSNorm", "Linear", "LM head"):
            module.register_forward_hook(lambda m, args, out, kind=kind: seen.setdefault(kind, set()).add(out.dtype))
    _, lp32 = fp32.compute_logprobs(batch)
    _, lp16 = bf16.compute_logprobs(batch)
    assert seen == {"ScaledDotProductAttention": {torch.float32}, "RMSNorm": {torch.float32}, "Linear": {torch.bfloat16}, "LM head": {torch.float32}}
    assert lp16.dtype == torch.float32
    mask = lp32 != 0
    assert 0 < (lp16 - lp32)[mask].abs().max() < 0.1  # bf16 matmuls: close, not equal
    a, b = fp32.train_step(batch, current_version=1), bf16.train_step(batch, current_version=1)
    assert abs(a["loss"] - b["loss"]) < 0.05 and abs(a["grad_norm"] - b["grad_norm"]) < 0.05 * a["grad_norm"]
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights
    with pytest.raises(ConfigError, match="trainer.compute_dtype"):
        make_config(compute_dtype="float16")


def test_compiled_code_is_cached_in_a_directory_of_the_users_own(tmp_path, monkeypatch):
    """Inductor's default cache, /tmp/torchinductor_$USER, can be made first and filled by any
    local user, and the trainer imports the code it finds there."""
    import stat

    from meshrl.trainer.parallelize import _before_compiling

    monkeypatch.setattr(torch._dynamo.config, "assume_static_by_default", torch._dynamo.config.assume_static_by_default)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # (so that monkeypatch puts back what was there)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    _before_compiling()
    path = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert path == str(tmp_path / ".cache" / "meshrl" / "torchinductor") and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's choice stands
    _before_compiling()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


@pytest.mark.slow  # about 17 s on 2 cores: the blocks compile
def test_compiled_blocks_train_like_eager_without_recompiling_per_batch_shape(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch._dynamo.config, "assume_static_by_default", True)  # put back afterwards
    shape = {"batch_groups": 4, "generator": {"group_size": 4, "max_new_tokens": 16}}
    eager = PolicyTrainer(Config.from_dict({"model": {"family": "qwen3"}, **shape, "trainer": {"micro_batch_size": 16}}), CPU)
    compiled = PolicyTrainer(Config.from_dict({"model": {"family": "qwen3"}, **shape, "trainer": {"micro_batch_size": 16, "compile": True}}), CPU)
    before = sum(counters["stats"].values())
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    assert sum(counters["stats"].values()) > before  # the blocks compiled in the warm-up, not in a step
    for seed in range(3):  # ragged prompt and response lengths, 3 or 4 groups: a new shape each step
        batch = make_batch(groups=4 - seed % 2, seed=seed, version=seed)
        a, b = eager.train_step(batch, current_version=seed), compiled.train_step(batch, current_version=seed)
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
    assert counters["stats"]["unique_graphs"] == graphs, "a new batch shape recompiled the blocks"
    assert [n for n, _ in eager.model.named_parameters()] == [n for n, _ in compiled.model.named_parameters()]
    for p, q in zip(eager.model.parameters(), compiled.model.parameters()):  # Adam moves each by ~lr (5e-3) a step
        torch.testing.assert_close(p, q, atol=1e-3, rtol=0)
    exported = dict(compiled.hf_state_dict())
    assert exported.keys() == dict(eager.hf_state_dict()).keys()


def test_a_heal_restores_no_snapshot_newer_than_the_controllers_version(tmp_path):
    """A trainer that wrote step 3's snapshot and died before its step returned is one ahead of
    the controller (version 2): the heal restores step 2 and trains step 3 again, so that its
    row and groups are not lost (controller/heal.py)."""

    from meshrl.controller.heal import newest_state
    from meshrl.trainer.snapshot import newest_complete, snapshot_root

    root = snapshot_root(str(tmp_path))
    for step in (2, 3):
        os.makedirs(os.path.join(root, f"step-{step:08d}"))
        with open(os.path.join(root, f"step-{step:08d}", ckpt.COMPLETE_MARKER), "w") as f:
            json.dump({"step": step}, f)
    os.makedirs(os.path.join(root, "step-00000004"))  # a write cut short: no marker
    assert newest_complete(root).endswith("step-00000003")
    assert newest_complete(root, at_most=2).endswith("step-00000002")
    assert newest_state(str(tmp_path), at_most=2) == (os.path.join(root, "step-00000002"), 2)
    assert newest_state(str(tmp_path), at_most=1) == (None, 0)


def test_a_resume_points_every_trained_states_latest_at_the_checkpoint_it_restores(tmp_path):
    """A save cut short (an interrupt's deadline, a model's save failing after the policy's)
    can leave a trained state's `latest` at a step past the loop state's. The resume points
    each back at what it restored (checkpoint.repoint), so a later heal restores that state,
    not the abandoned run's step, nor finds none."""

    from meshrl.controller.checkpoint import repoint
    from meshrl.controller.heal import newest_state
    from meshrl.trainer import checkpoint as ckpt

    roots = {name: tmp_path / "checkpoints" / name for name in ("trainer", "critic", "models/a", "models/a-critic")}
    for root in roots.values():
        for step in (10, 12):
            (root / f"step-{step:08d}").mkdir(parents=True)
            (root / f"step-{step:08d}" / ckpt.COMPLETE_MARKER).write_text(json.dumps({"step": step}))
        (root / "latest").write_text("step-00000012")  # the cut-short save's
    at = {name: str(root / "step-00000010") for name, root in roots.items()}
    assert newest_state(str(tmp_path), at_most=11) == (None, 0)  # a heal at the resumed run's step 11 found nothing
    state = {"trainer_dir": at["trainer"], "critic_dir": at["critic"], "models": {"a": at["models/a"]}, "model_critics": {"a": at["models/a-critic"]}}
    repoint(state, str(tmp_path / "elsewhere"))  # a loop state naming another run's checkpoints: theirs are left alone
    assert all(ckpt.checkpoint_step(root) == 12 for root in roots.values())
    repoint(state, str(tmp_path))
    assert all(ckpt.checkpoint_step(root) == 10 for root in roots.values())
    assert newest_state(str(tmp_path), at_most=11) == (str(roots["trainer"]), 10)
    # an earlier start's snapshot at the same step (its ranks' layout, maybe not this run's): the checkpoint
    snap = tmp_path / "snapshots" / "step-00000010"
    snap.mkdir(parents=True)
    (snap / ckpt.COMPLETE_MARKER).write_text(json.dumps({"step": 10}))
    assert newest_state(str(tmp_path), at_most=11) == (str(roots["trainer"]), 10)


def test_checkpoint_root_ignores_an_interrupted_save(tmp_path):
    trainer = PolicyTrainer(make_config(), CPU)
    trainer.train_step(make_batch())
    good = trainer.save_checkpoint(str(tmp_path))
    # a crash mid-save leaves a temp dir behind: `latest` still names the good one
    os.makedirs(tmp_path / ".step-00000002.tmp")
    (tmp_path / ".step-00000002.tmp" / "garbage").write_text("x")
    assert ckpt.resolve_checkpoint(tmp_path) == good
    os.makedirs(tmp_path / "step-00000003")
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_checkpoint(tmp_path / "step-00000003")


def test_snapshots_and_checkpoints_keep_the_random_generators(tmp_path):
    """A restored trainer draws what the saved one would have drawn next (a LoRA adapter's
    dropout): the snapshot (a CPU rank's own file) and the DCP checkpoint both keep the
    generators as the step left them."""
    from meshrl.trainer.snapshot import Snapshots, load_snapshot, snapshot_root

    trainer = PolicyTrainer(make_config(), CPU)
    trainer.train_step(make_batch())
    torch.manual_seed(1234)
    torch.rand(5)  # a step's draws move the generator on
    snaps = Snapshots(snapshot_root(str(tmp_path)), 1, blocking=True)
    snaps.start(1, trainer.model, trainer.optimizer, trainer.scheduler)
    path = snaps.finish()
    checkpoint = trainer.save_checkpoint(str(tmp_path / "ckpt"))
    expected = torch.rand(8)  # what the trainer draws next
    for restore in (lambda t: load_snapshot(path, t.model, t.optimizer, t.scheduler), lambda t: t.load_checkpoint(checkpoint)):
        torch.manual_seed(0)  # a new trainer proc starts seeded
        fresh = PolicyTrainer(make_config(), CPU)
        restore(fresh)
        assert torch.equal(torch.rand(8), expected)


def test_snapshots_overwrite_their_slots_in_place_and_restore_exactly(tmp_path):
    """A CPU rank's snapshot copies its state into the oldest kept slot's file, in place (two
    files for any number of steps, never the newest complete one), and restores the exact
    weights, AdamW state and lr schedule; what is restored owns its memory: later writes into
    the file it came from leave it as restored."""
    from meshrl.trainer.snapshot import Snapshots, load_snapshot

    def state(t):
        optim = [(k, n, v.clone()) for k, st in t.optimizer.state_dict()["state"].items() for n, v in st.items()]
        return [(n, p.detach().clone()) for n, p in t.model.state_dict().items()] + optim, t.scheduler.state_dict()

    def same(a, b):
        return a[1] == b[1] and len(a[0]) == len(b[0]) and all(x[:-1] == y[:-1] and torch.equal(x[-1], y[-1]) for x, y in zip(a[0], b[0]))

    trainer = PolicyTrainer(make_config(), CPU)
    root = tmp_path / "snapshots"
    snaps = Snapshots(str(root), 1, blocking=True)
    files = set()
    for step in range(1, 6):
        trainer.train_step(make_batch(seed=step))
        snaps.start(step, trainer.model, trainer.optimizer, trainer.scheduler)
        files.add(os.stat(os.path.join(snaps.finish(), "rank-0.bin")).st_ino)
    saved = state(trainer)
    assert sorted(os.listdir(root)) == ["latest", "step-00000004", "step-00000005"] and len(files) == 2
    fresh = PolicyTrainer(make_config(), CPU)
    assert not same(state(fresh), saved)
    assert load_snapshot(str(root / "step-00000005"), fresh.model, fresh.optimizer, fresh.scheduler) == 5
    assert same(state(fresh), saved) and len(saved[0]) > len(dict(fresh.model.state_dict()))  # AdamW's moments too
    for step in (6, 7):  # both files rewritten, the one restored from included
        trainer.train_step(make_batch(seed=step))
        snaps.start(step, trainer.model, trainer.optimizer, trainer.scheduler)
        snaps.finish()
    assert sorted(os.listdir(root)) == ["latest", "step-00000006", "step-00000007"]
    assert same(state(fresh), saved) and not same(state(trainer), saved)


def test_snapshots_are_spaced_out_when_their_writes_outgrow_the_budget(tmp_path):
    """`trainer.snapshot_budget`: a write that costs more than the budget's share of the step
    spaces the next snapshots out (at most MAX_SPACING apart); a budget of 0 keeps every
    step's. The spacing follows the measured write and period, whatever the machine's speed."""
    import math
    import time

    from meshrl.trainer.snapshot import MAX_SPACING, Snapshots

    trainer = PolicyTrainer(make_config(), CPU)
    trainer.train_step(make_batch())

    def written(snaps, steps, pause_s=0.01):
        out = []
        for step in range(1, steps + 1):
            time.sleep(pause_s)  # the step's period
            if snaps.due(step):
                snaps.start(step, trainer.model, trainer.optimizer, trainer.scheduler)
                snaps.finish()
                out.append(step)
        return out

    # step 1's write has no period to compare with; step 2's is far past a millionth of it
    tight = Snapshots(str(tmp_path / "tight"), 1, blocking=True, budget=1e-6)
    assert written(tight, 25) == [1, 2, 12, 22] and tight.spacing == MAX_SPACING
    assert written(Snapshots(str(tmp_path / "off"), 1, blocking=True, budget=0.0), 6) == [1, 2, 3, 4, 5, 6]
    assert written(Snapshots(str(tmp_path / "every2"), 2, blocking=True, budget=0.0), 6) == [2, 4, 6]
    mid = Snapshots(str(tmp_path / "mid"), 1, blocking=True, budget=0.05)
    written(mid, 2, pause_s=0.05)  # the spacing comes from step 2's write and period
    assert mid.write_s > 0 and mid.period_s > 0
    assert mid.spacing == min(MAX_SPACING, max(1, math.ceil(mid.write_s / (0.05 * mid.period_s))))


# ---- real Monarch meshes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def dense_mesh(loop):
    mesh = run(loop, spawn_inspectable(make_config(procs=2)))
    try:
        yield mesh
    finally:
        run(loop, mesh.stop(), 120)


@pytest.mark.slow
def test_fsdp2_mesh_matches_single_process(loop, dense_mesh, tmp_path):
    info = run(loop, dense_mesh.shard_info())
    assert [i["local_params"] * 2 for i in info] == [info[0]["full_params"]] * 2  # each rank holds half
    reference = PolicyTrainer(make_config(procs=1), CPU)
    for step in range(2):
        batch = make_batch(seed=step, version=step)
        got, want = run(loop, dense_mesh.train_step(batch)), reference.train_step(batch)
        assert got["version"] == want["version"] == step + 1
        for key in ("loss", "grad_norm", "tokens", "mismatch", "is_weight_mean", "staleness_mean"):
            assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got[key], want[key])
    # scoring on the mesh equals scoring in one process
    batch = make_batch(seed=7)
    got = run(loop, dense_mesh.compute_logprobs(batch))
    ref_rows, ref = reference.compute_logprobs(batch)
    torch.testing.assert_close(got[ref_rows], ref, atol=1e-5, rtol=1e-5)
    assert (got[batch["loss_mask"]] < 0).all() and (got[~batch["loss_mask"]] == 0).all()


@pytest.mark.slow
def test_sharded_export_matches_transformers(loop, dense_mesh, tmp_path):
    from transformers import AutoModelForCausalLM

    out = run(loop, dense_mesh.export_hf(str(tmp_path / "hf")))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = make_batch(seed=11, turns=2)
    with torch.no_grad():
        lp, _ = token_logprobs_from_hf(hf, batch)
    mesh_lp = run(loop, dense_mesh.compute_logprobs(batch))
    expected = lp * batch["loss_mask"]
    torch.testing.assert_close(mesh_lp * batch["loss_mask"], expected, atol=1e-4, rtol=1e-4)
    sd = run(loop, dense_mesh.hf_state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in sd and sd["model.embed_tokens.weight"].shape == (128, 64)


def token_logprobs_from_hf(hf, packed):
    logits = hf(packed["tokens"]).logits.float()
    logp = F.log_softmax(logits[:, :-1], -1).gather(-1, packed["tokens"][:, 1:, None]).squeeze(-1)
    out = torch.zeros(packed["tokens"].shape)
    out[:, 1:] = logp
    return out, None


@pytest.mark.slow
def test_dcp_checkpoint_restores_bit_identical_state(loop, dense_mesh, tmp_path):
    run(loop, dense_mesh.train_step(make_batch(seed=3)))
    path = run(loop, dense_mesh.save_checkpoint(str(tmp_path)))
    saved_version = dense_mesh.version
    params = run(loop, dense_mesh._all(dense_mesh.actors.get_params))  # per rank: local shards
    optim = run(loop, dense_mesh._all(dense_mesh.actors.get_optimizer_state))
    run(loop, dense_mesh.train_step(make_batch(seed=4)))  # move away from the saved state
    moved = run(loop, dense_mesh._all(dense_mesh.actors.get_params))
    assert any(not torch.equal(moved[0][k], params[0][k]) for k in params[0])
    assert run(loop, dense_mesh.load_checkpoint(str(tmp_path))) == saved_version
    assert open(tmp_path / "latest").read() == os.path.basename(path)
    restored = run(loop, dense_mesh._all(dense_mesh.actors.get_params))
    restored_optim = run(loop, dense_mesh._all(dense_mesh.actors.get_optimizer_state))
    for rank in range(2):
        assert params[rank].keys() == restored[rank].keys()
        for k in params[rank]:
            assert torch.equal(params[rank][k], restored[rank][k]), k
        for pid, state in optim[rank].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(restored_optim[rank][pid][name])), (pid, name)


@pytest.mark.slow
def test_moe_trains_with_experts_split_across_ranks(loop):
    cfg = make_config("qwen3_moe", procs=2, ep=2)
    mesh = run(loop, spawn_trainer(cfg))  # production actor: train_step and shard_info are its own
    try:
        info = run(loop, mesh.shard_info())
        assert [i["local_experts"] for i in info] == [2, 2] and info[0]["num_experts"] == 4
        reference = PolicyTrainer(make_config("qwen3_moe", procs=1), CPU)
        for step in range(2):
            batch = make_batch(seed=step, version=step)
            got, want = run(loop, mesh.train_step(batch)), reference.train_step(batch)
            assert got["version"] == step + 1 and got["tokens"] == want["tokens"]
            assert abs(got["loss"] - want["loss"]) < 1e-4 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-4
    finally:
        run(loop, mesh.stop(), 120)


def test_the_trainer_widens_the_clip_by_each_token_s_lag():
    """`clip_against: versions` (the default): the trainer hands the loss each token's lag, its
    version minus the token's. Every token sampled at 1.5x less than the trainer's policy gives
    R = 1.5: clipped where its advantage is positive when on-policy (past 1.28), not one version
    stale (1.28^2 = 1.64); `sampler` clips it at any lag. The learning rate is near 0 so that
    the same R holds at each step."""
    config = make_config(lr=1e-12)
    trainer = PolicyTrainer(config, CPU)
    batch = make_batch(seed=3, version=0)
    batch["versions"] = torch.where(batch["loss_mask"], 0, batch["versions"])  # every model token sampled by version 0
    _, lp = trainer.compute_logprobs(batch)
    batch["sampler_logprobs"] = torch.where(batch["loss_mask"], lp - math.log(1.5), 0.0)
    positive = float(((batch["advantage"][:, None] > 0) & batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    assert 0 < positive < 1
    on_policy, one_stale = (trainer.train_step(batch, current_version=v)["clip_frac"] for v in (0, 1))
    assert on_policy == pytest.approx(positive, abs=1e-6) and one_stale == 0.0
    config.trainer.loss.clip_against = "sampler"
    assert trainer.train_step(batch, current_version=1)["clip_frac"] == pytest.approx(positive, abs=1e-6)


def test_kl_reference_and_entropy_bonus_paths():
    config = make_config()
    config.trainer.loss.kl_coef, config.trainer.loss.entropy_coef, config.trainer.loss.correction = 0.1, 0.01, "decoupled"
    trainer = PolicyTrainer(config, CPU)
    first = trainer.train_step(make_batch(seed=1))
    assert first["kl"] == 0.0 and first["entropy"] > 0  # the reference starts equal to the policy
    second = trainer.train_step(make_batch(seed=1))
    assert second["kl"] > 0 and second["version"] == 2  # the policy moved, the reference did not


def test_stale_batches_are_clipped_against_the_sampler():
    """Issue 34: async training steps on batches sampled by older versions. With one optimizer
    step per batch the ratio to the trainer's own policy is 1, so a clip on it never acted:
    clip_frac read 0.0 on every step while stale batches kept pushing tokens the versions
    since their sampling already pushed, until the policy fell off a cliff. Trained again
    and again on what version 0 sampled, the policy must soon hit the clip (measured from
    the sampler's log-probs), and the drift metrics must see how far it went."""
    config = make_config(lr=0.05)
    config.trainer.loss.clip_against = "sampler"  # one region for the whole lag: the clip is sure to act
    trainer = PolicyTrainer(config, CPU)
    batch = make_batch(seed=3, version=0)
    rows, lp = trainer.compute_logprobs(batch)
    batch["sampler_logprobs"] = torch.where(batch["loss_mask"], lp, 0.0)  # sampled by version 0 itself
    outs = [trainer.train_step(batch, current_version=v) for v in range(4)]
    first, second, last = outs[0], outs[1], outs[-1]
    assert first["clip_frac"] == 0.0 and first["mismatch_fresh"] < 1e-5  # on-policy: nothing to clip, no gap
    assert "kl_prev_version" not in first
    assert second["kl_prev_version"] > 0 and "mismatch_fresh" not in second  # every token is one version old
    assert second["kl_prev_version"] == pytest.approx(second["kl_sampler"])
    assert last["clip_frac"] > 0  # 0.0 when the clip measured pi_theta against itself
    assert last["kl_sampler"] > second["kl_sampler"]
    assert last["is_ratio_p1"] <= last["is_ratio_p50"] <= last["is_ratio_p99"]
    assert all(o["entropy"] > 0 for o in outs)
    assert 0.0 <= first["zero_variance_groups"] <= 1.0


def test_a_checkpoint_before_the_first_step_changes_no_step(tmp_path):
    """A checkpoint at version 0 (`Session.checkpoint()` before training) holds no optimizer
    state: torch would make AdamW one by a step of lr 0, on the live optimizer too, and the
    first real step would be taken as AdamW's second (0.74 of its size). The trainer that
    saved, and one restored from its save, each take the step a fresh trainer takes."""

    def stepped(trainer):
        trainer.train_step(make_batch())
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    torch.manual_seed(0)
    expected = stepped(PolicyTrainer(make_config(), CPU))
    torch.manual_seed(0)
    saver = PolicyTrainer(make_config(), CPU)
    path = saver.save_checkpoint(str(tmp_path))
    assert not saver.optimizer.state
    torch.manual_seed(0)
    restored = PolicyTrainer(make_config(), CPU)
    stepped(restored)  # a trained optimizer, then the version-0 state restored over it
    restored.load_checkpoint(path)
    assert not restored.optimizer.state
    for trainer in (saver, restored):
        got = stepped(trainer)
        for name, t in expected.items():
            assert torch.equal(got[name], t), name


def test_a_resume_takes_the_configured_lr_at_the_saved_warm_up_position(tmp_path):
    """`--resume RUN trainer.lr=B` over a checkpoint saved at lr A: the optimizer's rate is
    B times the warm-up factor the checkpoint reached (not A's rate), now and after the
    next step; a resume at A restores the saved rate bit for bit; a resume's weight decay
    is the configured one, not the checkpoint's."""
    a, b, warmup = 1e-2, 3e-3, 4
    saver = PolicyTrainer(make_config(lr=a, warmup_steps=warmup), CPU)
    saver.train_step(make_batch())
    path = saver.save_checkpoint(str(tmp_path))
    same = PolicyTrainer(make_config(lr=a, warmup_steps=warmup), CPU)
    same.load_checkpoint(path)
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in saver.optimizer.param_groups]
    assert same.scheduler.state_dict() == saver.scheduler.state_dict()
    resumed = PolicyTrainer(make_config(lr=b, warmup_steps=warmup), CPU)
    resumed.load_checkpoint(path)
    assert resumed.scheduler.last_epoch == 1 and resumed.scheduler.base_lrs == [b]
    assert [g["lr"] for g in resumed.optimizer.param_groups] == pytest.approx([b * 2 / warmup])  # warm-up step 1: factor 2/4
    assert resumed.scheduler.get_last_lr() == pytest.approx([b * 2 / warmup])
    out = resumed.train_step(make_batch(seed=1))  # the next step's rate: B, one warm-up step on
    assert out["lr"] == pytest.approx(b * 3 / warmup) and resumed.optimizer.param_groups[0]["lr"] == pytest.approx(b * 3 / warmup)
    decayed = PolicyTrainer(make_config(lr=a, warmup_steps=warmup, weight_decay=0.1), CPU)  # `trainer.weight_decay=0.1` too
    decayed.load_checkpoint(path)
    assert [g["weight_decay"] for g in decayed.optimizer.param_groups] == [0.1]
    # a heal from a CPU rank's snapshot slot, after a live change to B (Session.set): B as well
    from meshrl.trainer.snapshot import Snapshots, load_snapshot

    snaps = Snapshots(str(tmp_path / "snapshots"), 1, blocking=True)
    snaps.start(1, saver.model, saver.optimizer, saver.scheduler)
    healed = PolicyTrainer(make_config(lr=b, warmup_steps=warmup), CPU)
    assert load_snapshot(snaps.finish(), healed.model, healed.optimizer, healed.scheduler) == 1
    assert [g["lr"] for g in healed.optimizer.param_groups] == pytest.approx([b * 2 / warmup]) and healed.scheduler.base_lrs == [b]
