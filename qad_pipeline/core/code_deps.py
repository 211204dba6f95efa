"""A stage's code dependencies, found in the source: the project modules its entry module imports,
directly or not (function-local imports too), without importing anything. DVC's `deps` and the
Prefect cache key of each stage are these files (`Stage.code_files`); tests/test_layout.py reads the
same import graph for the house rules (no cycle, the library never imports a stage)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from qad_pipeline.core.config import PROJECT_ROOT

# The project's packages (pyproject.toml): each is the folder of its name at the project root.
PACKAGES = ("qad_pipeline", "tasks", "flows")


def is_project_module(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def module_file(module: str) -> Path:
    """The source file of a project module, found in the tree without importing it: its dotted
    path is its file's path."""
    if not is_project_module(module):
        raise ValueError(f"{module} is not a module of this project (its packages: {', '.join(PACKAGES)})")
    base = PROJECT_ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def imports_of(module: str, path: Path) -> set[str]:
    """The project modules named by every import statement in `path`, function-local ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]  # `from pkg import module`
        else:
            continue
        found.update(n for n in names if is_project_module(n))
    return found


@cache
def code_modules(entry: str) -> tuple[str, ...]:
    """`entry` and every project module it imports, directly or not, with their packages, sorted."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if not path.is_file():  # `from module import name`: a name, not a module
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a module runs its packages
        todo += imports_of(name, path)
    return tuple(sorted(seen))
