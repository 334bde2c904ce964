"""The house rules of ``varuna_core`` (README.md's "Project layout" and the package docstring draw the floors),
checked on the source.

Every ``import`` counts, at module level or inside a function: a lazy import still ties two modules together,
it only hides the tie from tools. The checker is tested on small synthetic trees first, so that a rule that
could never fail does not pass for a real one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "varuna_core"
EXTENSIONS = {"varuna_core._native"}  # compiled modules (no source in src/)

# floor of each top-level part of varuna_core; a module may import its own floor or lower ones
FLOORS = {
    "errors": 0, "env": 0, "util": 0, "ir": 0, "_native": 0,
    "model": 1, "planning": 1,
    "pipeline": 2, "checkpoint": 2, "profiling": 2,
    "worker": 3, "launch": 3,
    "varuna": 4, "schemas": 4, "": 4,  # "" is varuna_core/__init__.py
}
# parts that must not import torch at all / at module level (transitively, through varuna_core modules)
NO_TORCH = ("ir", "util.fs", "util.checks", "errors", "env")
NO_TORCH_AT_IMPORT = ("ir", "planning", "launch", "checkpoint.layout", "checkpoint.manifest", "checkpoint.part",
                      "checkpoint.assemble", "util", "errors", "env")
# L0 parts that may import only these parts of varuna_core
L0_ALLOWED = {"errors": {"errors"}, "env": {"errors", "env", "util"}, "util": {"errors", "env", "util"},
              "ir": {"errors", "env", "util", "ir"}}


@dataclass
class Imports:
    """``module -> {imported varuna_core module}``, split by where the import statement is."""

    top: dict[str, set[str]] = field(default_factory=dict)
    lazy: dict[str, set[str]] = field(default_factory=dict)
    external_top: dict[str, set[str]] = field(default_factory=dict)  # top-level package names, e.g. "torch"
    external_any: dict[str, set[str]] = field(default_factory=dict)

    def all(self, module: str) -> set[str]:
        return self.top.get(module, set()) | self.lazy.get(module, set())


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect(src: Path, package: str = PACKAGE) -> Imports:
    """Read every module of ``src/<package>`` and what it imports."""
    modules = {module_name(p, src): p for p in (src / package).rglob("*.py")}
    known = set(modules) | EXTENSIONS
    imports = Imports()
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        top_nodes = set(map(id, _module_level(tree)))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node) if node.level else node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            at_top = id(node) in top_nodes
            for target in targets:
                if target == package or target.startswith(package + "."):
                    if target != name:
                        (imports.top if at_top else imports.lazy).setdefault(name, set()).add(target)
                else:
                    root = target.split(".")[0]
                    imports.external_any.setdefault(name, set()).add(root)
                    if at_top:
                        imports.external_top.setdefault(name, set()).add(root)
    for name in modules:
        imports.top.setdefault(name, set())
    return imports


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """Statements run when the module is imported (also inside top-level ``if``/``try``, not in functions)."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                continue  # only for type checkers
            for part in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def part_of(module: str, package: str = PACKAGE) -> str:
    """``varuna_core.planning.simulate`` -> ``planning``; ``varuna_core`` -> ``""``."""
    rest = module[len(package) + 1:] if module != package else ""
    return rest.split(".")[0]


def under(module: str, prefix: str, package: str = PACKAGE) -> bool:
    full = f"{package}.{prefix}"
    return module == full or module.startswith(full + ".")


def floor_violations(imports: Imports, package: str = PACKAGE) -> list[str]:
    problems = []
    for module in sorted(imports.top):
        part = part_of(module, package)
        if part not in FLOORS:
            problems.append(f"{module}: not in any floor (add it to a subpackage or to FLOORS)")
            continue
        for target in sorted(imports.all(module)):
            tpart = part_of(target, package)
            if tpart not in FLOORS:
                problems.append(f"{module} imports {target}, which is in no floor")
            elif FLOORS[tpart] > FLOORS[part]:
                problems.append(f"{module} (L{FLOORS[part]}) imports {target} (L{FLOORS[tpart]})")
            elif part in L0_ALLOWED and tpart not in L0_ALLOWED[part]:
                problems.append(f"{module} may import only {sorted(L0_ALLOWED[part])}, imports {target}")
    return problems


def closure(imports: Imports, module: str) -> set[str]:
    """Every varuna_core module imported when ``module`` is (module-level imports, transitively)."""
    seen, stack = set(), [module]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        stack.extend(imports.top.get(m, ()))
        parent = m.rpartition(".")[0]  # importing a.b.c runs a/__init__ and a/b/__init__ first
        if parent:
            stack.append(parent)
    return seen


def torch_violations(imports: Imports, package: str = PACKAGE) -> list[str]:
    problems = []
    for module in sorted(imports.top):
        if any(under(module, p, package) for p in NO_TORCH) and "torch" in imports.external_any.get(module, ()):
            problems.append(f"{module} imports torch (this part is pure Python)")
        if any(under(module, p, package) for p in NO_TORCH_AT_IMPORT):
            for m in sorted(closure(imports, module)):
                if "torch" in imports.external_top.get(m, ()):
                    via = "" if m == module else f" through {m}"
                    problems.append(f"importing {module} imports torch{via}")
    return problems


def cycles(imports: Imports) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), lazy imports included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(imports.all(v)):
            if w not in imports.top:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(imports.top):
        if v not in index:
            visit(v)
    return found


def _tree(tmp_path: Path, files: dict[str, str]) -> Imports:
    for rel, text in files.items():
        path = tmp_path / "varuna_core" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in (tmp_path / "varuna_core").rglob("*"):
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    (tmp_path / "varuna_core" / "__init__.py").touch()
    return collect(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# the checker catches what it must (synthetic trees)


def test_checker_finds_an_upward_import_even_inside_a_function(tmp_path) -> None:
    imports = _tree(tmp_path, {
        "checkpoint/saveload.py": "def save(vm):\n    from ..varuna import Varuna\n",
        "varuna.py": "from .checkpoint import saveload\n",
    })
    problems = floor_violations(imports)
    assert problems == ["varuna_core.checkpoint.saveload (L2) imports varuna_core.varuna (L4)"]
    assert cycles(imports) == [["varuna_core.checkpoint.saveload", "varuna_core.varuna"]]


def test_checker_finds_torch_reached_through_another_module(tmp_path) -> None:
    imports = _tree(tmp_path, {
        "launch/manager.py": "from ..planning import helper\n",
        "planning/helper.py": "import torch\n",
        "launch/agent.py": "def run():\n    import torch\n",  # lazily: allowed in launch/
        "ir/schedule.py": "def f():\n    import torch.nn\n",  # ir/ never
    })
    problems = torch_violations(imports)
    assert "importing varuna_core.launch.manager imports torch through varuna_core.planning.helper" in problems
    assert "varuna_core.ir.schedule imports torch (this part is pure Python)" in problems
    assert not any("launch.agent" in p for p in problems)


def test_checker_knows_l0_neighbours_and_type_checking_blocks(tmp_path) -> None:
    imports = _tree(tmp_path, {
        "ir/topology.py": "from ..util import fs\nfrom ..errors import X\n",
        "util/fs.py": "from ..ir import topology\n",
        "planning/plan.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "errors.py": "",
    })
    problems = floor_violations(imports) + torch_violations(imports)
    assert problems == [
        "varuna_core.util.fs may import only ['env', 'errors', 'util'], imports varuna_core.ir.topology"]


# ----------------------------------------------------------------------------------------------------------
# the real package


@pytest.fixture(scope="module")
def package() -> Imports:
    return collect(ROOT / "src")


def test_every_module_imports_only_its_floor_or_lower(package) -> None:
    assert floor_violations(package) == []


def test_no_import_cycles_lazy_or_not(package) -> None:
    assert cycles(package) == []


def test_torch_stays_out_of_the_planner_the_launcher_and_the_ir(package) -> None:
    assert torch_violations(package) == []


def test_the_launcher_does_not_reach_into_workers(package) -> None:
    """The launcher runs where torch may be missing; the worker side depends on it, not the reverse."""
    for module in package.top:
        if under(module, "launch"):
            inside = [t for t in package.all(module)
                      if any(under(t, part) for part in ("worker", "pipeline", "model", "profiling"))]
            assert inside == [], module


def test_checkpoint_and_worker_never_see_the_facade(package) -> None:
    for module in package.top:
        if under(module, "checkpoint") or under(module, "worker"):
            assert f"{PACKAGE}.varuna" not in package.all(module), module


def _python_files(*folders: str):
    for folder in folders:
        yield from (p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_benchmarks_devtools_and_the_library_never_import_the_tests() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in _python_files("benchmarks", "devtools", "src", "examples")
                 if "tests" in _imported_roots(p)]
    assert offenders == []


def test_environment_names_are_written_only_in_env_py() -> None:
    """A ``"VARUNA_..."`` string that is a whole name (not a message mentioning one) belongs in env.py."""
    import re

    name = re.compile(r"VARUNA_[A-Z_]+")
    offenders = []
    for path in _python_files("src"):
        if path.name == "env.py" and path.parent.name == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
            elif isinstance(node, ast.keyword) and node.arg and name.fullmatch(node.arg):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}=")
    assert offenders == []


def test_the_library_does_not_import_the_cli_or_the_tooling() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in _python_files("src/varuna_core")
                 if _imported_roots(p) & {"varuna_cli", "devtools", "benchmarks", "tests"}]
    assert offenders == []
