"""The product's import graph, read from source (ast; nothing is imported): the floors hold and nothing loops.

    floor 0   gcmoe_core
    floor 1   gcmoe_greenctx, gcmoe_comm, gcmoe_gemm_sm90, gcmoe_gemm_sm103   (components never import each other)
    floor 2   gcmoe

Every import counts, at module level or inside a function, relative ones resolved: `from p import n` is an edge to
the module p.n when there is one, else to p; `import p.q` an edge to p.q (the implicit imports of parent packages
are not edges). A call of importlib.import_module / __import__ with a literal name counts too. Rules:
    no cycle among product modules (a package's __init__ included)
    an import between two product packages goes down a floor, never up or sideways
    no product module imports gcmoe_lab, except gcmoe.cli (`gcmoe bench` / `gcmoe tune`: lazy, optional)
The checker is tested on small synthetic trees too, so a clean report means it looked.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "gcmoe_core": 0,
    "gcmoe_greenctx": 1,
    "gcmoe_comm": 1,
    "gcmoe_gemm_sm90": 1,
    "gcmoe_gemm_sm103": 1,
    "gcmoe": 2,
}
SRC = {name: ROOT / "packages" / name.replace("_", "-") / "src" / name for name in FLOORS}
LAB = "gcmoe_lab"
LAB_ENTRY = {"gcmoe.cli"}  # the thin `gcmoe bench` / `gcmoe tune` entries


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)  # module -> file (a package: its __init__.py)
    edges: dict[str, set[str]] = field(default_factory=dict)  # product module -> product modules it imports
    foreign: dict[str, set[str]] = field(default_factory=dict)  # product module -> non-product modules it imports

    def __repr__(self) -> str:
        return f"Graph({len(self.modules)} modules, {sum(map(len, self.edges.values()))} product edges)"


def _modules(roots: dict[str, Path]) -> dict[str, Path]:
    found = {}
    for top, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_pkg: bool) -> list[tuple[str, list[str]]]:
    """(base, names) of one import statement or literal dynamic import: `import a.b` -> ("a.b", []),
    `from .x import y, z` -> ("<resolved x>", ["y", "z"])."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        return [(base, [a.name for a in node.names])]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [(node.args[0].value, [])]
    return []


def _target(name: str, modules: dict[str, Path]) -> str:
    """The product module `name` names: itself, else its longest prefix that is one (an attribute of it)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def build(roots: dict[str, Path]) -> Graph:
    g = Graph(_modules(roots))
    tops = set(roots)
    for module, path in g.modules.items():
        is_pkg = path.name == "__init__.py"
        out, foreign = g.edges.setdefault(module, set()), g.foreign.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for base, names in _imported(node, module, is_pkg):
                targets = [f"{base}.{n}" if f"{base}.{n}" in g.modules else base for n in names] or [base]
                for t in targets:
                    if t.split(".")[0] in tops:
                        out.add(_target(t, g.modules) or t)
                    else:
                        foreign.add(t)
        out.discard(module)
    return g


def cycles(g: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; every one is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.edges.get(v, ())):
            if w not in g.modules:
                continue
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
                found.append(sorted(comp))

    for v in sorted(g.modules):
        if v not in index:
            visit(v)
    return found


def floor_violations(g: Graph, floors: dict[str, int]) -> list[str]:
    """Imports between two product packages that do not go down a floor."""
    bad = []
    for a, outs in sorted(g.edges.items()):
        pa = a.split(".")[0]
        for b in sorted(outs):
            pb = b.split(".")[0]
            if pa != pb and pb in floors and floors[pb] >= floors[pa]:
                way = "sideways" if floors[pb] == floors[pa] else "up"
                bad.append(f"{a} -> {b} ({way}: {pa} is floor {floors[pa]}, {pb} floor {floors[pb]})")
    return bad


def lab_imports(g: Graph, allowed: set[str]) -> list[str]:
    return [
        f"{a} -> {b}"
        for a, outs in sorted(g.foreign.items())
        for b in sorted(outs)
        if b.split(".")[0] == LAB and a not in allowed
    ]


# ------------------------------------------------------------------------------------------------ the product
@pytest.fixture(scope="module")
def product() -> Graph:
    missing = [str(p) for p in SRC.values() if not p.is_dir()]
    assert not missing, f"product source roots not found: {missing}"
    return build(SRC)


def test_the_walk_sees_the_product(product):
    """A guard against a checker that finds nothing because it read nothing: known edges of every kind are seen."""
    assert len(product.modules) > 40
    assert "gcmoe.backends" in product.edges["gcmoe.layer"]  # module level, absolute
    assert "gcmoe_core.config" in product.edges["gcmoe.backends.reference"]
    assert "gcmoe_comm.workspace" in product.edges["gcmoe_comm.comm"]  # relative
    assert "gcmoe_comm.kernels" in product.edges["gcmoe_comm.comm"]  # inside a function
    assert "gcmoe_greenctx" in product.edges["gcmoe.cli"]  # inside a function, another package
    assert "gcmoe_gemm_sm103.config" in product.edges["gcmoe_gemm_sm103"]  # a package's __init__


def test_no_import_cycles(product):
    found = cycles(product)
    assert not found, "import cycles (each line: the modules of one strongly connected set):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_imports_go_down_the_floors(product):
    bad = floor_violations(product, FLOORS)
    assert not bad, "imports that do not go down a floor:\n" + "\n".join(bad)


def test_only_the_cli_entries_import_the_lab(product):
    bad = lab_imports(product, LAB_ENTRY)
    assert not bad, "product modules importing gcmoe_lab:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------ the checker, on a planted tree
def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return {top: tmp_path / top for top in sorted({rel.split("/")[0] for rel in files})}


CLEAN = {
    "low/__init__.py": "",
    "low/a.py": "import os\n",
    "low/b.py": "from . import a\nfrom .a import os\n",
    "mid/__init__.py": "from low import b\n",
    "mid/c.py": "def f():\n    from low.b import a\n    import low.a\n",
    "top/__init__.py": "",
    "top/d.py": "from mid import c\nfrom ..top import e\n",
    "top/e.py": "import importlib\nimportlib.import_module('low.a')\n",
}
FLOORS_PLANTED = {"low": 0, "mid": 1, "side": 1, "top": 2}


def test_checker_passes_a_clean_tree(tmp_path):
    g = build(_tree(tmp_path, CLEAN))
    assert g.edges["low.b"] == {"low.a"} and g.edges["mid.c"] == {"low.a", "low.b"}
    assert g.edges["top.d"] == {"mid.c", "top.e"} and g.edges["top.e"] == {"low.a"}
    assert not cycles(g) and not floor_violations(g, FLOORS_PLANTED)


@pytest.mark.parametrize(
    "planted, want",
    [
        ({"low/a.py": "from .b import x\n"}, [["low.a", "low.b"]]),  # module-level, relative
        ({"low/a.py": "def f():\n    import low.b\n"}, [["low.a", "low.b"]]),  # inside a function
        ({"top/e.py": "from . import d\n"}, [["top.d", "top.e"]]),  # `from package import module`
        ({"low/__init__.py": "from .b import a\n", "low/a.py": "from low import x\n"}, [["low", "low.a", "low.b"]]),
    ],
    ids=["relative", "in-function", "package-import", "through-init"],
)
def test_checker_finds_a_planted_cycle(tmp_path, planted, want):
    g = build(_tree(tmp_path, {**CLEAN, **planted}))
    assert cycles(g) == want


def test_checker_finds_upward_sideways_and_lab_imports(tmp_path):
    planted = {
        "low/a.py": "def f():\n    from top import d\n",
        "side/__init__.py": "",
        "side/s.py": "import mid.c\n",
        "mid/c.py": "import gcmoe_lab.bench\n",
        "top/cli.py": "def bench():\n    from gcmoe_lab import bench\n",
    }
    g = build(_tree(tmp_path, {**CLEAN, **planted}))
    assert floor_violations(g, FLOORS_PLANTED) == [
        "low.a -> top.d (up: low is floor 0, top floor 2)",
        "side.s -> mid.c (sideways: side is floor 1, mid floor 1)",
    ]
    assert lab_imports(g, {"top.cli"}) == ["mid.c -> gcmoe_lab.bench"]
