"""Config loading, validation, the CLI's error contract, and the generated reference."""

import dataclasses
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from meshrl.config import Config, ConfigError, ScorerConfig, apply_overrides, field_docs, reference_markdown
from meshrl.config.loading import parse_yaml
from meshrl.preflight import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def meshrl_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshrl", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_default_yaml_is_the_embedded_default():
    assert Config.from_yaml(os.path.join(ROOT, "configs/default.yaml")) == Config()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs/*.yaml"))))
def test_every_shipped_config_shows(path):
    out = meshrl_cli("config", "show", path)
    assert out.returncode == 0, out.stderr
    shown = Config.from_dict(yaml.safe_load(out.stdout))
    assert shown == Config.from_yaml(path)


def test_overrides_dict_and_code_agree():
    a = Config.from_dict(apply_overrides({}, ["trainer.lr=1e-5", "buffer.max_lag=null", "trainer.loss.correction=icepop"]))
    b = Config.from_dict({"trainer": {"lr": 1e-5, "loss": {"correction": "icepop"}}, "buffer": {"max_lag": None}})
    c = Config()
    c.trainer.lr = 1e-5
    c.buffer.max_lag = None
    c.trainer.loss.correction = "icepop"
    assert a == b == c
    assert a.trainer.lr == 1e-5 and isinstance(a.trainer.lr, float)


def test_the_single_turn_longtail_task_ignores_its_chat_rounds():
    """task:longtail was refused for data.lengths.turns_max above rollout.max_turns: rounds it never plays."""
    Config.from_dict({"data": {"source": "task:longtail", "lengths": {"max": 8}}, "rollout": {"max_turns": 2}})


def test_an_empty_override_is_the_empty_text_of_a_text_field_and_null_elsewhere():
    """`trainer.cpus=` (documented: empty, no pinning) was read as null and refused."""
    c = Config.from_dict(apply_overrides({"eval": {"source": "task:digits"}}, ["trainer.cpus=", "generator.cpus=", "eval.source=", "rollout.env_args.x="]))
    assert (c.trainer.cpus, c.generator.cpus, c.eval.source, c.rollout.env_args) == ("", "", None, {"x": None})
    assert type(c.trainer.cpus) is str and "cpus: ''" in c.to_yaml()
    with pytest.raises(ConfigError, match="steps: expected an integer, got null"):
        Config.from_dict(apply_overrides({}, ["steps="]))
    with pytest.raises(ConfigError, match="logging.run_dir: is empty"):  # not the working directory
        Config.from_dict(apply_overrides({}, ["logging.run_dir="]))
    # a trained model's sections are typed as the policy's: `models[0].trainer.cpus=` was null there, and refused
    game = {"data": {"source": "task:propose"}, "models": [{"name": "proposer"}]}
    c = Config.from_dict(apply_overrides(game, ["models[0].trainer.cpus=", "models[0].model.path="]))
    assert c.models[0].trainer == {"cpus": ""} and c.models[0].model == {"path": None} and c.for_model("proposer").trainer.cpus == ""
    assert Config.from_dict(parse_yaml(c.to_yaml())).models[0].trainer["cpus"] == ""  # (config.yaml, read back)


@pytest.mark.parametrize(
    "data, field, words",
    [
        ({"trainer": {"lrr": 1}}, "trainer.lrr", "did you mean 'lr'"),
        ({"nosuch": {}}, "nosuch", "unknown field"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr", "expected a number"),
        ({"trainer": {"procs": 2.5}}, "trainer.procs", "expected an integer"),
        ({"trainer": {"procs": True}}, "trainer.procs", "expected an integer"),
        ({"generator": {"update_mode": "pause"}}, "generator.update_mode", "must be one of"),
        ({"generator": {"temperature": 0.001}}, "generator.temperature", "at least 0.01 (vLLM's floor)"),  # vLLM sampled at 0.01, the trainer scored at 0.001
        ({"trainer": {"procs": 3, "dp_shard": 2}}, "trainer.procs", "not divisible"),
        ({"trainer": {"procs": 2, "ep": 2}}, "trainer.ep", "MoE"),
        ({"trainer": {"pace": {"every": 0}}}, "trainer.pace.every", "at least 1"),
        ({"trainer": {"pace": {"every": 2, "steps": 3}}}, "trainer.pace.steps", "1 to trainer.pace.every=2"),
        (
            {"data": {"source": "task:propose"}, "models": [{"name": "p", "trainer": {"pace": {"every": 2, "offset": 2}}}]},
            "models[0].trainer.pace.offset",
            "0 to",
        ),
        ({"steps": 6, "trainer": {"pace": {"every": 10, "offset": 7}}}, "trainer.pace.offset", "past the run's steps=6"),
        ({"data": {"source": "task:propose"}, "models": [{"name": "alarm"}]}, "models[0].name", "the run's own metrics prefix"),
        (
            {"models": [{"name": "b", "frozen": True, "model": {"path": "ckpt/b"}, "generator": {"replicaz": 2}}]},
            "models[0].generator.replicaz",
            "did you mean",
        ),
        # a run-wide field that a model's view refuses is named as it is, with the model (models[i] has no lora of its own)
        (
            {"data": {"source": "task:propose"}, "lora": {"rank": 4}, "models": [{"name": "m", "trainer": {"loss": {"advantage": "gae"}}}]},
            "lora.rank",
            "(with models[0], m)",
        ),
        ({"scoring": {"scorers": [{"kind": "prm", "name": "x/../../b/hf/final"}]}}, "scoring.scorers[0].name", "a short name"),
        (
            {"generator": {"group_size": 1}, "trainer": {"loss": {"advantage": "grpo_no_std"}}, "scoring": {"scorers": [{"kind": "prm"}]}},
            "generator.group_size",
            "leave-one-out",
        ),
        # one completion per prompt: every group advantage 0, nothing trained where no teacher adds a per-token term
        ({"generator": {"group_size": 1}, "trainer": {"loss": {"advantage": "grpo_no_std"}}}, "generator.group_size", "makes every advantage 0"),
        ({"data": {"source": "task:propose"}, "models": [{"name": "p", "trainer": {"loss": "grpo"}}]}, "models[0].trainer.loss", "mapping"),
        ({"data": {"source": "task:propose"}, "models": [{"name": "p", "trainer": {"loss": [1]}}]}, "models[0].trainer.loss", "mapping"),
        ({"data": {"source": "task:propose"}, "models": [{"name": "p", "model": {"dim": 65}}]}, "models[0].model.dim", "divisible"),
        # no knob takes an infinite or undefined number
        ({"trainer": {"lr": float("inf")}}, "trainer.lr", "finite"),
        ({"trainer": {"loss": {"entropy_coef": float("nan")}}}, "trainer.loss.entropy_coef", "finite"),
        ({"buffer": {"get_timeout_s": float("nan")}}, "buffer.get_timeout_s", "finite"),
        ({"trainer": {"loss": {"advantage": "gae"}}, "generator": {"group_size": 0}}, "generator.group_size", "must be at least 1"),
        ({"buffer": {"max_lag": -1}}, "buffer.max_lag", "at least 0"),
        ({"data": {"source": "task:propose"}, "eval": {"every": 5}}, "eval.source", "is a game"),  # self-play: every score read 0
        ({"eval": {"every": 5, "source": "task:propose"}}, "eval.source", "is a game"),
        ({"data": {"source": "task:code"}, "rollout": {"env_args": {"max_tool_calls": 0}}}, "rollout.env_args", "only rollout.env"),  # read by nothing
        ({"seed": -1}, "seed", "from 0 to 2147483647"),  # vLLM's engines failed on it once the meshes were up
        ({"seed": 2**32}, "seed", "from 0 to 2147483647"),
        ({"buffer": {"depth": -1}}, "buffer.depth", "at least 0"),
        ({"buffer": {"depth": 0}}, "generator.update_mode", "'block'"),
        ({"model": {"path": "/no/such/dir"}}, "model.path", "not found"),
        ({"model": {"dim": 60, "n_heads": 7}}, "model.dim", "divisible"),
        ({"data": {"source": "prompts.csv"}}, "data.source", ".jsonl"),
        ({"scoring": {"reward_fn": "not_an_import_path"}}, "scoring.reward_fn", "import path 'module:name'"),
        ({"scoring": {"reward_fn": "no_such_module_xyz:score"}}, "scoring.reward_fn", "cannot import module 'no_such_module_xyz'"),
        ({"scoring": {"reward_fn": "meshrl.tasks:no_such_reward"}}, "scoring.reward_fn", "has no 'no_such_reward'"),
        ({"lora": {"rank": 8, "targets": ["qkv"]}}, "lora.targets", "unknown ['qkv']"),
        ({"lora": {"rank": 8, "targets": ["k_proj"]}}, "lora.targets", "go together"),
        ({"lora": {"rank": -1}}, "lora.rank", "[0, 512]"),
        ({"lora": {"rank": 8, "dropout": 1.0}}, "lora.dropout", "[0, 1)"),
        ({"lora": {"rank": 8}, "model": {"family": "deepseek_v3"}}, "lora.targets", "deepseek_v3"),
        # fields the episode redesign removed
        ({"scoring": {"replicas": 2}}, "scoring.replicas", "unknown field"),
        ({"buffer": {"when_full": "block"}}, "buffer.when_full", "unknown field"),
        ({"buffer": {"put_timeout_s": 60}}, "buffer.put_timeout_s", "unknown field"),
        ({"buffer": {"sampling": "no_such_module_xyz:pick"}}, "buffer.sampling", "cannot import"),
        # the rollout section
        ({"rollout": {"env": "no_such_module_xyz:MazeEnv"}}, "rollout.env", "cannot import module 'no_such_module_xyz'"),
        ({"rollout": {"env": "meshrl.tasks:NoSuchEnv"}}, "rollout.env", "has no 'NoSuchEnv'"),
        ({"rollout": {"env": "meshrl.tasks.GuessEnv"}}, "rollout.env", "import path 'module:name'"),
        ({"rollout": {"env_args": ["x"]}}, "rollout.env_args", "mapping"),
        ({"rollout": {"workers": 0}}, "rollout.workers", "at least 1"),
        ({"rollout": {"groups_per_worker": -1}}, "rollout.groups_per_worker", "at least 0"),
        ({"rollout": {"max_turns": 0}}, "rollout.max_turns", "at least 1"),
        ({"generator": {"tp": 3}}, "generator.tp", "must divide the model's 2 attention heads"),  # vLLM refused it at the engine's start
        ({"rollout": {"env_timeout_s": 0}}, "rollout.env_timeout_s", "positive"),
        ({"rollout": {"tool_parser": "xml"}}, "rollout.tool_parser", "'hermes', 'compact' or a parser function"),
        ({"rollout": {"enviroment": "x"}}, "rollout.enviroment", "unknown field"),
        # a multi-turn task's env gives its reward
        ({"data": {"source": "task:calc"}, "scoring": {"reward_fn": "tests.test_data_scoring:exact"}}, "scoring.reward_fn", "multi-turn"),
        ({"data": {"source": "task:guess"}, "scoring": {"reward_model": "/"}}, "scoring.reward_fn", "multi-turn"),
        ({"trainer": "fast"}, "trainer", "mapping"),
        ({"trainer": {"cpus": "0-x"}}, "trainer.cpus", "CPU list"),
        ({"trainer": {"cpus": "3-1"}}, "trainer.cpus", "backwards"),
        ({"generator": {"cpus": "4096"}}, "generator.cpus", "do not exist here"),
        ({"generator": {"tp": 2, "cpus": "0"}}, "generator.cpus", "at least 2 cores"),
        # the longtail tasks' tail must fit the budget and the context
        ({"data": {"source": "task:longtail"}}, "generator.max_new_tokens", "at least 202"),
        ({"data": {"source": "task:longtail", "lengths": {"max": 4}}}, "data.lengths.max", "at least data.lengths.median"),
        (
            {"data": {"source": "task:longtail_chat", "lengths": {"max": 8, "turns_max": 9}}, "generator": {"max_new_tokens": 12}},
            "data.lengths.turns_max",
            "rollout.max_turns",
        ),
        (
            {"data": {"source": "task:longtail", "lengths": {"max": 100}}, "generator": {"max_new_tokens": 128}, "model": {"max_seq_len": 140}},
            "model.max_seq_len",
            "at least 143",
        ),
    ],
)
def test_bad_values_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as info:
        check(Config.from_dict(data))  # the values' own checks, then the domain's
    assert info.value.field_path == field
    assert words in str(info.value)


def test_an_override_names_one_entry_of_a_list_section():
    """`models[i].x=v` on the command line changes that entry of the config's list, as the
    error messages name it; an entry the config lacks, or `models.0.x`, is one line saying how."""
    base = {"models": [{"name": "proposer", "trainer": {"lr": 1e-3}}]}
    data = apply_overrides(base, ["models[0].trainer.lr=0.0003", "models[0].generator.replicas=2"])
    assert data["models"][0] == {"name": "proposer", "trainer": {"lr": 0.0003}, "generator": {"replicas": 2}}
    assert base["models"][0] == {"name": "proposer", "trainer": {"lr": 1e-3}}  # the config's own list is left as it was
    assert apply_overrides(base, ["models[0]={name: solver}"])["models"] == [{"name": "solver"}]  # an entry replaced whole
    with pytest.raises(ConfigError, match=r"^models\[1\]: no such entry: the config's models has 1"):
        apply_overrides(base, ["models[1].trainer.lr=1"])
    with pytest.raises(ConfigError, match=r"^models\[1\]: no such entry"):
        apply_overrides(base, ["models[1]={name: solver}"])
    with pytest.raises(ConfigError, match=r"^models: is a list: name one entry, as models\[0\].trainer.lr="):
        apply_overrides(base, ["models.0.trainer.lr=1"])


def test_building_a_config_imports_no_domain():
    """Config.from_dict checks only what the values show: a config naming an unknown task
    builds without importing meshrl.tasks or torch, and preflight's `check` refuses it."""
    code = textwrap.dedent("""
        import sys
        from meshrl.config import Config, ConfigError
        config = Config.from_dict({"data": {"source": "task:nosuch"}})
        assert "meshrl.tasks" not in sys.modules and "torch" not in sys.modules
        from meshrl.preflight import check
        try:
            check(config)
        except ConfigError as e:
            print(e.field_path)
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    field, message = done.stdout.strip().splitlines()
    assert field == "data.source" and "unknown built-in task 'nosuch'" in message


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  procs: 3\n  dp_shard: 2\n")
    for args in (["config", "show", str(bad)], ["config", "show", "trainer.lr=abc"], ["run", "nosuch.yaml"], ["run", "buffer.max_lag=-2"]):
        out = meshrl_cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [unclosed\n")
    out = meshrl_cli("config", "show", str(broken))
    assert out.returncode == 2 and "not valid YAML" in out.stderr
    # `meshrl eval` fills in sections of its own: one written as a value is refused as `run` refuses it (a traceback, exit 1)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (tmp_path / "e.yaml").write_text("eval: 3\n")
    (tmp_path / "empty.yaml").write_text("eval:\n#  k: 4\nlogging:\n")  # written empty: defaults, as `run` reads it
    out = meshrl_cli("eval", str(checkpoint), str(tmp_path / "empty.yaml"))
    assert "must be a mapping" not in out.stderr, out.stderr
    for arg, field in ((str(tmp_path / "e.yaml"), "eval"), ("logging=x", "logging"), ("generator=[1]", "generator")):
        out = meshrl_cli("eval", str(checkpoint), arg)
        assert out.returncode == 2 and out.stderr.startswith(f"meshrl: config error: {field}: must be a mapping"), out.stderr
    # nor does it replace an override without a word: those of the fields it sets are refused
    for arg, field in (("generator.replicas=2", "generator.replicas"), ("logging.run_dir=/x", "logging.run_dir"), ("launcher.kind=slurm", "launcher.kind")):
        out = meshrl_cli("eval", str(checkpoint), arg)
        assert out.returncode == 2 and out.stderr.startswith(f"meshrl: config error: {field}: meshrl eval sets it"), out.stderr
    # a section written empty (its keys commented out) is its defaults, and an override goes into it
    empty = tmp_path / "empty.yaml"
    empty.write_text("trainer:\n#  lr: 1.0e-4\nsteps: 3\n")
    assert Config.from_yaml(str(empty)) == Config.from_dict({"steps": 3})
    assert Config.from_yaml(str(empty), ["trainer.lr=0.5"]).trainer.lr == 0.5


def test_overrides_and_files_read_as_written(tmp_path):
    """`runs/exp #2` lost its `#2` (a YAML comment) and `#t` became null; `1e-3` and `1.5e3` stayed
    text and a date became a datetime.date in env_args; a Latin-1 comment or `!!int abc` ended in
    a traceback (exit 1); a list's hint dropped its section (`scorers[0].path`, refused in turn)."""
    from meshrl.config.loading import apply_overrides, load_yaml

    data = apply_overrides({}, ["logging.run_dir=runs/exp #2", "model.tokenizer=#t", "x.a=1e-3", "x.b=1.5e3", "x.c=2024-01-01", "x.d=1e5x"])
    assert data["logging"]["run_dir"] == "runs/exp #2" and data["model"]["tokenizer"] == "#t"
    assert data["x"] == {"a": 0.001, "b": 1500.0, "c": "2024-01-01", "d": "1e5x"}
    (tmp_path / "latin.yaml").write_bytes(b"steps: 5   # caf\xe9\n")
    (tmp_path / "tag.yaml").write_text("steps: !!int abc\n")
    for name, why in (("latin.yaml", "is not UTF-8 text"), ("tag.yaml", "holds a value its YAML tag cannot make")):
        with pytest.raises(ConfigError, match=why):
            load_yaml(tmp_path / name)
    with pytest.raises(ConfigError, match=re.escape("name one entry, as scoring.scorers[0].path=...")):
        apply_overrides({"scoring": {"scorers": [{"kind": "reward_model"}]}}, ["scoring.scorers.0.path=/x"])
    assert apply_overrides({"scoring": {"scorers": [{"kind": "reward_model"}]}}, ["scoring.scorers[0].path=/x"])["scoring"]["scorers"][0]["path"] == "/x"


def test_a_key_given_twice_is_refused_and_a_time_is_text(tmp_path):
    """A section written twice in one file: refused naming it and its line, where YAML kept the
    second alone and the first's values (a learning rate) silently went back to defaults. An
    unquoted H:MM:SS stays text (YAML 1.1 read `4:00:00` as 14400 seconds), in a file and an
    override, and so does an octal, hex or underscored number."""
    from meshrl.config.loading import load_yaml

    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  lr: 1.0e-5\nsteps: 3\ntrainer:\n  checkpoint_every: 10\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 4: 'trainer' is given twice, keep one"):
        load_yaml(twice)
    merged = tmp_path / "merged.yaml"  # an anchor merged into a section (`<<: *base`) is no key given twice
    merged.write_text("base: &base {lr: 0.001, warmup_steps: 2}\ntrainer:\n  <<: *base\n  lr: 0.002\n")
    assert load_yaml(merged)["trainer"] == {"lr": 0.002, "warmup_steps": 2}
    hours = tmp_path / "hours.yaml"
    hours.write_text("launcher:\n  kind: slurm\n  time_limit: 4:00:00\n")
    assert Config.from_dict(load_yaml(hours)).launcher.time_limit == "4:00:00"
    assert Config.from_dict(apply_overrides({}, ["launcher.kind=slurm", "launcher.time_limit=12:00:00"])).launcher.time_limit == "12:00:00"
    assert apply_overrides({}, ["trainer.lr=1.0e-5", "steps=7", "x.y=0x10"]) == {"trainer": {"lr": 1e-5}, "steps": 7, "x": {"y": "0x10"}}
    # a number only as plain decimals: a text field keeps what was written (YAML 1.1 made
    # `run_dir: 0123` the text '83', `cpus: 010` core 8), and a number field refuses the rest
    written = tmp_path / "written.yaml"
    written.write_text("logging:\n  run_dir: 0123\n")
    c = Config.from_dict(apply_overrides(load_yaml(written), ["logging.wandb_project=2024_05"]))
    assert (c.logging.run_dir, c.logging.wandb_project) == ("0123", "2024_05")
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got str '0x10'"):
        Config.from_dict(apply_overrides({}, ["steps=0x10"]))


def test_rollout_section_and_what_it_allows(tmp_path):
    c = Config()
    assert (c.rollout.workers, c.rollout.env, c.rollout.env_args, c.rollout.max_turns, c.rollout.tool_parser) == (1, None, {}, 8, "hermes")
    assert not hasattr(c.scoring, "replicas") and not hasattr(c.buffer, "when_full") and not hasattr(c.buffer, "put_timeout_s")
    # a user's env by import path, with its arguments; it may bring its own reward
    user = checked(
        apply_overrides({}, ["rollout.env=meshrl.tasks:GuessEnv", "rollout.env_args={config: null}", "rollout.tool_parser=tests.test_config:no_calls"])
    )
    assert user.rollout.env == "meshrl.tasks:GuessEnv" and user.rollout.env_args == {"config": None}
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "?", "answer": "3"}\n')
    assert checked({"data": {"source": str(rows)}, "rollout": {"env": "meshrl.tasks:GuessEnv"}}).scoring.reward_fn is None
    with pytest.raises(ConfigError) as info:
        check(Config.from_dict({"data": {"source": str(rows)}}))
    assert info.value.field_path == "scoring.reward_fn" and "rollout.env" in str(info.value)
    # a multi-turn task plays its own env; with rollout.env set, a reward function may come along
    assert checked({"data": {"source": "task:calc"}, "rollout": {"tool_parser": "compact"}}).data.source == "task:calc"
    checked({"data": {"source": "task:calc"}, "rollout": {"env": "meshrl.tasks:GuessEnv"}, "scoring": {"reward_fn": "tests.test_data_scoring:exact"}})


def checked(data: dict) -> Config:
    """The config built from `data` and through preflight's domain checks."""
    config = Config.from_dict(data)
    check(config)
    return config


def no_calls(text):
    return []


def test_tool_use_config_is_the_multi_turn_default():
    path = os.path.join(ROOT, "configs/tool-use.yaml")
    assert path in glob.glob(os.path.join(ROOT, "configs/*.yaml"))  # so test_every_shipped_config_shows covers it
    c = Config.from_yaml(path)
    assert c.data.source == "task:calc" and c.rollout.tool_parser == "compact" and c.rollout.max_turns >= 2


def test_cli_bad_import_paths_are_one_line_before_any_mesh(tmp_path):
    """A bad rollout.env or scoring.reward_fn stops `meshrl run` at once: one line naming the
    field, exit 2, and no run directory made (nothing was started)."""
    run_dir = tmp_path / "run"
    for override, field in [("rollout.env=no_such_module_xyz:MazeEnv", "rollout.env"), ("scoring.reward_fn=no_such_module_xyz:score", "scoring.reward_fn")]:
        out = meshrl_cli("run", override, f"logging.run_dir={run_dir}")
        assert out.returncode == 2, (override, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert field in lines[0] and override.split("=")[1] in lines[0], lines[0]
        assert not run_dir.exists()


def test_cli_unusable_paths_are_one_line_before_any_mesh(tmp_path):
    """A run directory that cannot be written, and model or tokenizer directories that do
    not load, stop `meshrl run` with one line naming the field, exit 2, before anything starts."""
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text('{"model_type": "bert", "vocab_size": 10}')
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(
        '{"model_type": "qwen3", "vocab_size": 128, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8}'
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    for override, field in [
        ("logging.run_dir=/proc/meshrl-cannot-write", "logging.run_dir"),
        (f"logging.run_dir={blocker}/run", "logging.run_dir"),
        (f"model.path={not_a_model}", "model.path"),
        (f"model.path={no_weights}", "model.path"),
        (f"model.tokenizer={empty}", "model.tokenizer"),
        # the default policy is dense: it has no experts to return
        ("generator.return_routed_experts=true", "generator.return_routed_experts"),
    ]:
        args = [override] if override.startswith("logging.") else [override, f"logging.run_dir={run_dir}"]
        out = meshrl_cli("run", *args)
        assert out.returncode == 2, (override, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr and field in lines[0], (override, out.stderr)
        assert not run_dir.exists(), "a refused config left its run directory behind"


def test_a_resume_whose_checkpoint_is_gone_or_a_dry_one_changes_nothing(tmp_path, capsys):
    """`--resume` of a run whose latest checkpoint file is gone: one line naming --resume (the
    CLI's exit 2, as every ConfigError). A dry run of a resume checks and describes the job:
    no file of the run is written or changed. A resume given a config too is refused, as the
    CLI refuses it."""
    import meshrl
    from meshrl.resume import resume_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(Config().to_yaml())
    (run / "checkpoints" / "latest").write_text("loop-3.pt")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"^--resume: .*: its latest checkpoint cannot be read \(.*loop-3.pt"):
        resume_config(str(run))
    torch.save({"step": 3}, run / "checkpoints" / "loop-3.pt")
    result = meshrl.run(resume=str(run), overrides=["launcher.dry_run=true"])
    assert result.metrics == [] and "launcher.kind=local" in capsys.readouterr().out  # the job it would start
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "loop-3.pt"}
    assert after == before, "a dry run changed the run it was to resume"
    for call in (lambda: meshrl.run("configs/default.yaml", resume=str(run)), lambda: meshrl.Session({"steps": 5}, resume=str(run))):
        with pytest.raises(ConfigError, match=r"^--resume: a resumed run uses RUN_DIR/config.yaml: pass only overrides"):
            call()  # the config given would be dropped without a word


def test_every_field_is_documented_and_reference_is_current():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                walk(type(getattr(cls(), f.name)))

    walk(Config)
    walk(ScorerConfig)  # the items of scoring.scorers
    with open(os.path.join(ROOT, "docs/config.md")) as f:
        assert f.read() == reference_markdown() + "\n", "docs/config.md is stale: run `meshrl config docs > docs/config.md`"


def test_config_docs_check_of_a_missing_file_is_one_line(tmp_path):
    from meshrl.cli import main

    assert main(["config", "docs", "--check", str(tmp_path / "missing.md")]) == 2


def test_every_link_in_the_readmes_and_docs_resolves():
    """Each relative link of README.md, docs/, benchmarks/, tests/ and examples/ names a file
    that exists, and each `#anchor` a heading of its page (GitHub's slugs)."""
    import re

    def anchors(path: str) -> set[str]:
        text, seen = re.sub(r"```.*?```", "", open(path).read(), flags=re.S), {}
        for heading in re.findall(r"^#{1,6} (.*)$", text, flags=re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"

    pages = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    pages += [os.path.join(ROOT, "benchmarks", "README.md"), os.path.join(ROOT, "tests", "README.md")]
    pages += glob.glob(os.path.join(ROOT, "examples", "**", "*.md"), recursive=True)
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", open(page).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(dest) or (anchor and dest.endswith(".md") and anchor not in set(anchors(dest))):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert len(pages) > 10 and not broken, broken


def test_a_new_run_keeps_the_earlier_run_in_its_directory_whole(tmp_path):
    """`keep_earlier_run`: a RUN_DIR holding an earlier run (its config.yaml) is moved aside
    whole, to a name of its own each time; a directory without one (no run, or this run's
    own log already there) stays where it is. A new config that reads a file of the earlier
    run is refused in one line naming that field, before anything moves, and so is a run
    directory a live run holds."""
    from meshrl.controller.checkpoint import keep_earlier_run

    run = tmp_path / "latest"
    config = Config.from_dict({"logging": {"run_dir": str(run)}})
    (run / "logs").mkdir(parents=True)
    assert keep_earlier_run(config) is None and run.exists()
    kept = []
    for _ in range(2):
        (run / "hf" / "final").mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text("steps: 3\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        reads = Config.from_dict({"logging": {"run_dir": str(run)}, "model": {"tokenizer": str(run / "hf" / "final")}})
        with pytest.raises(ConfigError, match=r"^model.tokenizer: .* lies in logging.run_dir, which holds an earlier run"):
            keep_earlier_run(reads)
        kept.append(keep_earlier_run(config))
        assert not run.exists() and os.path.isfile(os.path.join(kept[-1], "metrics.jsonl"))
    assert kept[0] != kept[1] and all(os.path.basename(k).startswith("latest.") for k in kept)
    # a live run's directory (its lock held: hold_run_dir) is neither moved nor taken by a second run
    from meshrl.controller.checkpoint import hold_run_dir

    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("steps: 3\n")
    held = hold_run_dir(str(run))
    for call in (lambda: keep_earlier_run(config), lambda: hold_run_dir(str(run))):
        with pytest.raises(ConfigError, match=r"^logging.run_dir: .* is a live run's .*: stop that run first, or give this one another logging.run_dir"):
            call()
    assert (run / "config.yaml").is_file()
    os.close(held)  # the run stopped
    assert keep_earlier_run(config) is not None and not run.exists()
