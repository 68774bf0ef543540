"""The config reference, generated from the code: each field's type, default and docstring.

A field's docstring is the string literal right below it (config/sections.py, config/models.py); `field_docs`
reads them from the source, and `reference_markdown` renders the whole tree as the
Markdown of docs/config.md (`meshrl config docs`), so the reference cannot drift.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import inspect
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from meshrl.config.loading import dotted
from meshrl.config.sections import Config


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of a config dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def reference_markdown() -> str:
    """The config reference as Markdown: every section, field, type, default and docstring."""
    lines = [
        "# meshrl config reference",
        "",
        "Generated from the docstrings in `meshrl/config/sections.py` and `meshrl/config/models.py` by `meshrl config docs`; do not edit by hand.",
        "Set fields in YAML (nested sections), in a dict passed to `meshrl.run`, or on the command line as `section.field=value`.",
        "",
    ]

    def section(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        nested = []
        lines.append(f"## `{prefix or 'top level'}`")
        lines.append("")
        lines.append("| field | type | default | meaning |")
        lines.append("|---|---|---|---|")
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((tp, dotted(prefix, f.name)))
                continue
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
            if dataclasses.is_dataclass(item):  # a list of sections: its items' fields follow as `path[]`
                nested.append((item, dotted(prefix, f.name) + "[]"))
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = (
                json.dumps(default)
                if isinstance(default, str) and "\n" in default
                else yaml.safe_dump(default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
            )
            lines.append(f"| `{dotted(prefix, f.name)}` | {_show_type(tp)} | `{shown}` | {docs.get(f.name, '')} |")
        lines.append("")
        for tp, path in nested:
            section(tp, path)

    section(Config, "")
    return "\n".join(lines)


def _show_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_show_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"list of {_show_type(typing.get_args(tp)[0])}"
    return tp.__name__
