"""From YAML text and dotted overrides to typed config objects.

`load_yaml` reads a file into a nested dict, `apply_overrides` lays `section.field=value`
arguments over it, and `build` turns the dict into a config dataclass, coercing each value
to its field's annotated type. Everything a user can get wrong here (a missing file, bad
YAML, an unknown key, a value of the wrong type) is one `ConfigError` naming the field.
This module knows no section by name: it reads the dataclasses it is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad config value: `field` names the dotted path, the message says the fix. `kind`
    says what was found bad: the config (the default), or the user's data or code it names
    (`data error`, `contract error`: meshrl/preflight.py)."""

    def __init__(self, field_path: str, message: str, kind: str = "config error"):
        self.field_path = field_path
        self.kind = kind
        self.message = message
        super().__init__(f"{field_path}: {message}" if field_path else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same problem, its field named from `prefix` (a trained model's `models[i]`)."""
        return ConfigError(f"{prefix}.{self.field_path}" if self.field_path else prefix, self.message, self.kind)


def need(ok: bool, path: str, message: str) -> None:
    """Raise `ConfigError(path, message)` unless `ok`: one check, one line."""
    if not ok:
        raise ConfigError(path, message)


class _Loader(yaml.SafeLoader):
    """YAML as a config is read: a key given twice in one mapping is an error (PyYAML keeps the
    last, silently dropping a whole section written twice), and H:MM:SS is text (YAML 1.1
    reads an unquoted `4:00:00` as 14400 seconds, launcher.time_limit's format)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`, merged by SafeLoader itself
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):  # (SafeLoader's own error names it)
                continue
            if key in seen:
                raise DuplicateKey(None, None, f"{key!r} is given twice, keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping that names one key twice (`_Loader`)."""


_Loader.yaml_implicit_resolvers = {  # (dates stay text too: `2024-01-01` reached an env's env_args as a datetime.date)
    first: [
        (tag, regexp) for tag, regexp in resolvers if not (tag.endswith(":timestamp") or tag.endswith((":int", ":float")) and ":[0-5]?[0-9]" in regexp.pattern)
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SEXAGESIMAL_FREE = {
    # plain decimals only: YAML 1.1's octal, hex, binary and `_` forms made text fields' values
    # other text (`run_dir: 0123` became '83', `cpus: 010` core 8); such a number is refused instead
    "tag:yaml.org,2002:int": r"^[-+]?(?:0|[1-9][0-9]*)$",
    # and `1e-3`, `1.5e3` numbers, as YAML 1.2 reads them (1.1 wants a dot and a signed exponent: env_args got text)
    "tag:yaml.org,2002:float": (
        r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)|[-+]?[0-9][0-9_]*\.[0-9_]*"
        r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
}
for _tag, _pattern in _SEXAGESIMAL_FREE.items():
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern, re.X), list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """YAML that both `_Loader` and a plain YAML 1.1 reader read back as written: text either
    would read as another type is quoted (`1e3` for this one, `24:00:00` or `0123` for the other)."""


_Dumper.yaml_implicit_resolvers = {first: list(resolvers) for first, resolvers in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_SEXAGESIMAL_FREE["tag:yaml.org,2002:float"], re.X), list("-+0123456789."))


def dump_yaml(data: Any) -> str:
    """`data` as YAML text that `parse_yaml` reads back as it is (RUN_DIR/config.yaml, a resume's)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def parse_yaml(text) -> Any:
    """YAML text (or an open file) as `_Loader` reads it."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("", f"config file {str(path)!r} not found: pass the path of a YAML file (see configs/)")
    try:
        with open(path, encoding="utf-8") as f:
            data = parse_yaml(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = e.problem if isinstance(e, DuplicateKey) else "fix the syntax"
        raise ConfigError("", f"{path} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as e:  # a Latin-1 comment
        raise ConfigError("", f"{path} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}): save it as UTF-8") from None
    except ValueError as e:  # `!!int abc`
        raise ConfigError("", f"{path} holds a value its YAML tag cannot make ({str(e).splitlines()[0][:120]}): fix or untag it") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping of config sections, not a {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) onto a nested dict copy."""
    data = _deepcopy_dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("", f"override {item!r} must look like section.field=value")
        node = data
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            name, index = _indexed(part)
            if index is None and node.get(name) is None:  # (a section written empty: its defaults)
                node[name] = {}
            child = node[name] if index is None else _entry(node.get(name), index, ".".join([*parts[:i], name]))
            if isinstance(child, list):
                rest = parts[i + 1 :]
                entry = f"{part}[{rest.pop(0) if rest[0].isdigit() else 0}]"
                raise ConfigError(".".join(parts[: i + 1]), f"is a list: name one entry, as {'.'.join([*parts[:i], entry, *rest])}=...")
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section: remove the trailing keys")
            node = child
        try:  # text with a `#` stays whole: YAML read `runs/exp #2` as `runs/exp` and `#t` as null
            plain = raw.lstrip()[:1] not in ("'", '"', "[", "{")  # (quoted, a list or a mapping: YAML reads its # as text)
            value = EMPTY if not raw.strip() else raw if plain and (raw.lstrip().startswith("#") or " #" in raw) else parse_yaml(raw)
        except (yaml.YAMLError, ValueError):  # (`!!int abc`: the field's own check names it)
            value = raw
        name, index = _indexed(parts[-1])
        if index is None:
            node[name] = value
        else:  # one entry replaced whole
            _entry(node.get(name), index, ".".join([*parts[:-1], name]))
            node[name][index] = value
    return data


class _Empty(str):
    """The value of `section.field=` with nothing after the `=`: the empty string for a text field
    (`trainer.cpus=`: no pinning), null for one that may be null, and null elsewhere."""


EMPTY = _Empty()


def _plain(value: Any) -> Any:
    """`value` with each EMPTY inside it null (a free-form mapping's entry, as `rollout.env_args.x=`)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return None if isinstance(value, _Empty) else value


def _indexed(part: str) -> tuple[str, int | None]:
    """`models[1]` -> ("models", 1): an override's step into one entry of a list section."""
    match = re.fullmatch(r"(\w+)\[(\d+)\]", part)
    return (match[1], int(match[2])) if match else (part, None)


def _entry(items: Any, index: int, path: str) -> Any:
    if not isinstance(items, list) or index >= len(items):
        count = len(items) if isinstance(items, list) else 0
        raise ConfigError(f"{path}[{index}]", f"no such entry: the config's {path} has {count}; add it in the config file (or `{path}=[...]`)")
    return items[index]


def _deepcopy_dict(data: Any) -> Any:
    if isinstance(data, list):
        return [_deepcopy_dict(v) for v in data]
    return {k: _deepcopy_dict(v) for k, v in data.items()} if isinstance(data, dict) else data


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """The dataclass `cls` from a mapping (or an instance of it), every value coerced to its
    field's type; `prefix` is the dotted path of `cls` in the tree, for error messages."""
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping of fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = _closest(str(key), names)
            hint = f"; did you mean {close!r}?" if close else f"; known fields: {', '.join(names)}"
            raise ConfigError(dotted(prefix, str(key)), f"unknown field{hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            section = f.metadata.get("overrides")  # a mapping of overrides of that section (TrainedModelConfig's)
            value = _typed_empties(section, data[f.name]) if section is not None and isinstance(data[f.name], dict) else data[f.name]
            kwargs[f.name] = _coerce(hints[f.name], value, dotted(prefix, f.name))
    return cls(**kwargs)


def _typed_empties(cls: type, overrides: dict) -> dict:
    """`overrides` of section `cls` with each `field=` (EMPTY) typed as `cls` types it: the
    empty string for a text field (`models[0].trainer.cpus=`: no pinning), else null."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in overrides.items():
        tp = hints.get(key)
        if isinstance(value, _Empty):
            value = "" if tp is str else None
        elif isinstance(value, dict) and dataclasses.is_dataclass(tp):
            value = _typed_empties(tp, value)
        out[key] = value
    return out


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(value, _Empty):
        value = "" if tp is str else None
    if dataclasses.is_dataclass(tp):
        return build(tp, {} if value is None else value, path)  # a section written empty (`trainer:`, its keys commented out): its defaults
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1 and "expected" not in str(errors[0]):  # its one type's own problem (a number not finite)
            raise errors[0]
        raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return _plain(value)
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    if origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)
            return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(path, f"expected a list, got {_describe(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {_describe(value)}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(path, f"expected a number, got {_describe(value)}")
        need(math.isfinite(number), path, f"must be a finite number, got {value!r}")  # no knob takes inf or nan
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # YAML reads `cpus: 3` or `x=3` as a number; the text is meant
        raise ConfigError(path, f"expected a string, got {_describe(value)}")
    raise ConfigError(path, f"unsupported type {tp!r}")  # a meshrl bug, not a user error


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args) + " or null"


def dotted(prefix: str, name: str) -> str:
    """The dotted path of field `name` under section `prefix` (`""` at the top level)."""
    return f"{prefix}.{name}" if prefix else name


def _closest(name: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None
