"""The README's map of a step ("How a step runs") names real code: every module it lists exists, and every
function, class or method it names next to a module is defined there. A rename that forgets the map fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "varuna_core"

_MODULE = re.compile(r"[a-z_][a-z0-9_]*(?:/[a-z_][a-z0-9_]*)*\.py")
_CODE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?(?:\([^)]*\))?")


def _step_map() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("### How a step runs", 1)[1]
    return section.split("```", 2)[1]


def _defined(path: Path) -> set[str]:
    """``name`` for each top-level function and class, ``Class.name`` for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef))
    return names


def _mentions(block: str) -> list[tuple[str, str]]:
    """``(module, name)`` for the code each line names: a line is ``[module.py] name [/ name ...]``, then two
    spaces and a description; a line without a module continues the last one named; a line that is all
    description names nothing."""
    pairs, module = [], None
    for line in block.splitlines():
        words = line.strip().split(maxsplit=1)
        if not words:
            continue
        if _MODULE.fullmatch(words[0]):
            module, line = words[0], words[1] if len(words) > 1 else ""
        code = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names = [part.strip() for part in code.split("/")]
        if module is None or not all(_CODE.fullmatch(name) for name in names):
            continue  # a description
        pairs += [(module, name.split("(")[0]) for name in names]
    return pairs


def test_every_module_of_the_step_map_exists() -> None:
    modules = {module for module, _ in _mentions(_step_map())}
    assert len(modules) >= 8, modules
    missing = [m for m in modules if not (PACKAGE / m).is_file()]
    assert not missing, f"README 'How a step runs' names modules that do not exist: {missing}"


def test_every_name_of_the_step_map_is_defined_in_its_module() -> None:
    pairs = _mentions(_step_map())
    assert ("pipeline/executor.py", "_run_actions") in pairs, pairs  # the hot loop is on the map
    problems = []
    for module, name in pairs:
        defined = _defined(PACKAGE / module)
        if name not in defined and not any(d.endswith(f".{name}") for d in defined):
            problems.append(f"{module}: {name}")
    assert not problems, f"README 'How a step runs' names what its module does not define: {problems}"
