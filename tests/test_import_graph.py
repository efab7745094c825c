"""No import circles between kvpilot's own modules, and imports only in the allowed directions.

A circle (a imports b, b imports a, even under TYPE_CHECKING or inside a function) means two
modules are one module in two files: neither can be read, tested or changed without the other.
The directions (docs/architecture.md's map): the operator, the gateway and the runtime are three
processes that share only kvpilot.contract; the contract is torch-free (the operator and gateway
images carry no torch); benchmarks do not import tests. The graph is read from the source with
`ast`, so lazy and type-only imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvpilot.contract": ROOT / "contract/kvpilot/contract",
    "kvpilot.gateway": ROOT / "gateway/kvpilot/gateway",
    "kvpilot.runtime": ROOT / "runtime/kvpilot/runtime",
    "kvpilot.operator": ROOT / "operator/kvpilot/operator",
}


def module_names(package: str, folder: Path) -> dict[str, Path]:
    names = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = path
    return names


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The known modules a module's source imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` names the module, not the package's __init__
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            found |= submodules or {node.module}
    return found & known


def graph(package: str, folder: Path) -> dict[str, set[str]]:
    modules = module_names(package, folder)
    known = set(modules)
    return {
        name: imported(ast.parse(path.read_text()), known) - {name, package}
        for name, path in modules.items()
    }


# What each room may not import, by module-name prefix.
FORBIDDEN = {
    "kvpilot.contract": ("kvpilot.runtime", "kvpilot.operator", "kvpilot.gateway", "torch"),
    "kvpilot.runtime": ("kvpilot.operator", "kvpilot.gateway"),
    "kvpilot.gateway": ("kvpilot.operator", "kvpilot.runtime", "torch"),
    "kvpilot.operator": ("kvpilot.runtime", "kvpilot.gateway", "torch"),
    "bench": ("tests",),
}
FOLDERS = {**PACKAGES, "bench": ROOT / "bench"}


def forbidden_edges(package: str, modules: dict[str, Path]) -> list[str]:
    """`a imports b` for every import of a module in `package` that its room may not make."""
    edges = []
    for name, path in sorted(modules.items()):
        for target in sorted(names_imported(path)):
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[package]):
                edges.append(f"{name} imports {target}")
    return edges


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in the graph as the list of modules along it, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(edges.get(node, ())):
            circle = visit(target, [*path, node])
            if circle:
                return circle
        done.add(node)
        return None

    for start in sorted(edges):
        circle = visit(start, [])
        if circle:
            return circle
    return None


@pytest.mark.parametrize(
    ("edges", "circle"),
    [
        ({"a": {"b"}, "b": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_find_circle(edges: dict[str, set[str]], circle: list[str] | None) -> None:
    assert find_circle(edges) == circle


@pytest.mark.parametrize(
    ("source", "modules"),
    [
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import X\n", {"p.b"}),
        ("def f():\n    import p.b\n", {"p.b"}),
        ("from p import b\n", {"p.b"}),
        ("from p import X\n", {"p"}),
        ("from q import b\n", set()),
    ],
)
def test_every_import_counts_wherever_it_is(source: str, modules: set[str]) -> None:
    assert imported(ast.parse(source), {"p", "p.b"}) == modules


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package: str) -> None:
    assert find_circle(graph(package, PACKAGES[package])) is None


@pytest.mark.parametrize(
    ("package", "source", "edges"),
    [
        ("kvpilot.operator", "from kvpilot.runtime import memory\n", ["m imports kvpilot.runtime"]),
        (
            "kvpilot.gateway",
            "def f():\n    import kvpilot.operator.api\n",
            ["m imports kvpilot.operator.api"],
        ),
        ("kvpilot.contract", "import torch.nn\n", ["m imports torch.nn"]),
        ("kvpilot.contract", "import torchvision\n", []),
        ("bench", "from tests.support import kube\n", ["m imports tests.support"]),
        ("kvpilot.runtime", "from kvpilot.contract import memory\n", []),
    ],
)
def test_forbidden_edges_are_named(
    tmp_path: Path, package: str, source: str, edges: list[str]
) -> None:
    (tmp_path / "m.py").write_text(source)
    assert forbidden_edges(package, {"m": tmp_path / "m.py"}) == edges


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_only_in_the_allowed_directions(package: str) -> None:
    folder = FOLDERS[package]
    modules = module_names(package, folder)
    assert forbidden_edges(package, modules) == []


def test_tests_share_helpers_only_through_tests_support() -> None:
    # A test module imported by another runs its module-level set-up twice and ties the two
    # together; shared helpers live in tests/support (a conftest may export fixtures' constants).
    tests = ROOT / "tests"
    strays = []
    for path in tests.rglob("*.py"):
        for module in names_imported(path):
            shared = module.startswith("tests.support") or module.endswith(".conftest")
            if module.startswith("tests.") and not shared:
                strays.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not strays


def names_imported(path: Path) -> set[str]:
    """Every absolute module name a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found
