"""The code base is formatted and linted by ruff, with the settings in pyproject.toml, every
relative link of the README and the docs resolves, to a file and to a heading, and what the
benchmarks, scripts and examples import from meshrl exists."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["meshrl", "tests", "benchmarks", "scripts", "examples"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_is_formatted():
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format {' '.join(PATHS)}`:\n{out.stdout[-3000:]}{out.stderr[-2000:]}"


def test_the_code_passes_the_linter():
    out = _ruff("check")
    assert out.returncode == 0, f"`ruff check` finds:\n{out.stdout[-3000:]}{out.stderr[-2000:]}"


def _headings(path: str) -> set[str]:
    """The anchors GitHub makes of a page's headings (a link's text kept and its address
    dropped, lower case, punctuation dropped but `-` and `_`, spaces as `-`, a repeated one
    suffixed -1, -2, ...); none inside fenced code blocks."""
    out, seen, fenced = set(), {}, False
    for line in open(path):
        fenced ^= bool(re.match(r" {0,3}(`{3,}|~{3,})[^`]*$", line))  # a fence line, not inline code that starts a line
        heading = None if fenced else re.match(r"#+\s+(.*)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
            slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_in_the_readme_and_docs_resolves():
    pages = ["README.md", "benchmarks/README.md", "tests/README.md", *glob.glob("docs/*.md", root_dir=ROOT), *glob.glob("examples/*/README.md", root_dir=ROOT)]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page)).read(), flags=re.S)
        for link in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
            if not os.path.exists(target):
                broken.append(f"{page}: {link} (no such file)")
            elif anchor and target.endswith(".md") and anchor not in _headings(target):
                broken.append(f"{page}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_name_the_benchmarks_scripts_and_examples_import_from_meshrl_exists():
    """`from meshrl.X import Y` anywhere in them (at the top or inside a function) names a module
    and a name that exist: four benchmarks imported `as_config` from meshrl.api after it moved,
    and failed at their first call, with the run_all script that calls them."""
    import ast
    import importlib.util

    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*", "**", "*.py"), recursive=True)):
        if os.path.relpath(path, ROOT).split(os.sep)[0] not in ("benchmarks", "scripts", "examples"):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "meshrl":
                module = importlib.import_module(node.module)
                for a in node.names:
                    package = hasattr(module, "__path__")  # (a name in it may be a submodule not yet imported)
                    if not hasattr(module, a.name) and not (package and importlib.util.find_spec(f"{node.module}.{a.name}")):
                        missing.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.module}.{a.name}")
    assert not missing, missing
