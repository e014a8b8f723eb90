"""Loom's imports read top-down: cli -> server / bench -> engine -> model -> the shared definitions, with no cycles.

Every import counts, also those inside functions and under TYPE_CHECKING: a cycle hidden in a function is still one.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import loom

PACKAGE = Path(loom.__file__).parent
# Each module's layer by its name's prefix (the longest that matches); a module imports only its own layer or lower.
LAYERS = {"loom.cli": 4, "loom.server": 3, "loom.bench": 3, "loom.demo": 3, "loom.viz": 3, "loom.distributed": 3, "loom.engine": 2,
          "loom.engine_args": 2, "loom.model": 1, "loom.config": 0, "loom.cpu": 0, "loom.cache_dir": 0,
          "loom.sampling": 0, "loom.tokenizer": 0, "loom.structured_output": 0}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _layer(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    assert prefixes, f"{module} has no layer: add it to LAYERS"
    return LAYERS[max(prefixes, key=len)]


def test_the_import_graph_has_no_cycles_and_never_imports_upward():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items() if name != "loom"}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
    upward = [f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
              for module, targets in graph.items() for target in targets if target != "loom"
              and _layer(target) > _layer(module)]
    assert not upward, "\n".join(upward)
