"""Long rows in the trainer: token-budget micro-batches (packed rows, no padding) and
TorchTitan's activation checkpointing, each against the padded, uncheckpointed step.

A packed step must give the padded step's loss and gradients to float tolerance for every
loss variant, multi-turn rows with env tokens masked, LoRA, MoE with routing replay,
distillation's per-token advantages and the KL/entropy terms.
"""

from __future__ import annotations

import os

import pytest
import torch

from meshrl.config import Config, ConfigError
from meshrl.trainer.losses import CORRECTIONS
from meshrl.trainer.packing import pack, rank_rows_by_tokens, row_lengths, token_micro_batches, unpack
from meshrl.trainer.packing import micro_batch_plans
from meshrl.trainer.policy import PolicyTrainer
from tests.test_trainer import CPU, make_batch

BUDGET = 96  # tokens: a few of make_batch's rows (8 to 40 tokens) per micro-batch


def config(model: dict | None = None, lora: dict | None = None, **trainer) -> Config:
    trainer = {"micro_batch_size": 3, **trainer}
    return Config.from_dict({"model": {"max_seq_len": BUDGET, **(model or {})}, "lora": lora or {}, "trainer": trainer})


def step(cfg: Config, batch, version: int = 1) -> tuple[dict, dict[str, torch.Tensor]]:
    """One train_step from the seeded initial weights: its metrics and every parameter's gradient."""
    trainer = PolicyTrainer(cfg, CPU)
    out = trainer.train_step(batch.clone(), current_version=version)
    unwrapped = lambda n: n.replace("_checkpoint_wrapped_module.", "")  # activation checkpointing's wrapper level
    return out, {unwrapped(n): p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same_step(padded: Config, packed: Config, batch, grad_tol: float = 1e-3) -> dict:
    """Same loss, token count and gradient norm; every gradient equal to within `grad_tol` of
    its largest element (float32 sums taken in another order)."""
    a, ga = step(padded, batch)
    b, gb = step(packed, batch)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["tokens"] == a["tokens"] and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        worst = float((gb[name] - ga[name]).abs().max())
        assert worst <= grad_tol * float(ga[name].abs().max()) + 1e-9, (name, worst, float(ga[name].abs().max()))
    return b


# ---- the pieces ------------------------------------------------------------------------------
def test_rows_pack_back_to_back_and_come_back_in_place():
    batch = make_batch(turns=2)
    lengths = row_lengths(batch)
    assert lengths.min() > 0 and lengths.max() == batch["tokens"].shape[1]
    flat, positions, real = pack(batch["tokens"], lengths)
    assert flat.shape == (1, int(lengths.sum())) and real.sum() == lengths.sum()
    assert (positions[0] == 0).sum() == len(lengths)  # each row restarts at position 0
    assert torch.equal(torch.where(real, unpack(flat[..., None].float(), real)[..., 0].long(), 0), torch.where(real, batch["tokens"], 0))


def test_token_micro_batches_hold_the_budget_and_never_cut_a_row():
    lengths = torch.tensor([5, 30, 20, 50, 8, 40])
    plan = token_micro_batches(list(range(6)), lengths, 50)
    assert plan == [[0, 1], [2], [3], [4, 5]]
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    assert token_micro_batches([0, 1], torch.tensor([70, 3]), 50) == [[0], [1]]  # too long: alone, whole


def test_documents_of_like_length_attend_together_within_the_padding_bound():
    from meshrl.trainer.attention import PAD_SLACK, length_buckets

    sizes = [5, 30, 20, 50, 8, 40, 31, 29, 3000]
    buckets = length_buckets(sizes)
    assert sorted(d for b in buckets for d in b) == list(range(len(sizes)))
    assert [8] in buckets  # a long document is padded to no one's length
    for b in buckets:
        assert len(b) * max(sizes[d] for d in b) ** 2 <= PAD_SLACK * sum(sizes[d] ** 2 for d in b)


def test_ranks_get_whole_groups_balanced_by_tokens_and_run_as_many_micro_batches():
    batch = make_batch(groups=5, seed=3)
    shares = [rank_rows_by_tokens(batch, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(len(batch)))
    groups = batch["group_id"]
    assert not set(groups[shares[0]].tolist()) & set(groups[shares[1]].tolist())  # whole groups
    lengths = row_lengths(batch)
    load = [int(lengths[s].sum()) for s in shares]
    biggest = max(int(lengths[groups == g].sum()) for g in groups.unique())
    assert abs(load[0] - load[1]) <= biggest
    plans = micro_batch_plans(batch, 2, 3, 40)
    assert len(plans[0]) == len(plans[1])  # the collectives stay in step
    assert all(int(lengths[mb].sum()) <= 40 for plan in plans for mb in plan if len(mb) > 1)


def test_config_refuses_a_budget_below_the_longest_row_and_memory_budget_without_compile():
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens") as info:
        Config.from_dict({"model": {"max_seq_len": 256}, "trainer": {"micro_batch_tokens": 100}})
    assert "at least 256" in str(info.value)
    with pytest.raises(ConfigError, match="trainer.activation_checkpoint"):
        Config.from_dict({"trainer": {"activation_checkpoint": "memory_budget"}})
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens"):  # measured: a 15-20 s recompile per new row layout
        Config.from_dict({"trainer": {"compile": True, "micro_batch_tokens": 256}})


# ---- packed == padded ------------------------------------------------------------------------
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_packed_step_equals_the_padded_step_for_every_correction(correction):
    batch = make_batch(turns=2, version=2)  # multi-turn: env tokens inside rows are masked out of the loss
    loss = {"correction": correction}
    out = assert_same_step(config(loss=loss), config(loss=loss, micro_batch_tokens=BUDGET), batch)
    assert out["tokens"] == int(batch["loss_mask"].sum())


@pytest.mark.parametrize(
    "loss",
    [
        {"kl_coef": 0.1, "entropy_coef": 0.01, "correction": "decoupled"},  # a reference model, entropy
        {"aggregation": "seq_mean_token_mean", "clip_against": "proximal"},
        {"advantage": "rloo", "aggregation": "seq_mean_token_sum"},
    ],
)
def test_packed_step_equals_the_padded_step_for_loss_variants(loss):
    batch = make_batch(turns=2, seed=5)
    assert_same_step(config(loss=loss), config(loss=loss, micro_batch_tokens=BUDGET), batch)


def test_packed_step_equals_the_padded_step_with_lora():
    batch = make_batch(turns=2, seed=1)
    lora = {"rank": 4, "alpha": 8}
    out = assert_same_step(config(lora=lora), config(lora=lora, micro_batch_tokens=BUDGET), batch)
    assert out["grad_norm"] > 0


def moe_batch_with_routing(model: dict):
    """make_batch with the sampler's experts: 2 distinct experts a model token, every layer."""
    batch = make_batch(seed=2)
    n_layers = Config.from_dict({"model": model}).model.n_layers
    B, T = batch["tokens"].shape
    g = torch.Generator().manual_seed(0)
    experts = torch.rand(B, T, n_layers, 4, generator=g).argsort(-1)[..., :2].int()
    batch["routed_experts"] = torch.where(batch["loss_mask"][..., None, None], experts, -1)
    return batch


def test_checkpointed_moe_blocks_replay_the_routing_in_their_recomputation_too():
    """Backward recomputes a checkpointed block's routers after the forward has returned: the
    replay must still be on then (else TorchTitan's checkpoint sees other experts and fails)."""
    model = {"family": "qwen3_moe", "num_experts": 4, "experts_top_k": 2}
    cfg = dict(model=model, loss={"routing_replay": True})
    out = assert_same_step(config(**cfg), config(**cfg, activation_checkpoint="full", micro_batch_tokens=BUDGET), moe_batch_with_routing(model), grad_tol=1e-2)
    assert out["routing_replay_changed_frac"] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_packed_step_equals_the_padded_step_on_moe_with_routing_replay(family):
    model = {"family": family, "num_experts": 4, "experts_top_k": 2}
    batch = moe_batch_with_routing(model)
    cfg = dict(model=model, loss={"routing_replay": True})
    # TorchTitan's grouped expert matmuls sum in another order when the rows move: about 3e-3
    # of the largest expert gradient, measured, with or without replay
    out = assert_same_step(config(**cfg), config(**cfg, micro_batch_tokens=BUDGET), batch, grad_tol=1e-2)
    assert out["routing_replay_changed_frac"] > 0  # the replay did act


def test_packed_step_equals_the_padded_step_on_distillation_advantages():
    batch = make_batch(turns=2, version=1, seed=4)
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(0)
    batch["teacher_logprobs"] = torch.where(mask, batch["sampler_logprobs"] + 0.5 * torch.randn(mask.shape, generator=g), 0.0)
    batch["token_advantage"] = torch.where(mask, 0.7 * (batch["teacher_logprobs"] - batch["sampler_logprobs"]) + batch["advantage"][:, None], 0.0)
    out = assert_same_step(config(), config(micro_batch_tokens=BUDGET), batch)
    assert "distill_reverse_kl" in out


def test_packed_scoring_equals_padded_with_the_samplers_truncation():
    batch = make_batch(turns=2, seed=6)

    def scored(**trainer):
        cfg = Config.from_dict({"model": {"max_seq_len": BUDGET}, "generator": {"top_k": 20, "top_p": 0.9}, "trainer": trainer})
        return PolicyTrainer(cfg, CPU).compute_logprobs(batch)

    rows_a, lp_a = scored(micro_batch_size=3)
    rows_b, lp_b = scored(micro_batch_tokens=BUDGET)
    order = [rows_b.index(r) for r in rows_a]
    torch.testing.assert_close(lp_b[order][:, : lp_a.shape[1]], lp_a, rtol=1e-5, atol=1e-5)


# ---- activation checkpointing ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_step_and_the_weights_names(mode):
    batch = make_batch(turns=2, seed=7)
    out = assert_same_step(config(), config(activation_checkpoint=mode, micro_batch_tokens=BUDGET), batch)
    assert out["grad_norm"] > 0
    lora = {"rank": 4, "alpha": 8}
    trainer = PolicyTrainer(config(activation_checkpoint=mode, lora=lora), CPU)
    plain = PolicyTrainer(config(lora=lora), CPU)
    # export and weight sync (merged and adapter alone) see no wrapper
    assert [n for n, _ in trainer.hf_state_dict()] == [n for n, _ in plain.hf_state_dict()]
    assert [n for n, _ in trainer.adapter_state_dict()] == [n for n, _ in plain.adapter_state_dict()]


# ---- long rows end to end ------------------------------------------------------------------
LONG = 16_384


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_episodes_of_16k_tokens_train_on_the_real_loop(tmp_path):
    """Prompts of 16k tokens (the character tokenizer: one token a character) through the
    real loop: vLLM serves the whole context, the trainer runs each row packed under full
    activation checkpointing, within a token budget that holds one row."""
    import json
    import random

    import time

    import meshrl
    from tests.test_loop import SYNC, meshrl_children, tiny

    # procs an earlier test's module-scoped fixture still holds are that test's to stop
    before = {p.pid for p in meshrl_children()}

    rng = random.Random(0)
    rows = tmp_path / "long.jsonl"
    with open(rows, "w") as f:
        for _ in range(8):
            f.write(json.dumps({"prompt": "".join(rng.choice("abcdefgh ") for _ in range(LONG)) + ":", "answer": ""}) + "\n")
    # one group of 2 rows a step: every assertion below holds per row (two steps: the second
    # scores its 16k rows under weights the first step updated); more rows only cost time
    cfg = tiny(
        tmp_path / "run",
        steps=2,
        batch_groups=1,
        data={"source": str(rows)},
        scoring={"reward_fn": "meshrl.tasks:digits_reward"},
        model={"max_seq_len": LONG + 64},
        buffer=SYNC["buffer"],
        generator={**SYNC["generator"], "group_size": 2, "max_num_seqs": 4},
        trainer={"checkpoint_every": 0, "micro_batch_tokens": LONG + 64, "activation_checkpoint": "full"},
    )
    rows = [r for r in meshrl.run(cfg).metrics if "trainer/tokens" in r]
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(r["episode/failed"] == 0 for r in rows if "episode/failed" in r)
    assert all(r["trainer/tokens"] > 0 for r in rows)
    assert all(r["trainer/row_tokens_max"] > LONG and r["trainer/useful_token_frac"] == 1.0 for r in rows)
    # the trainer scored every token of the 16k context as vLLM did: on-policy, same log-probs
    assert rows[0]["trainer/logprob_mismatch"] < 2e-3, rows[0]["trainer/logprob_mismatch"]
    deadline = time.monotonic() + 60
    while (left := [p for p in meshrl_children() if p.pid not in before]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"procs outlived the run: {left}"


# ---- tensor parallel -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_mesh_matches_one_process(tmp_path):
    """trainer.tp=2 on a real Monarch mesh of 2 procs (gloo): TorchTitan's TP plan splits every
    layer's weights, both procs train the same rows, and the steps, the scores, the exported
    checkpoint and the weights weight sync publishes equal one process's, packed rows included."""
    import asyncio

    from tests.test_trainer import make_config, run, spawn_inspectable

    model = {"n_kv_heads": 2}

    def cfg(procs: int, tp: int) -> Config:
        return Config.from_dict(
            {
                **make_config(procs=procs).to_dict(),
                "model": {**make_config().to_dict()["model"], **model},
                "trainer": {**make_config(procs=procs).to_dict()["trainer"], "tp": tp, "micro_batch_tokens": 256},
            }
        )

    loop = asyncio.new_event_loop()
    mesh = run(loop, spawn_inspectable(cfg(2, 2)))
    try:
        info = run(loop, mesh.shard_info())
        assert all(i["local_params"] < i["full_params"] for i in info)  # the layers are split
        reference = PolicyTrainer(cfg(1, 1), CPU)
        for step in range(2):
            batch = make_batch(seed=step, version=step, turns=2)
            got, want = run(loop, mesh.train_step(batch)), reference.train_step(batch)
            assert got["version"] == want["version"] == step + 1 and got["tokens"] == want["tokens"]
            for key in ("loss", "grad_norm", "mismatch", "kl_sampler"):
                assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got[key], want[key])
        batch = make_batch(seed=7)
        torch.testing.assert_close(
            run(loop, mesh.compute_logprobs(batch))[batch["loss_mask"]], reference.compute_logprobs(batch)[1][batch["loss_mask"]], atol=1e-5, rtol=1e-5
        )
        # What weight sync gathers: whole tensors under HF names. Two AdamW steps (lr 5e-3) on
        # gradients equal to float noise differ by up to 2e-5 where a gradient is near 0.
        synced = run(loop, mesh.hf_state_dict())
        for name, tensor in reference.hf_state_dict():
            assert (synced[name] - tensor).abs().max() < 1e-4, (name, float((synced[name] - tensor).abs().max()))
        out = run(loop, mesh.export_hf(str(tmp_path / "hf")))
        assert os.path.isfile(os.path.join(out, "config.json"))
        # the DCP checkpoint of TP shards restores them exactly
        run(loop, mesh.save_checkpoint(str(tmp_path / "ckpt")))
        run(loop, mesh.train_step(make_batch(seed=9)))
        run(loop, mesh.load_checkpoint(str(tmp_path / "ckpt")))
        restored = run(loop, mesh.hf_state_dict())
        assert all(torch.equal(restored[k], synced[k]) for k in synced)
    finally:
        run(loop, mesh.stop(), 120)
        loop.close()


def test_tensor_parallel_config_checks():
    with pytest.raises(ConfigError, match="trainer.tp"):
        Config.from_dict({"trainer": {"procs": 2, "tp": 2}})  # n_kv_heads=1 cannot split over 2
    with pytest.raises(ConfigError, match="trainer.procs"):
        Config.from_dict({"model": {"n_kv_heads": 2}, "trainer": {"procs": 3, "tp": 2}})
    with pytest.raises(ConfigError, match="trainer.tp"):
        Config.from_dict({"model": {"family": "qwen3_moe", "n_kv_heads": 2}, "trainer": {"procs": 2, "tp": 2}})
    Config.from_dict({"model": {"n_kv_heads": 2}, "trainer": {"procs": 4, "tp": 2}})


# ---- context parallel ----------------------------------------------------------------------
# TorchTitan's CP turns SDPA into ring attention, which has CUDA kernels only: on CPU the
# DTensor dispatch fails ("aten._scaled_dot_product_flash_attention_for_cpu does not have a
# sharding strategy registered"), and meshrl refuses trainer.cp > 1 on a CPU trainer. The
# rest of the CP path (TorchTitan's mesh and FSDP over dp x cp, meshrl's head-tail sharding
# of rows, positions and targets, the gather of log-probs and its backward) runs here, with
# the ring replaced by a stand-in that computes the same attention: each proc gathers the
# group's keys, values and positions and attends its own queries to them causally.
_SHARD_POSITIONS: list[torch.Tensor] = []


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, rank, world):
        parts = [torch.empty_like(local) for _ in range(world)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.span = group, (rank * local.shape[1], (rank + 1) * local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):  # every proc's queries read the gathered keys: their gradients add up
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.span[0] : ctx.span[1]], None, None, None


def _gathered_attention(attention_modules, cp_mesh):
    group, rank, world = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    for module in attention_modules:

        def forward(q, k, v, *, scale=None, enable_gqa=False, is_causal=True, **_):
            positions = _SHARD_POSITIONS[-1]  # [B, L] this proc's
            every = [torch.empty_like(positions) for _ in range(world)]
            torch.distributed.all_gather(every, positions, group=group)
            keys, values = (_GatherKV.apply(t, group, rank, world) for t in (k, v))
            allowed = torch.cat(every, dim=1)[:, None, None, :] <= positions[:, None, :, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=allowed, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2)

        module.forward = forward


def _cp_rank(rank: int, steps: int):
    import torchtitan.models.qwen3.parallelize as qwen3_parallelize
    from meshrl.trainer import context_parallel

    qwen3_parallelize.apply_cp_to_forward = _gathered_attention
    shard = context_parallel.CPRows.__init__

    def recording(self, *args):
        shard(self, *args)
        _SHARD_POSITIONS.append(self.positions)

    context_parallel.CPRows.__init__ = recording
    trainer = PolicyTrainer(_cp_config(procs=2, cp=2), CPU, rank, 2)
    scores = trainer.compute_logprobs(make_batch(seed=7))[1].numpy()  # (before AdamW's steps, which magnify the sums' order)
    rows = [trainer.train_step(make_batch(seed=s, version=i, turns=2)) for i, s in enumerate(CP_SEEDS[:steps])]
    grads = {n: p.grad.full_tensor().numpy() for n, p in trainer.model.named_parameters()}
    return rows, grads if rank == 0 else None, scores


CP_SEEDS = (0, 2)
"""make_batch's seeds the CP test trains on: its longest rows are 30 and 31 tokens, which cp=2
pads to 32, past model.max_seq_len=31 (_cp_config): the padding's positions stay in RoPE's table."""


def _cp_config(**trainer) -> Config:
    return Config.from_dict(
        {"model": {"max_seq_len": 31, "n_kv_heads": 2}, "trainer": {"micro_batch_size": 3, "loss": {"kl_coef": 0.05, "entropy_coef": 0.01}, **trainer}}
    )


@pytest.mark.slow  # two gloo procs
@pytest.mark.timeout(300)
def test_context_parallel_rows_train_as_one_process():
    """trainer.cp=2 over 2 gloo procs: TorchTitan's CP mesh and FSDP over it, meshrl's sharded
    rows and gathered log-probs give one process's losses, gradients and scores (ring
    attention, GPU-only, stood in for by gathered keys and values)."""
    from tests.conftest import gloo_ranks

    results = gloo_ranks(_cp_rank, 2, 2)
    reference = PolicyTrainer(_cp_config(), CPU)
    batch = make_batch(seed=7)
    scores = reference.compute_logprobs(batch)[1]
    want = [reference.train_step(make_batch(seed=s, version=i, turns=2)) for i, s in enumerate(CP_SEEDS)]
    for got in (results[0][0], results[1][0]):
        for g, w in zip(got, want):
            assert g["tokens"] == w["tokens"]
            for key in ("loss", "grad_norm", "kl", "entropy", "mismatch", "kl_sampler"):
                assert abs(g[key] - w[key]) <= 1e-5 * max(1.0, abs(w[key])), (key, g[key], w[key])
    for name, p in reference.model.named_parameters():
        got = torch.from_numpy(results[0][1][name])
        assert float((got - p.grad).abs().max()) <= 1e-3 * float(p.grad.abs().max()) + 1e-9, name  # sums in another order
    for _, _, got in results:
        torch.testing.assert_close(torch.from_numpy(got)[batch["loss_mask"]], scores[batch["loss_mask"]], atol=1e-5, rtol=1e-5)


def test_context_parallel_is_refused_on_cpu_and_planned_on_gpus():
    from meshrl.launch.devices import plan_devices
    from meshrl.preflight import preflight
    from meshrl.trainer.parallelize import parallelism_config

    with pytest.raises(ConfigError, match="trainer.cp.*CUDA"):
        preflight(_cp_config(procs=2, cp=2, device="cpu"))
    with pytest.raises(ConfigError, match="trainer.cp.*micro_batch_tokens"):
        _cp_config(procs=2, cp=2, micro_batch_tokens=BUDGET)
    with pytest.raises(ConfigError, match="trainer.procs"):
        _cp_config(procs=6, tp=2, cp=2)
    with pytest.raises(ConfigError, match="trainer.compute_dtype: context parallel's ring attention"):  # torch shards no float32 kernel
        _cp_config(procs=2, cp=2, compute_dtype="float32")
    with pytest.raises(ConfigError, match="trainer.cp"):
        Config.from_dict({"model": {"family": "qwen3_moe"}, "trainer": {"procs": 2, "cp": 2}})
    # on 9 GPUs: 8 trainer ranks (2 data-parallel x 2 CP x 2 TP), each on a GPU of its own, and a generator
    gpu = Config.from_dict(
        {"model": {"n_kv_heads": 2}, "launcher": {"gpus_per_host": 9}, "placement": "split", "trainer": {"procs": 8, "tp": 2, "cp": 2, "device": "cuda"}}
    )
    plan = plan_devices(gpu)
    assert sorted(s.gpus for s in plan.slots if s.role == "trainer") == [(i,) for i in range(8)]
    p = parallelism_config(gpu.trainer, 8)
    assert (p.data_parallel_shard_degree, p.context_parallel_degree, p.tensor_parallel_degree) == (2, 2, 2)
