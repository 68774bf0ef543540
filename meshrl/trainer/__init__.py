"""The trainer: TorchTitan models on the trainer mesh, the policy loss, checkpoints.

- model.py: `build_model(ModelConfig)` from TorchTitan's registry; `model_args_from_hf(dir)`.
- parallelize.py: FSDP2 (+ expert parallelism) with TorchTitan's parallelize functions.
- logprobs.py: chunked per-token log-probs / entropies of response tokens.
- losses.py: the GRPO policy loss and its off-policy corrections.
- checkpoint.py: HF export/import, the HF-named weight stream, atomic DCP checkpoints.
- lora.py: LoRA adapters on TorchTitan modules, PEFT export.
- routing.py: MoE routing replay.
- policy.py: `PolicyTrainer`, one rank in plain PyTorch (no Monarch).
- actor.py: the Monarch shell: `TrainerActor`, `spawn_trainer` -> `TrainerMesh`.
"""
