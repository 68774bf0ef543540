"""The models' checks before a run starts: checkpoints, parallelism, LoRA, the teacher.

`check_model_files`, `check_teacher`, `check_critic_files` and `check_lora` need only the files a config names
and the trainer's projection names; `check_model` reads the policy's checkpoint (it loads
as one of the families meshrl builds, trainer.tp divides its heads, model.max_seq_len fits
its positions, it has weights) and holds tensor and context parallelism and the dtype to
what the device plan can run. Each problem is one `ConfigError` naming the field and the
fix. Nothing here imports torch until a check needs it (LoRA's names), so that
`meshrl config show` stays quick.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from meshrl.config import MOE_FAMILIES, Config, ConfigError
from meshrl.config.hf import model_args_from_hf
from meshrl.config.model_checks import engine_splits_heads, engine_tp_fix
from meshrl.errors import first_line

if TYPE_CHECKING:
    from meshrl.launch.devices import DevicePlan


def check_model_files(c: Config) -> None:
    """No model beside the policy names a tokenizer of its own; model.path, when set, is a
    directory holding a config.json."""
    _check_models_tokenizer(c)
    m = c.model
    if m.path is not None:
        if not os.path.isdir(m.path):
            raise ConfigError(
                "model.path", f"directory {m.path!r} not found: give a local Hugging Face checkpoint directory, or null to initialise from scratch"
            )
        if not os.path.isfile(os.path.join(m.path, "config.json")):
            raise ConfigError("model.path", f"{m.path!r} has no config.json: point it at a Hugging Face checkpoint directory")


def _check_models_tokenizer(c: Config) -> None:
    """Every model reads and writes the policy's token ids, with the policy's tokenizer: a
    `models[i].model.tokenizer` of its own would be ignored, so one that differs is refused."""
    policy = c.model.tokenizer
    for i, m in enumerate(c.models):
        if "tokenizer" not in m.model:
            continue
        own = m.model["tokenizer"]
        if own == policy or isinstance(own, str) and isinstance(policy, str) and os.path.realpath(own) == os.path.realpath(policy):
            continue
        raise ConfigError(
            f"models[{i}].model.tokenizer",
            f"{own!r} is not the policy's: every model shares the policy's tokenizer (model.tokenizer, else model.path's, else the built-in one); "
            "remove it, or set model.tokenizer for them all",
        )


def _policy_args(c: Config):
    """The policy's model args: read from its checkpoint (`model.path`), else its `model` section."""
    return model_args_from_hf(c.model.path)[0] if c.model.path else c.model


def checkpoint_vocabulary(path: str) -> int | None:
    """The vocabulary size of the checkpoint at `path`; None where it does not load (a check of
    its own refuses that: `check_model`'s, or its component's)."""
    try:
        return model_args_from_hf(path)[0].vocab_size
    except (OSError, ValueError, KeyError):
        return None


def policy_vocabulary(c: Config) -> int | None:
    """The policy's vocabulary size (its checkpoint's, else model.vocab_size): the token ids a
    model that reads its episodes must cover. None where its checkpoint does not load."""
    return checkpoint_vocabulary(c.model.path) if c.model.path else c.model.vocab_size


def check_models_vocabulary(c: Config) -> None:
    """Each model beside the policy speaks in the policy's token ids: its vocabulary (its
    checkpoint's, `models[i].model.path` or the policy's it inherits, else its
    `model.vocab_size`) covers the policy's. (A checkpoint that does not load, the policy's or
    a model's, is `check_model`'s to refuse.)"""
    policy = policy_vocabulary(c)
    if policy is None:
        return
    why = f"is smaller than the policy's ({policy}): every model of a game reads and writes the policy's token ids"
    for i, m in enumerate(c.models):
        path = m.model["path"] if "path" in m.model else c.model.path
        if path is None:
            n = m.model.get("vocab_size", c.model.vocab_size)
            if isinstance(n, int) and n < policy:
                raise ConfigError(f"models[{i}].model.vocab_size", f"{n} {why}: set it to at least {policy}")
            continue
        n = checkpoint_vocabulary(path)
        if n is not None and n < policy:
            raise ConfigError(f"models[{i}].model.path", f"its vocabulary ({n}) {why}, so it needs the policy's tokenizer")
        if path != c.model.path and not _reads_policys_ids(c, path):
            raise ConfigError(
                f"models[{i}].model.path",
                "its tokenizer.json gives tokens other ids than the policy's: every model of a game reads and writes the policy's token ids; "
                "give it a checkpoint of the policy's tokenizer",
            )


def check_teacher(c: Config) -> None:
    """distill.teacher, when set, is a checkpoint directory that reads the policy's token ids:
    its vocabulary covers the policy's and, where both have a tokenizer.json, its tokenizer's
    model gives each of the policy's tokens the policy's id (the teacher scores the policy's
    sampled ids). Tokens it adds beyond them (Qwen3's over Qwen2.5's) and added special tokens
    renamed at the same ids (Llama 3.1's over 3.0's) are no mismatch."""
    di = c.distill
    if di.teacher is None:
        return
    if not os.path.isfile(os.path.join(di.teacher, "config.json")):
        raise ConfigError(
            "distill.teacher", f"{di.teacher!r} is not a Hugging Face checkpoint directory (no config.json): give the teacher's local checkpoint, or null"
        )
    n, policy = checkpoint_vocabulary(di.teacher), policy_vocabulary(c)
    if n is not None and policy is not None and n < policy:
        raise ConfigError(
            "distill.teacher",
            f"its vocabulary ({n}) is smaller than the policy's ({policy}): the teacher scores the policy's token ids, so it needs its tokenizer",
        )
    if not _reads_policys_ids(c, di.teacher):
        raise ConfigError(
            "distill.teacher",
            "its tokenizer.json gives tokens other ids than the policy's: the teacher scores the policy's token ids; distill from one of the same tokenizer",
        )
    _check_teacher_engine(c)


def _reads_policys_ids(c: Config, directory: str) -> bool:
    """Whether the tokenizer.json in `directory` gives each of the policy's tokens the policy's
    id (tokens it adds past them, and added special tokens, are no mismatch); True where either
    has none to read."""
    own = c.model.tokenizer or c.model.path
    if own is None:
        from meshrl.tokenizer import char_vocab

        ours = char_vocab()  # the built-in character tokenizer's
    else:
        ours = _token_ids(own)
    theirs = _token_ids(directory)
    return ours is None or theirs is None or all(theirs.get(token) == i for token, i in ours.items())


def _check_teacher_engine(c: Config) -> None:
    """What vLLM refuses only once the teacher's engine starts (its generator.tp workers, on
    model.max_seq_len): weights present, its positions cover model.max_seq_len, tp divides its heads."""
    teacher = c.distill.teacher
    if not any(n.endswith((".safetensors", ".bin")) for n in os.listdir(teacher)):
        raise ConfigError("distill.teacher", f"{teacher!r} has a config.json but no weight files (*.safetensors): point it at a complete checkpoint")
    try:
        with open(os.path.join(teacher, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("distill.teacher", f"its config.json does not read ({type(e).__name__}: {first_line(str(e))}): give a complete checkpoint") from None
    hf = {**hf, **(hf.get("text_config") or {})}  # (a multimodal checkpoint's language model)
    positions = hf.get("max_position_embeddings")
    ropes = [hf.get(key) or {} for key in ("rope_scaling", "rope_parameters")]
    stretched = any((r.get("rope_type") or r.get("type") or "default") != "default" for r in ropes if isinstance(r, dict))  # YaRN and the like
    if isinstance(positions, int) and not stretched and positions < c.model.max_seq_len:
        raise ConfigError(
            "distill.teacher",
            f"its max_position_embeddings={positions} is under model.max_seq_len={c.model.max_seq_len}: "
            "the teacher scores whole episodes; lower model.max_seq_len or distill from a longer checkpoint",
        )
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and not engine_splits_heads(heads, kv_heads, c.generator.tp):
        raise ConfigError(
            "distill.teacher",
            f"generator.tp={c.generator.tp}, which the teacher's engine runs on too, does not split its {heads} attention heads "
            f"({kv_heads} KV heads): {engine_tp_fix(heads, kv_heads, c.generator.tp)}",
        )


def _token_ids(directory: str | None) -> dict[str, int] | None:
    """token -> id of the model vocabulary of the tokenizer.json in `directory` (not its added
    tokens); None where there is none to read."""
    try:
        with open(os.path.join(directory, "tokenizer.json")) as f:
            spec = json.load(f)
    except (TypeError, OSError, ValueError):
        return None
    vocab = (spec.get("model") or {}).get("vocab")
    ids = dict(vocab) if isinstance(vocab, dict) else {}  # (a Unigram model's is a list of pieces: its order is its ids)
    if isinstance(vocab, list):
        ids = {piece[0]: i for i, piece in enumerate(vocab) if isinstance(piece, list) and piece}
    return ids


def check_critic_files(c: Config) -> None:
    """critic.path, when set, is a checkpoint the critic can start from and read the policy's
    tokens with: it loads as a family meshrl builds, has weights, covers the policy's
    vocabulary and model.max_seq_len, and a classifier there has one label."""
    path = c.critic.path
    if path is None or c.trainer.loss.advantage != "gae":
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("critic.path", f"{path!r} is not a Hugging Face checkpoint directory (no config.json): give one, or null")
    try:
        shape = model_args_from_hf(path)[0]
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        policy = _policy_args(c)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            "critic.path",
            f"{path!r} does not load as a checkpoint ({type(e).__name__}: {first_line(str(e))}): give a qwen3, qwen3_moe, llama or deepseek_v3 checkpoint",
        ) from None
    if not any(n.endswith((".safetensors", ".bin")) for n in os.listdir(path)):
        raise ConfigError("critic.path", f"{path!r} has a config.json but no weight files (*.safetensors): point it at a complete checkpoint")
    if shape.vocab_size < policy.vocab_size:
        raise ConfigError(
            "critic.path",
            f"its vocabulary ({shape.vocab_size}) is smaller than the policy's ({policy.vocab_size}): "
            "the critic reads the policy's token ids, so it needs the policy's tokenizer",
        )
    if shape.max_seq_len < c.model.max_seq_len:
        raise ConfigError(
            "critic.path",
            f"its max_position_embeddings={shape.max_seq_len} is under model.max_seq_len={c.model.max_seq_len}: "
            "the critic values whole episodes; lower model.max_seq_len or give a longer checkpoint",
        )
    classifier = any(a.endswith(("ForTokenClassification", "ForSequenceClassification")) for a in hf.get("architectures") or [])
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 1)
    if classifier and labels != 1:
        raise ConfigError("critic.path", f"a classifier with {labels} labels: a critic's value head has one; give a one-label classifier or a causal LM")


def check_lora(c: Config) -> None:
    """lora.targets name projections the trainer's models have."""
    lo = c.lora
    if lo.rank > 0:
        from meshrl.trainer.lora import TITAN_NAMES

        unknown = sorted(set(lo.targets) - set(TITAN_NAMES))
        if unknown:
            raise ConfigError("lora.targets", f"unknown {unknown}: choose from {sorted(TITAN_NAMES)}")


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _check_lora_on(c: Config, family: str) -> None:
    """lora.targets build adapters in the policy's family (its checkpoint's, where model.path names one)."""
    targets = c.lora.targets
    if c.lora.rank <= 0:
        return
    if family == "deepseek_v3":
        raise ConfigError("lora.targets", "LoRA is not mapped onto deepseek_v3's MLA projections: use qwen3, llama3 or qwen3_moe")
    if family == "qwen3_moe" and not set(targets) & set(ATTENTION):  # (its routed experts are grouped weights, frozen)
        raise ConfigError(
            "lora.targets", f"{sorted(targets)} adapt no layer of a qwen3_moe model, whose every MLP is routed experts: add {', '.join(ATTENTION)}"
        )


def check_model(c: Config, plan: DevicePlan, own: DevicePlan | None = None) -> str:
    """The policy's checkpoint loads and fits trainer.tp and model.max_seq_len; tensor and
    context parallelism and the dtype suit its family and `plan`. Returns the family. `own`:
    a model's own slots (`plan.view`), where `c` is a model beside the policy."""
    m = c.model
    if m.path is not None:
        try:
            shape = model_args_from_hf(m.path)[0]
            family, longest = shape.family, shape.max_seq_len
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(
                "model.path",
                f"{m.path!r} does not load as a checkpoint ({type(e).__name__}: {first_line(str(e))}): "
                "point it at a Hugging Face checkpoint directory of a qwen3, qwen3_moe, llama or deepseek_v3 model",
            ) from None
        tp = c.trainer.tp
        if shape.n_heads % tp or shape.n_kv_heads % tp:
            raise ConfigError(
                "trainer.tp", f"{tp} must divide the checkpoint's {shape.n_heads} attention heads and {shape.n_kv_heads} KV heads: pick a divisor"
            )
        ep = c.trainer.ep
        if ep > 1 and (family not in MOE_FAMILIES or shape.num_experts % ep):
            why = (
                f"its {shape.num_experts} experts do not split over {ep}: pick a divisor" if family in MOE_FAMILIES else f"it is {family}, not a MoE: set ep=1"
            )
            raise ConfigError("trainer.ep", f"expert parallelism over the checkpoint's experts ({m.path}), and {why}")
        if not engine_splits_heads(shape.n_heads, shape.n_kv_heads, c.generator.tp):
            raise ConfigError("generator.tp", engine_tp_fix(shape.n_heads, shape.n_kv_heads, c.generator.tp))
        if m.max_seq_len > longest:  # the trainer's RoPE tables are the checkpoint's length; vLLM's context is max_seq_len
            raise ConfigError(
                "model.max_seq_len", f"{m.max_seq_len} exceeds the checkpoint's max_position_embeddings={longest} ({m.path}): lower it to at most {longest}"
            )
        if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(m.path)):
            raise ConfigError("model.path", f"{m.path!r} has a config.json but no weight files (*.safetensors): point it at a complete checkpoint directory")
    else:
        family = m.family
    _check_lora_on(c, family)
    if c.trainer.cp > 1 and family in MOE_FAMILIES:
        raise ConfigError("trainer.cp", f"context parallel is built for the dense families (qwen3, llama), and the policy is {family}: set trainer.cp=1")
    if c.trainer.cp > 1 and not plan.slot("trainer", 0).gpus:
        raise ConfigError(
            "trainer.cp",
            "context parallel is TorchTitan's ring attention, whose kernels are CUDA's (flash, efficient or cuDNN "
            "attention), and this trainer runs on CPU: set trainer.cp=1 (on CPU, trainer.activation_checkpoint=full "
            "holds long rows)",
        )
    if c.trainer.tp > 1 and family in MOE_FAMILIES:
        raise ConfigError(
            "trainer.tp", f"tensor parallel is built for the dense families (qwen3, llama), and the policy is {family}: use trainer.ep for experts, or tp=1"
        )
    slots = own or plan
    if c.lora.rank > 0 and family in MOE_FAMILIES and slots.slot("generator", 0).gpus and not slots.slot("trainer", 0).gpus:
        # each side decides by its own GPUs whether the adapter or the merged weights travel
        # (compat.vllm_runs_lora_on): a CPU trainer would send merged weights to engines expecting the adapter
        raise ConfigError("trainer.device", f"LoRA on the MoE policy ({family}) with the trainer on CPU and the generators on GPUs: give the trainer a GPU too")
    if family == "deepseek_v3" and m.dtype == "float32" and plan.layout != "cpu":
        raise ConfigError(
            "model.dtype", "deepseek_v3 generators on GPU run vLLM's MLA attention, whose CUDA backends take only float16 or bfloat16: set model.dtype=bfloat16"
        )
    return family


def check_routed_experts(c: Config, family: str, who: str = "the policy") -> None:
    """generator.return_routed_experts only for a MoE model (`family`, from `check_model`)."""
    if c.generator.return_routed_experts and family not in MOE_FAMILIES:
        raise ConfigError("generator.return_routed_experts", f"routed experts exist only in MoE models, and {who} is {family}: set it false")


def check_routed_shapes(c: Config) -> None:
    """The models that return routed experts route alike: one group packs every model's rows,
    their routes in one [layers, top_k] tensor (episode.pack)."""
    from meshrl.launch.shape import model_shape

    views = {n: c.for_model(n) for n in c.model_names()}
    shapes = {n: (s.layers, s.top_k) for n, view in views.items() if view.generator.return_routed_experts for s in [model_shape(view)]}
    if len(set(shapes.values())) > 1:
        routes = ", ".join(f"{n} {list(shape)}" for n, shape in shapes.items())
        raise ConfigError(
            "generator.return_routed_experts",
            f"the models route over different [layers, top_k] ({routes}), and one batch packs every model's routes in one tensor: "
            "keep it on for the models of one shape (models[i].generator.return_routed_experts=false on the others)",
        )
