"""docs/architecture.md's layers hold in the code: `tools` ← `agent_env` ← `otb_tir`, each importing
only the layers below it; verl only inside `otb_tir/verl/`; no import cycle between modules; inside
``agent_env`` no module imports its own package's ``__init__`` (an arrow up: the shared names live in a
bottom module, ``agent_env.errors``, which the package re-exports); inside ``otb_tir`` its parts import
in one direction; nothing outside the tests edits ``sys.path``.

Imports are read from the source (ast), function-level ones included: a lazy import is still a
dependency. A module importing its own ancestor package is left out of the cycle check (Python loads
the package first anyway) and caught by the arrows-up check where that holds.
Run alone: ``python -m pytest tests/test_layers.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"tools": 0, "agent_env": 1, "otb_tir": 2}
#: Where verl may be imported outside otb_tir/verl, and why.
VERL_ALLOWED = {
    # a user's tool class built on verl's BaseTool gets verl's own schema object (verl is already
    # imported then: the class comes from it)
    ("tools.verl_tools", "verl.tools.schemas"),
    ("tools.verl_tools", "verl.tools.schemas.OpenAIFunctionToolSchema"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    raw = {m: _imports(f) for m, f in mods.items()}

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = {
        m: {r for r in map(resolve, names) if r and r != m and not m.startswith(r + ".")} for m, names in raw.items()
    }
    return raw, edges


def test_each_layer_imports_only_the_layers_below_it_and_verl_stays_in_its_plugin():
    raw, _ = _graph()
    upward, verl = [], []
    for mod, names in sorted(raw.items()):
        layer = LAYERS[mod.split(".")[0]]
        for name in names:
            top = name.split(".")[0]
            if top in LAYERS and LAYERS[top] > layer:
                upward.append(f"{mod} imports {name}")
            if top == "verl" and not mod.startswith("otb_tir.verl") and (mod, name) not in VERL_ALLOWED:
                verl.append(f"{mod} imports {name}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)
    assert not verl, "verl imported outside otb_tir/verl:\n" + "\n".join(verl)


#: Packages whose modules never import their ancestor packages' ``__init__`` (otb_tir and tools still do:
#: ``otb_tir.ConfigError``, ``tools.ToolError``).
NO_ARROWS_UP = ("agent_env",)


def test_no_module_imports_its_own_package_init():
    """``from agent_env import EnvError`` inside ``agent_env.episode`` points up: the package's
    ``__init__`` imports the episode, which imports the package again (it worked only because of the
    order of the ``__init__``'s lines, behind ``# noqa: E402``)."""
    mods = _modules()
    raw, _ = _graph()
    up = []
    for mod, names in sorted(raw.items()):
        if mod.split(".")[0] not in NO_ARROWS_UP:
            continue
        for name in sorted(names):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and mod.startswith(name + "."):
                up.append(f"{mod} imports its ancestor package {name}")
    assert not up, "arrows up inside a package:\n" + "\n".join(sorted(set(up)))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_between_modules():
    _, edges = _graph()
    cycles = _cycles(edges)
    described = [" ↔ ".join(c) + ": " + "; ".join(f"{m} → {sorted(edges[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_only_tests_put_folders_on_sys_path():
    """Benchmarks, recipes and scripts import the installed package like everything else (a script's
    own folder is on ``sys.path`` already, for its sibling scripts): none edits ``sys.path``."""
    edits = []
    for folder in ("benchmarks", "recipes", "scripts", *LAYERS):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                target = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # sys.path.insert(...)
                    target = node.func.value
                elif isinstance(node, (ast.Assign, ast.AugAssign)):  # sys.path = ..., sys.path[:0] = ...
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    target = target.value if isinstance(target, ast.Subscript) else target
                if isinstance(target, ast.Attribute) and ast.unparse(target) == "sys.path":
                    edits.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not edits, "sys.path edited outside tests:\n" + "\n".join(edits)


def test_otb_tirs_parts_import_in_one_direction():
    """Inside ``otb_tir``, its parts (each subpackage, each top-level module) import one another without a
    loop: a part that imports one above it points up, even where no two modules form a cycle
    (``otb_tir.trainer.config`` imported ``otb_tir.verl.overrides`` while ``otb_tir.verl`` builds on
    ``otb_tir.trainer``)."""

    def part(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    _, edges = _graph()
    parts: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for mod, names in edges.items():
        for name in names:
            a, b = part(mod), part(name)
            if mod.startswith("otb_tir.") and name.startswith("otb_tir.") and a != b:
                parts.setdefault(a, set()).add(b)
                why.setdefault((a, b), []).append(f"{mod} → {name}")
    cycles = _cycles(parts)
    described = [
        " ↔ ".join(c) + ": " + "; ".join(x for a in c for b in sorted(parts[a] & set(c)) for x in why[(a, b)])
        for c in cycles
    ]
    assert not cycles, "otb_tir's parts import each other in a loop:\n" + "\n".join(described)
