"""The package layout: imports point down the layers of docs/ARCHITECTURE.md, with no cycle, and a module over 500
lines says why in its docstring.

Every import is read from the source (deferred imports inside functions included), so a lazy import cannot
hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rope_quant

ROOT = Path(rope_quant.__file__).parent
# Bottom-up. A module may import its own layer or any layer below it.
LAYERS = ("defaults", "seeds", "io", "claims_json", "core", "model", "quant", "calib", "rotations", "corpora",
          "planning", "scoring", "experiment", "export", "runtime", "claims", "sweep", "analysis", "cli")
# The claims layer (the claims as data and their engine) reads cells only through a store: it imports core/ and
# itself, the architecture adapter (model/) alone, lazily, to answer a claim's premises (claims/premises.py), and
# the experiment config, lazily, to count a cell's bits per key element from its flat config (claims/bits.py), and
# the cost plan (planning/), lazily, to cost a claims table before any load (claims/selection.py: cost_plan).
# It writes its rows in the one claims JSON schema (claims_json.py, stdlib only).
CLAIMS_MAY_IMPORT = {"defaults", "core", "claims", "model", "experiment", "planning", "claims_json"}
# The pytest plugin stands beside the layers: it may import only the bottom ones (stdlib-only modules).
PLUGIN_MAY_IMPORT = {"defaults", "seeds", "io", "claims_json"}
# The import hook of the moved module paths (rope_quant/_deprecation.py, stdlib only) stands beside the layers
# too: any module may import it, and it imports no layer (it finds the new paths by name, at import time).
BESIDE = "_deprecation"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every rope_quant module a source file imports (absolute or relative, at any depth)."""
    me = _module_name(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rope_quant"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("rope_quant"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {t for t in _imports(path) if t in files and t != name and t != "rope_quant"}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_belongs_to_a_layer():
    beside = ("pytest_plugin", BESIDE)
    strays = [m for m in _graph() if m != "rope_quant" and _layer(m) not in (*LAYERS, *beside)]
    assert not strays, f"modules outside the layer map of docs/ARCHITECTURE.md: {strays}"


def test_imports_point_down_the_layers():
    upward = []
    for mod, targets in _graph().items():
        src = _layer(mod)
        for tgt in targets:
            dst = _layer(tgt)
            if dst == BESIDE:
                ok = True
            elif src == BESIDE:
                ok = False
            elif src == "pytest_plugin":
                ok = dst in PLUGIN_MAY_IMPORT
            elif src in LAYERS and dst in LAYERS:
                ok = LAYERS.index(dst) <= LAYERS.index(src)
            else:
                ok = dst in LAYERS and src == ""
            if not ok:
                upward.append(f"{mod} -> {tgt}")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def test_the_claims_layer_imports_only_core_the_adapter_and_the_config():
    strays = sorted(f"{mod} -> {tgt}" for mod, targets in _graph().items() if _layer(mod) == "claims"
                    for tgt in targets if _layer(tgt) not in CLAIMS_MAY_IMPORT)
    assert not strays, "the claims layer imports beyond core/, model/, experiment/ and planning/:\n" + "\n".join(strays)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_can_fail():
    """The cycle finder and the layer rule flag a planted cycle and an upward edge."""
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert LAYERS.index("sweep") > LAYERS.index("core")  # core -> sweep would be reported as upward
    with pytest.raises(ValueError):
        LAYERS.index("nowhere")


MAX_LINES = 500
REASON = "Over 500 lines because"


def _long_without_reason(sources: dict[str, str]) -> list[str]:
    """Modules over :data:`MAX_LINES` lines whose docstring does not say why (one concept per module)."""
    return sorted(name for name, text in sources.items()
                  if len(text.splitlines()) > MAX_LINES and REASON not in (ast.get_docstring(ast.parse(text)) or ""))


def test_a_module_over_500_lines_states_its_reason():
    sources = {_module_name(p): p.read_text() for p in ROOT.rglob("*.py")}
    long = _long_without_reason(sources)
    assert not long, f"split these modules or say in their docstring why they stay whole ({REASON} ...): {long}"
    planted = '"""A module."""\n' + "x = 1\n" * MAX_LINES
    assert _long_without_reason({"planted": planted}) == ["planted"]
    assert _long_without_reason({"kept": f'"""A module.\n\n{REASON} it is one table."""\n' + "x = 1\n" * 600}) == []
