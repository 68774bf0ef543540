"""The trainer: TorchTitan models on the trainer mesh, the policy loss, checkpoints.

- model.py: `build_model(ModelConfig)` from TorchTitan's registry (a HF config.json is read by config/hf.py).
- parallelize.py: FSDP2 (+ expert parallelism) with TorchTitan's parallelize functions.
- logprobs.py: chunked per-token log-probs / entropies of response tokens.
- losses.py: the GRPO policy loss and its off-policy corrections.
- checkpoint.py: HF export/import, the HF-named weight stream, atomic DCP checkpoints.
- lora.py: LoRA adapters on TorchTitan modules, PEFT export.
- routing.py: MoE routing replay.
- packing.py: a batch dealt to data-parallel ranks and micro-batches, rows packed by tokens.
- policy.py: `PolicyTrainer`, one rank in plain PyTorch (no Monarch).
- values.py, critic.py: PPO's GAE and value loss; the value model and `CriticTrainer`.
- checks.py: the model, parallelism, LoRA and teacher checks preflight runs.
- actor.py, critic_actor.py: the Monarch shells: `TrainerActor`, `spawn_trainer` -> `TrainerMesh`; `CriticActor`.
"""
