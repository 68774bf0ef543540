"""MoE routing replay (meshrl/trainer/routing.py) on tiny TorchTitan qwen3_moe and deepseek_v3."""

import copy

import pytest
import torch

from meshrl.config import ModelConfig
from meshrl.trainer.logprobs import token_logprobs
from meshrl.trainer.model import build_model
from meshrl.trainer.routing import input_positions, moe_routers, record_routing, replay_routing, routing_differs

B, T = 3, 24

# (family, hf_overrides): qwen3_moe = softmax scores; deepseek_v3 = sigmoid scores, the first
# layer dense, and once with group-limited routing and a route scale.
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_groups": ("deepseek_v3", {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}),
}


def _models(case):
    family, overrides = CASES[case]
    cfg = ModelConfig(family=family, n_layers=3, num_experts=8, experts_top_k=2, dim=64, n_heads=2, n_kv_heads=2 if family == "deepseek_v3" else 1)
    a, _ = build_model(cfg, seed=0, hf_overrides=overrides)
    gen = torch.Generator().manual_seed(1)
    for module in a.modules():  # a nonzero load-balancing bias: the choice then differs from the gating scores
        if getattr(module, "expert_bias_E", None) is not None:
            module.expert_bias_E.copy_(0.01 * torch.randn(module.expert_bias_E.shape, generator=gen))
    b = copy.deepcopy(a)
    with torch.no_grad():
        for _, router in moe_routers(b):
            w = router.gate.weight
            w.add_(w.std() * torch.randn(w.shape, generator=gen))
    tokens = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
    return cfg, a, b, tokens


def _route(model, tokens, replay=None):
    with torch.no_grad(), record_routing(model) as rec, replay_routing(model, replay):
        model(tokens)
    return rec.experts


@pytest.mark.parametrize("case", list(CASES))
def test_replay_reproduces_the_recorded_routing(case):
    cfg, a, b, tokens = _models(case)
    routing_a, routing_b = _route(a, tokens), _route(b, tokens)
    assert routing_a.shape == (B, T, cfg.n_layers, cfg.experts_top_k)
    n_moe = len(moe_routers(a))
    assert ((routing_a >= 0).all(-1)).sum().item() == B * T * n_moe  # dense layers carry -1
    differs = routing_differs(routing_a, routing_b).float().mean().item()
    assert differs > 0.2, f"the perturbation moved only {differs:.0%} of tokens"

    replayed = _route(b, tokens, replay=routing_a)
    assert torch.equal(replayed, routing_a)
    assert torch.equal(_route(b, tokens), routing_b), "replay must end with its block"

    # The MoE-layers-only layout replays the same.
    moe_only = routing_a[:, :, [index for index, _ in moe_routers(a)]]
    assert torch.equal(_route(b, tokens, replay=moe_only), routing_a)


@pytest.mark.parametrize("case", list(CASES))
def test_gate_weights_come_from_the_live_router_and_differentiate(case):
    cfg, a, b, tokens = _models(case)
    routing_a = _route(a, tokens)
    seen = []

    def after(router, args, output):  # registered after the replay hook: sees its result
        seen.append((router, output))

    routers = moe_routers(b)
    with replay_routing(b, routing_a):  # installs the replay hook first
        pass
    handles = [router.register_forward_hook(after) for _, router in routers]
    try:
        b.train()
        with replay_routing(b, routing_a):
            logprobs, _ = token_logprobs(b, tokens, torch.ones(B, T, dtype=torch.bool))
        logprobs.sum().backward()
    finally:
        for h in handles:
            h.remove()
    for router, (topk_scores, topk_ids, scores) in seen:
        expected = scores.gather(-1, topk_ids)
        expected = expected / expected.sum(-1, keepdim=True) * router.route_scale
        assert torch.allclose(topk_scores, expected, atol=1e-6)
        assert topk_scores.requires_grad
    for _, router in routers:
        grad = router.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
def test_tokens_without_replay_data_keep_the_live_routing(case):
    cfg, a, b, tokens = _models(case)
    routing_a, routing_b = _route(a, tokens), _route(b, tokens)
    moe = [index for index, _ in moe_routers(a)]
    # Replay data only from position 8 on (a prompt of 8 tokens), and one id missing at 12..15.
    replay = routing_a.clone()
    replay[:, :8] = -1
    replay[:, 12:16, moe[0], 0] = -1
    got = _route(b, tokens, replay=replay)
    # Tokens before the data keep B's own routing in every layer (causal attention: positions < 8
    # do not see the replayed ones, so B's own forward is the reference there).
    assert torch.equal(got[:, :8], routing_b[:, :8])
    assert torch.equal(got[:, 8:12], routing_a[:, 8:12])
    assert torch.equal(got[:, 16:], routing_a[:, 16:])
    # At 12..15 the first MoE layer routes live (its input does not depend on any routing, so
    # it is B's own choice), the later ones replay.
    assert torch.equal(got[:, 12:16, moe[0]], routing_b[:, 12:16, moe[0]])
    assert not torch.equal(routing_a[:, 12:16, moe[0]], routing_b[:, 12:16, moe[0]])
    assert torch.equal(got[:, 12:16, moe[1:]], routing_a[:, 12:16, moe[1:]])


def test_replay_of_a_model_on_its_own_routing_changes_nothing():
    cfg, a, _, tokens = _models("deepseek_v3")
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        plain, _ = token_logprobs(a, tokens, mask)
        routing = _route(a, tokens)
        with replay_routing(a, routing):
            replayed, _ = token_logprobs(a, tokens, mask)
    assert torch.allclose(plain, replayed, atol=1e-5)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
def test_replay_reports_where_it_overrode_the_live_routing(case):
    cfg, a, b, tokens = _models(case)
    routing_a, routing_b = _route(a, tokens), _route(b, tokens)
    routing_a[0, :5] = -1  # no data: routes live, not counted
    changed: list = []
    with torch.no_grad(), replay_routing(b, routing_a, changed):
        b(tokens)
    assert len(changed) == 1 and changed[0].shape == (B, T)
    assert torch.equal(changed[0], routing_differs(routing_b, routing_a))
    assert changed[0].any() and not changed[0][0, :5].any()


def test_shape_mismatch_and_no_data():
    cfg, a, _, tokens = _models("qwen3_moe")
    with pytest.raises(ValueError, match="layers"):
        _route(a, tokens, replay=torch.zeros(B, T, 5, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not match"):
        _route(a, tokens[:, :-1], replay=torch.zeros(B, T, 3, 2, dtype=torch.int32))
    assert torch.equal(_route(a, tokens, replay=None), _route(a, tokens))


def test_input_positions_shifts_sampled_token_rows_to_the_producing_forward():
    packed = torch.full((1, 6, 2, 2), -1, dtype=torch.int32)
    packed[0, 3:5] = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], dtype=torch.int32)  # two sampled tokens at 3, 4
    shifted = input_positions(packed)
    assert torch.equal(shifted[0, 2:4], packed[0, 3:5])  # produced by the forwards at positions 2 and 3
    assert (shifted[0, 4:] == -1).all() and (shifted[0, :2] == -1).all()


def test_token_logprobs_replays_routed_experts():
    cfg, a, b, tokens = _models("qwen3_moe")
    mask = torch.ones(B, T, dtype=torch.bool)
    routing_a = _route(a, tokens)
    with torch.no_grad():
        live, _ = token_logprobs(b, tokens, mask)
        with replay_routing(b, routing_a):
            wrapped, _ = token_logprobs(b, tokens, mask)
        passed, _ = token_logprobs(b, tokens, mask, routed_experts=routing_a)
    assert torch.equal(passed, wrapped)
    assert not torch.allclose(passed, live)


def test_the_trainer_replays_a_batchs_routed_experts():
    """PolicyTrainer on qwen3_moe: a batch carrying the sampler's choices (as the episode packs
    them: row t holds the routing of the forward that produced token t) makes the trainer's
    routers choose exactly those experts at every model-token position; with
    trainer.loss.routing_replay off they route live and differ."""
    from meshrl.config import Config
    from meshrl.episode import PAD_VERSION
    from meshrl.trainer.policy import PolicyTrainer
    from tests.conftest import make_group

    def trainer(replay: bool) -> PolicyTrainer:
        c = Config.from_dict({"model": {"family": "qwen3_moe", "num_experts": 8}, "trainer": {"loss": {"routing_replay": replay}}})
        return PolicyTrainer(c, torch.device("cpu"))

    on, off = trainer(True), trainer(False)
    batch = make_group(0, 4, [0] * 12, prompt_len=4)
    gen = torch.Generator().manual_seed(0)
    batch["tokens"] = torch.randint(3, 100, batch["tokens"].shape, generator=gen)
    sampler = copy.deepcopy(on.model)  # the sampler's weights: routers perturbed
    with torch.no_grad():
        for _, router in moe_routers(sampler):
            router.gate.weight.add_(router.gate.weight.std() * torch.randn(router.gate.weight.shape, generator=gen))
    chosen = _route(sampler, batch["tokens"])  # by input position
    packed = torch.full_like(chosen, -1)
    model_tokens = batch["loss_mask"]
    packed[:, 1:][model_tokens[:, 1:]] = chosen[:, :-1][model_tokens[:, 1:]]  # as the engine returns them
    batch["routed_experts"] = packed

    positions = torch.zeros_like(model_tokens)
    positions[:, :-1] = model_tokens[:, 1:]  # the inputs whose forward produced a model token
    for t, replays in ((on, True), (off, False)):
        with record_routing(t.model) as rec:
            t.compute_logprobs(batch)
        same = (rec.experts == chosen).all(-1).all(-1)[positions.bool() & (batch["versions"] != PAD_VERSION)]
        assert same.all() if replays else not same.all()
    # the step reports the share of trained tokens it had the sampler's routes for: one row's lost here
    batch["routed_experts"][0] = -1
    row = on.train_step(batch, current_version=0)
    assert row["routing_replay_covered_frac"] == pytest.approx(0.75) and 0 <= row["routing_replay_changed_frac"] <= 1
    assert "routing_replay_covered_frac" not in off.train_step(batch, current_version=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_routed_experts_are_the_trainers_and_replay_makes_them_equal(tmp_path):
    """A real vLLM engine (on CPU through meshrl/generator/routing_capture.py) returns, for
    every sampled token, the experts each MoE layer chose in the forward that produced it. On
    the same float32 weights the trainer's live routers choose the same experts for (nearly)
    every token: a row filed under the wrong request or position would agree only by chance.
    Replaying the sampler's rows makes the trainer's routing equal them everywhere."""
    from monarch.actor import this_host

    from meshrl.config import Config
    from meshrl.tokenizer import build_char_tokenizer
    from meshrl.trainer import checkpoint as ckpt
    from tests.test_generator import prompts, spawn_generator

    cfg = ModelConfig(family="qwen3_moe", n_layers=3, num_experts=8, experts_top_k=2, dim=64, n_heads=2, n_kv_heads=1)
    model, specs = build_model(cfg, seed=0)
    with torch.no_grad():  # decisive routers and a peaked head: routing well off its top-k edges
        for _, router in moe_routers(model):
            router.gate.weight.mul_(20.0)
        model.lm_head.weight.mul_(8.0)
    path = ckpt.export_hf(model, specs, tmp_path / "moe")
    build_char_tokenizer(path)
    model.eval()

    asked = prompts(8, seed=3, length=6)
    config = Config.from_dict(
        {"model": {"path": path}, "generator": {"return_routed_experts": True, "max_new_tokens": 24, "temperature": 1.0, "max_num_seqs": 8}}
    )
    gen, _ = spawn_generator(this_host().spawn_procs(per_host={"procs": 1}), "moe", config, path)
    try:
        outs = gen.generate_many.call_one([(p, 24, None, 0) for p in asked]).get(timeout=120)
    finally:
        gen.shutdown_engine.call_one().get(timeout=60)

    differ = total = 0
    for prompt, out in zip(asked, outs):
        assert not isinstance(out, str), out
        n = len(out.token_ids)
        assert out.routed_experts is not None and tuple(out.routed_experts.shape) == (n, cfg.n_layers, cfg.experts_top_k)
        tokens = torch.tensor([prompt + out.token_ids])
        rows = slice(len(prompt) - 1, len(prompt) - 1 + n)  # the forwards that produced the sampled tokens
        sampler = torch.full((1, tokens.shape[1], cfg.n_layers, cfg.experts_top_k), -1, dtype=torch.int32)
        sampler[0, rows] = out.routed_experts.sort(-1).values.to(torch.int32)
        live, replayed = _route(model, tokens)[:, rows], _route(model, tokens, replay=sampler)[:, rows]
        differ += routing_differs(live, sampler[:, rows]).sum().item()
        assert torch.equal(replayed, sampler[:, rows])
        total += n
    assert total > 8 * 10 and differ <= 0.02 * total, (differ, total)
