"""Checks before a run starts: what a config's values cannot show alone.

`check(config)` asks the domain: that a `task:` source names a built-in task (and a
multi-turn one gets its reward from its env), that a `reasoning_gym:` task exists with the
arguments given, that user code named by import path imports, that LoRA targets map onto
the trainer's projections, that a longtail tail fits the generation budget, and that the
files and directories the config names are there. `preflight(config)` adds this machine:
a device plan that fits its GPUs (meshrl/launch/devices.py), a run directory it can write, a
launcher address of its own, Slurm's commands and the partition asked for
(launcher.kind=slurm), model and tokenizer directories that load. Both raise the first
problem as one `ConfigError` naming the field and the fix. The CLI, the API and the TorchX component call them before any mesh starts;
nothing below them imports this module.

The user's own code and data are checked here too (the table is docs/contracts.md): `check`
refuses a `rollout.env` that is neither an env class nor a function that can make one from
`rollout.env_args`, and a reward function that cannot be called as (prompt, response,
sample); `preflight` reads every row of a file source (bounded by
`contracts.data_check_s`; the first bad one as `FILE:LINE: what is wrong`) and, with
`contracts.probe`, runs the user's code once on the first record: the env constructed, its
`reset` and one `step` on an empty model turn (only a return that breaks the contract
counts there: the turn is not a real one), the reward function called with the record's
answer as the response. Each problem is one line and exit 2 (`ConfigError` of kind `data
error` or `contract error`).

Paths are checked here rather than in config/checks.py: whether a file exists is a fact
of the filesystem the launching process sees, not of the values, and each actor that
rebuilds its config from a dict, on whatever host, need not ask it again. A prompt source
is checked whole in one place: that it exists, that its package is installed, and that
something scores it. Modules that bring torch are imported only by the checks that need
them, so that `meshrl config show` stays quick.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import threading
from typing import Any, Callable

from meshrl.config import MOE_FAMILIES, Config, ConfigError, source_kind
from meshrl.errors import first_line, source_location, user_location
from meshrl.imports import import_callable, missing_extra
from meshrl.launch.memory import check_memory
from meshrl.launch.devices import plan_devices
from meshrl.rollout.env import ContractError, ModelTurn, RewardFn, as_observation, as_step_result, call_bounded, call_reward, callable_name, prompt_text
from meshrl.rollout.sandbox import check_sandbox
from meshrl.tasks import TASKS, answer_budget


def check(c: Config) -> None:
    """The domain checks of a built config (reads files, writes none); raise the first problem."""

    def need(ok: bool, path: str, message: str) -> None:
        if not ok:
            raise ConfigError(path, message)

    m = c.model
    if m.path is not None:
        need(os.path.isdir(m.path), "model.path", f"directory {m.path!r} not found: give a local Hugging Face checkpoint directory, or null to initialise from scratch")
        need(os.path.isfile(os.path.join(m.path, "config.json")), "model.path", f"{m.path!r} has no config.json: point it at a Hugging Face checkpoint directory")
    if m.tokenizer is not None:
        need(os.path.isdir(m.tokenizer), "model.tokenizer", f"directory {m.tokenizer!r} not found: give a local tokenizer directory, or null for the default")

    b = c.buffer
    if b.sampling not in ("fifo", "random"):
        _check_import(need, "buffer.sampling", b.sampling, "'fifo', 'random' or a sampling function")

    s = c.scoring
    if s.reward_fn is not None:
        _check_import(need, "scoring.reward_fn", s.reward_fn, "a reward function")
        _check_reward_signature(import_callable(s.reward_fn), "scoring.reward_fn")
    if s.reward_model is not None:
        need(os.path.isdir(s.reward_model), "scoring.reward_model", f"directory {s.reward_model!r} not found: give a local checkpoint directory or null")

    d = c.data
    _check_source(need, c, "data.source", d.source, d.task_args)
    if source_kind(d.source) == "task":
        name = d.source.removeprefix("task:")
        if TASKS[name].env is not None and c.rollout.env is None:
            need(not (s.reward_fn or s.reward_model), "scoring.reward_fn",
                 f"task:{name} is multi-turn and its env gives the reward: unset scoring.reward_fn / reward_model, or set rollout.env")
    elif source_kind(d.source) in ("file", "dataset"):
        need(s.reward_fn is not None or s.reward_model is not None or c.rollout.env is not None, "scoring.reward_fn",
             f"a file data source ({d.source}) needs a reward: set scoring.reward_fn, scoring.reward_model or rollout.env")
    if d.source in ("task:longtail", "task:longtail_chat"):
        _check_budget(need, c)
    if s.reward_model is not None:
        _check_scorer_checkpoint(need, "scoring.reward_model", s.reward_model, "reward_model")
    for i, sc in enumerate(s.scorers):
        _check_scorer_files(need, sc, f"scoring.scorers[{i}]")

    if c.eval.source is not None:
        _check_source(need, c, "eval.source", c.eval.source, c.eval.task_args)

    di = c.distill
    if di.teacher is not None:
        need(os.path.isfile(os.path.join(di.teacher, "config.json")), "distill.teacher", f"{di.teacher!r} is not a Hugging Face checkpoint directory (no config.json): give the teacher's local checkpoint, or null")

    lo = c.lora
    if lo.rank > 0:
        from meshrl.trainer.lora import TITAN_NAMES

        unknown = sorted(set(lo.targets) - set(TITAN_NAMES))
        need(not unknown, "lora.targets", f"unknown {unknown}: choose from {sorted(TITAN_NAMES)}")

    r = c.rollout
    if r.env is not None:
        _check_import(need, "rollout.env", r.env, "an env class")
        _check_env_maker(r.env, r.env_args)
    if r.tool_parser not in ("hermes", "compact"):
        _check_import(need, "rollout.tool_parser", r.tool_parser, "'hermes', 'compact' or a parser function")


def _check_scorer_files(need, sc, path: str) -> None:
    """A scorer's code and checkpoint: an importable function, a checkpoint with the right
    head and a tokenizer, a judge template and parser that work on a probe."""
    if sc.kind == "function":
        _check_import(need, f"{path}.path", sc.path, "a reward function")
        _check_reward_signature(import_callable(sc.path), f"{path}.path")
    if sc.kind in ("reward_model", "judge"):
        _check_scorer_checkpoint(need, f"{path}.path", sc.path, sc.kind)
    if sc.kind == "judge":
        from meshrl.scorers.backends import fill_template, load_parser, parse_reply

        try:
            fill_template(sc.template, {"prompt": "q", "response": "r", "answer": "a"})
        except (KeyError, IndexError, ValueError) as e:
            need(False, f"{path}.template", f"cannot be filled ({type(e).__name__}: {e}): use only {{prompt}}, {{response}} and {{answer}}, "
                                            "and double other braces")
        if sc.parser not in ("number", "yes_no"):
            _check_import(need, f"{path}.parser", sc.parser, "'number', 'yes_no' or a parser function")
        score = parse_reply(load_parser(sc.parser), sc.probe_reply, sc.scale, None)
        need(isinstance(score, float), f"{path}.parser", f"{sc.parser!r} cannot read probe_reply={sc.probe_reply!r} as a number: "
                                                         "fix the parser, or set probe_reply to a reply of your judge's format")


def _check_scorer_checkpoint(need, field: str, path: str, kind: str) -> None:
    """A local checkpoint of the kind's head (sequence classification with one label, or a
    causal LM), with a tokenizer beside it."""
    import json

    config_file = os.path.join(path, "config.json")
    need(os.path.isfile(config_file), field, f"{path!r} is not a Hugging Face checkpoint directory (no config.json): give a local checkpoint")
    with open(config_file) as f:
        hf = json.load(f)
    arch = " ".join(hf.get("architectures") or [])
    if kind == "reward_model":
        want = "a reward model is a sequence-classification checkpoint with one label (AutoModelForSequenceClassification, num_labels=1)"
        need("ForSequenceClassification" in arch, field, f"{path!r} is {arch or 'no known architecture'}: {want}")
        labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
        need(labels == 1, field, f"{path!r} has a head of {labels} labels: {want}")
    else:
        need("ForCausalLM" in arch or "ForConditionalGeneration" in arch, field, f"{path!r} is {arch or 'no known architecture'}: a judge is a causal LM checkpoint")
    need(any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")), field,
         f"{path!r} has no tokenizer: save the scorer's tokenizer beside its weights (tokenizer.save_pretrained)")


def preflight(c: Config, reward_fn: RewardFn | None = None) -> None:
    """`check`, then what only this machine can answer: a device plan that fits its GPUs, a
    run directory that can be written, a launcher address of its own, model and tokenizer
    directories that load, the sandbox where the run executes model-written code, and the
    user's data, env and reward (`reward_fn`: one passed in code) on a real record. Run
    before any mesh starts; raises ConfigError naming the field and the fix."""
    check(c)
    plan = plan_devices(c)  # every proc gets GPUs of its own, or one line saying which field to change
    if reward_fn is not None:
        _check_reward_signature(reward_fn, "reward_fn")
    run_dir = os.path.abspath(c.logging.run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".meshrl-write-check-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError("logging.run_dir", f"cannot write to {run_dir!r} ({e.strerror or type(e).__name__}): choose a writable directory") from None
    if c.launcher.kind == "workers" and c.launcher.address not in _local_addresses():
        raise ConfigError("launcher.address", f"{c.launcher.address!r} is not an address of this machine: give one of {', '.join(sorted(_local_addresses()))}")
    if c.launcher.kind == "slurm" and not c.launcher.dry_run:
        _check_slurm(c)
    m = c.model
    if m.path is not None:
        from meshrl.config.hf import model_args_from_hf

        try:
            shape = model_args_from_hf(m.path)[0]
            family, longest = shape.family, shape.max_seq_len
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError("model.path", f"{m.path!r} does not load as a checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                              "point it at a Hugging Face checkpoint directory of a qwen3, qwen3_moe, llama or deepseek_v3 model") from None
        tp = c.trainer.tp
        if shape.n_heads % tp or shape.n_kv_heads % tp:
            raise ConfigError("trainer.tp", f"{tp} must divide the checkpoint's {shape.n_heads} attention heads and {shape.n_kv_heads} KV heads: pick a divisor")
        if m.max_seq_len > longest:  # the trainer's RoPE tables are the checkpoint's length; vLLM's context is max_seq_len
            raise ConfigError("model.max_seq_len", f"{m.max_seq_len} exceeds the checkpoint's max_position_embeddings={longest} ({m.path}): lower it to at most {longest}")
        if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(m.path)):
            raise ConfigError("model.path", f"{m.path!r} has a config.json but no weight files (*.safetensors): point it at a complete checkpoint directory")
    else:
        family = m.family
    if c.trainer.cp > 1 and family in MOE_FAMILIES:
        raise ConfigError("trainer.cp", f"context parallel is built for the dense families (qwen3, llama), and the policy is {family}: set trainer.cp=1")
    if c.trainer.cp > 1 and not plan.slot("trainer", 0).gpus:
        raise ConfigError("trainer.cp", "context parallel is TorchTitan's ring attention, whose kernels are CUDA's (flash, efficient or cuDNN "
                                        "attention), and this trainer runs on CPU: set trainer.cp=1 (on CPU, trainer.activation_checkpoint=full "
                                        "holds long rows)")
    if c.trainer.tp > 1 and family in MOE_FAMILIES:
        raise ConfigError("trainer.tp", f"tensor parallel is built for the dense families (qwen3, llama), and the policy is {family}: use trainer.ep for experts, or tp=1")
    if family == "deepseek_v3" and m.dtype == "float32" and plan.layout != "cpu":
        raise ConfigError("model.dtype", "deepseek_v3 generators on GPU run vLLM's MLA attention, whose CUDA backends take only "
                                         "float16 or bfloat16: set model.dtype=bfloat16")
    check_memory(c, plan)  # what every proc will hold on its GPU fits it, or one line naming the field to change
    if c.generator.return_routed_experts and family not in MOE_FAMILIES:
        raise ConfigError("generator.return_routed_experts", f"routed experts exist only in MoE models, and the policy is {family}: set it false")
    tokenizer_dir, field_path = (m.tokenizer, "model.tokenizer") if m.tokenizer else (m.path, "model.path")
    if tokenizer_dir is not None:
        from meshrl.tokenizer import load_tokenizer

        try:
            load_tokenizer(tokenizer_dir)
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, the directory is the user's to fix
            raise ConfigError(field_path, f"no tokenizer loads from {tokenizer_dir!r} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): "
                              "give a directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer_config.json)") from None
    if needs_sandbox(c):
        check_sandbox(c)  # the isolation tool works here; model-written code never runs unsandboxed
    check_user_code(c, reward_fn)


# ---- the user's data and code --------------------------------------------------------------------
_checked: set[tuple[str, int]] = set()
"""Configs (and code-passed reward functions) whose data and code passed `check_user_code`
in this process: the CLI checks before the console is quieted and `run` again, once is enough."""


def check_user_code(c: Config, reward_fn: RewardFn | None = None) -> None:
    """The data source's rows, then (contracts.probe) the env and reward function run once on
    its first record. ConfigError (kind `data error` or `contract error`) at the first problem."""
    key = (c.to_yaml(), id(reward_fn))
    if key in _checked:
        return
    record = _first_record(c)
    if c.eval.every and c.eval.source is not None and source_kind(c.eval.source) in ("file", "dataset"):
        import dataclasses

        _first_record(dataclasses.replace(c, data=dataclasses.replace(c.data, source=c.eval.source)))
    if c.contracts.probe and c.rollout.env is not None:
        _probe_env(c, record)
    elif c.contracts.probe and (reward_fn is not None or c.scoring.reward_fn is not None):
        fn, field = (reward_fn, "reward_fn") if reward_fn is not None else (import_callable(c.scoring.reward_fn), "scoring.reward_fn")
        _probe_reward(c, fn, field, record)
    if c.contracts.probe:
        for i, sc in enumerate(c.scoring.scorers):
            if sc.kind == "function" and sc.process == "none":  # a process function needs an episode's steps
                _probe_reward(c, import_callable(sc.path), f"scoring.scorers[{i}].path", record, sc.timeout_s, f"scoring.scorers[{i}].timeout_s")
            elif sc.kind == "remote":
                _probe_remote(c, sc, f"scoring.scorers[{i}].url", record)
    _checked.add(key)


def _probe_remote(c: Config, sc, field: str, record: dict) -> None:
    """One request to a remote scorer: the first record, its answer as the response."""
    from meshrl.scorers.backends import Failed, Remote
    from meshrl.scorers.client import scoring_item

    answer = record.get("answer")
    item = scoring_item(record, answer if isinstance(answer, str) else "")
    if sc.process != "none":
        item["steps"] = [item["response"]]
    (result,) = _run_probe(lambda: Remote(sc).score([item]), sc.timeout_s + 10)
    if isinstance(result, Failed):
        raise ConfigError(field, f"{result.reason}, on the first record of {c.data.source}: start the server, fix the url, "
                                 "or set contracts.probe=false", kind="contract error")


def _first_record(c: Config) -> dict:
    """The source's first record; a stored source is read row by row first (bounded by
    contracts.data_check_s), the first bad row a ConfigError `FILE:LINE: what is wrong`."""
    from meshrl.data import DataError, check_source, generator, iter_rows, _record

    d = c.data
    try:
        if source_kind(d.source) in ("file", "dataset"):
            if c.contracts.data_check_s > 0:
                first, rows, complete = check_source(d, c.contracts.data_check_s)
                if not complete:
                    import logging

                    logging.getLogger("meshrl").warning(
                        "%s: checked the first %d rows in contracts.data_check_s=%gs; the rest are checked as the run reads them",
                        d.source, rows, c.contracts.data_check_s)
                return first
            for n, row in iter_rows(d.source):
                return _record(d, f"{d.source}:{n}", row)
            raise DataError(f"{d.source}: holds no records")
        return generator(d, str(c.seed), 1)(0, 0)
    except DataError as e:
        raise ConfigError("", str(e), kind="data error") from None


def _check_env_maker(path: str, env_args: dict) -> None:
    """`rollout.env` must name an env class (with `reset` and `step`) or a function that
    makes an env from rollout.env_args."""
    maker = import_callable(path)
    if inspect.isclass(maker):
        missing = [m for m in ("reset", "step") if not callable(getattr(maker, m, None))]
        if missing:
            raise ConfigError("rollout.env", f"{path!r} is a class without {' and '.join(missing)}: expected an env class "
                              "(reset(sample) -> observation, step(turn) -> StepResult or a gym tuple; see docs/contracts.md)",
                              kind="contract error")
    elif not callable(maker):
        raise ConfigError("rollout.env", f"{path!r} is a {type(maker).__name__}, not an env class or a function returning an env",
                          kind="contract error")
    try:
        inspect.signature(maker).bind(**env_args)
    except TypeError as e:
        what = "its constructor" if inspect.isclass(maker) else "it"
        raise ConfigError("rollout.env", f"{path!r} cannot make an env from rollout.env_args {env_args}: {what} says {e}; "
                          "expected an env class, or a function returning an env, that takes rollout.env_args as keyword arguments",
                          kind="contract error") from None
    except ValueError:
        pass  # no signature to read (some builtins): the probe calls it


def _check_reward_signature(fn: Callable, field: str) -> None:
    """A reward function must be callable as fn(prompt, response, sample)."""
    if not callable(fn):
        raise ConfigError(field, f"{callable_name(fn)} is a {type(fn).__name__}, not a function", kind="contract error")
    try:
        inspect.signature(fn).bind("prompt", "response", {})
    except TypeError as e:
        raise ConfigError(field, f"reward function {callable_name(fn)} cannot be called as (prompt, response, sample): {e}; "
                          "expected def reward(prompt: str, response: str, sample: dict) -> float", kind="contract error") from None
    except ValueError:
        pass  # no signature to read: the probe calls it


def _run_probe(make: Callable[[], Any], limit_s: float) -> Any:
    """`asyncio.run(make())` on a thread of its own, abandoned after `limit_s` (a hung user
    call cannot hold the command); its exception is raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="meshrl-preflight-probe", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise TimeoutError(f"took longer than {limit_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _raised(e: BaseException, what: str) -> str:
    where = getattr(e, "where", None) or user_location(e)
    return f"{what} raised {type(e).__name__}: {first_line(str(e)) or '(no message)'}" + (f" ({where})" if where else "")


def _probe_env(c: Config, record: dict) -> None:
    """Construct the env, reset it on `record`, step it once on an empty model turn, close it."""
    r = c.rollout
    maker, timeout = import_callable(r.env), r.env_timeout_s
    source = c.data.source

    def fail(message: str) -> ConfigError:
        return ConfigError("rollout.env", message, kind="contract error")

    async def probe() -> None:
        try:
            env = maker(**r.env_args)
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise fail(_raised(e, f"making the env {r.env!r} with rollout.env_args {r.env_args}")) from None
        name = f"env {callable_name(type(env))}"
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise fail(f"{r.env!r} made {str(env)[:60]!r} ({type(env).__name__}), which has no {' or '.join(missing)} method: expected an env")
        try:
            try:
                as_observation(await call_bounded(env.reset, dict(record), timeout=timeout), env)
            except ContractError as e:
                raise fail(f"{e} ({e.where})" if e.where else str(e)) from None
            except (asyncio.TimeoutError, TimeoutError):
                raise fail(f"{name}: reset of the first record of {source} took longer than rollout.env_timeout_s={timeout:g}s") from None
            except Exception as e:  # noqa: BLE001 - the user's reset
                raise fail(_raised(e, f"{name}: reset of the first record of {source}")) from None
            try:
                as_step_result(await call_bounded(env.step, ModelTurn("", [], "stop", 0), timeout=timeout), env)
            except ContractError as e:
                raise fail(f"{e}, on an empty first model turn" + (f" ({e.where})" if e.where else "")) from None
            except Exception:  # noqa: BLE001 - an empty turn is not a real one: the run's own calls are checked
                pass
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await call_bounded(close, timeout=timeout)
                except Exception:  # noqa: BLE001 - a failing close is the env's problem alone
                    pass

    try:
        _run_probe(probe, 4 * timeout + 10)
    except TimeoutError as e:  # the whole probe (a constructor that hangs)
        raise fail(f"trying env {r.env!r} on the first record {e}: raise rollout.env_timeout_s, or set contracts.probe=false") from None


def _probe_reward(c: Config, fn: RewardFn, field: str, record: dict, timeout: float | None = None, bound: str = "scoring.timeout_s") -> None:
    """Call the reward function on `record`, its answer as the response, under the contract
    and its bound (`timeout`, the knob `bound`; default scoring.timeout_s)."""
    answer = record.get("answer")
    sample = {**record, "finish_reason": "stop", "response_ids": []}
    timeout = c.scoring.timeout_s if timeout is None else timeout
    name = f"reward function {callable_name(fn)}"

    async def probe() -> float:
        return await call_reward(fn, prompt_text(record["prompt"]), answer if isinstance(answer, str) else "", sample, timeout, bound)

    try:
        _run_probe(probe, timeout + 10)
    except ContractError as e:
        where = e.where or source_location(fn)
        raise ConfigError(field, f"{e}, on the first record of {c.data.source}" + (f" ({where})" if where else ""), kind="contract error") from None
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise ConfigError(field, f"{first_line(str(e)) or name + ' timed out'}, on the first record of {c.data.source}", kind="contract error") from None
    except Exception as e:  # noqa: BLE001 - the user's function
        raise ConfigError(field, _raised(e, f"{name}, on the first record of {c.data.source},"), kind="contract error") from None


def needs_sandbox(c: Config) -> bool:
    """Whether the run executes model-written code: a built-in task or an env marked as using the sandbox."""
    if c.rollout.env:
        try:
            return bool(getattr(import_callable(c.rollout.env), "uses_sandbox", False))
        except ImportError:
            return False  # reported by check()
    if source_kind(c.data.source) == "task":
        task = TASKS.get(c.data.source.removeprefix("task:"))
        return bool(task and task.sandbox)
    return False


def _check_source(need, c: Config, path: str, source: str, task_args: dict) -> None:
    """A prompt source that exists and whose package is installed."""
    kind = source_kind(source)
    if kind == "task":
        name = source.removeprefix("task:")
        need(name in TASKS, path, f"unknown built-in task {name!r}: use one of {', '.join('task:' + t for t in TASKS)}")
    elif kind == "reasoning_gym":
        problem = missing_extra("reasoning_gym")
        need(problem is None, path, f"{source} {problem}")
        from reasoning_gym.factory import DATASETS

        name = source.removeprefix("reasoning_gym:")
        need(name in DATASETS, path, f"reasoning-gym has no task {name!r}: see reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum, leg_counting)")
        from meshrl.data import reasoning_gym_dataset

        reasoning_gym_dataset(name, task_args, c.seed, 1, path.replace("source", "task_args"))  # bad ones: a ConfigError naming them
    elif kind == "file":
        need(os.path.isfile(source), path, f"file {source!r} not found: give a local .jsonl or .parquet file")
    else:
        need(os.path.isdir(source), path, f"{source!r} must be 'task:NAME', 'reasoning_gym:NAME', a .jsonl/.parquet file or a datasets save_to_disk directory")
        need(os.path.isfile(os.path.join(source, "dataset_info.json")) or os.path.isfile(os.path.join(source, "dataset_dict.json")), path,
             f"directory {source!r} is not a datasets save_to_disk directory (no dataset_info.json): save it with Dataset.save_to_disk")


def _check_import(need, path: str, value: str, what: str) -> None:
    """`value` must be an import path `module:name` that imports, naming `what` it should be."""
    module, sep, attr = value.partition(":")
    need(bool(sep and module and attr), path, f"{value!r} is not an import path 'module:name' of {what}")
    try:
        found = hasattr(importlib.import_module(module), attr)
        problem = f"module {module!r} has no {attr!r}"
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path to fix
        found, problem = False, f"cannot import module {module!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    need(found, path, f"{value!r}: {problem}: give an importable 'module:name' of {what}")


def _check_budget(need, c: Config) -> None:
    """The longtail tasks' longest answer must fit the generation budget and the context
    (the tail's own ranges are checked with the values, in config/checks.py)."""
    n = c.data.lengths
    budget = answer_budget(n.max, n.slack)
    need(c.generator.max_new_tokens >= budget, "generator.max_new_tokens",
         f"must be at least {budget} (the budget of the longest longtail answer, data.lengths.max x (1 + slack) + 2), got {c.generator.max_new_tokens}; "
         "raise it or lower data.lengths.max")
    need(c.model.max_seq_len >= budget + 16, "model.max_seq_len",
         f"must be at least {budget + 16} (the longest longtail answer's budget plus its prompt), got {c.model.max_seq_len}")


SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "sinfo")
"""What launcher.kind=slurm runs on the controller's machine: submit, watch, cancel, and list partitions."""


def _check_slurm(c: Config) -> None:
    """Slurm's commands on PATH, a controller that answers, and the partition asked for."""
    import shutil
    import subprocess

    missing = [cmd for cmd in SLURM_COMMANDS if shutil.which(cmd) is None]
    if missing:
        raise ConfigError("launcher.kind", f"slurm needs Slurm's commands on PATH and {', '.join(missing)} is not: run meshrl on a login node of the cluster "
                          "(or use launcher.kind=process to try the multi-host path on this machine)")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError("launcher.kind", "sinfo did not answer within 60 s: Slurm's controller is unreachable from this machine") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise ConfigError("launcher.kind", f"sinfo failed ({why}): Slurm's controller is unreachable from this machine, or SLURM_CONF points elsewhere")
    partitions = [p.rstrip("*") for p in out.stdout.split()]
    p = c.launcher.partition
    if p is not None and p not in partitions:
        raise ConfigError("launcher.partition", f"no partition {p!r} on this cluster: give one of {', '.join(partitions) or '(none listed)'}, or null for the default")
    if p is None and not any(name.endswith("*") for name in out.stdout.split()):
        raise ConfigError("launcher.partition", f"this cluster has no default partition: name one of {', '.join(partitions) or '(none listed)'}")


def _local_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family.name in ("AF_INET", "AF_INET6")}
