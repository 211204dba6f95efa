"""The house rules, checked on the tree: the import path is the file path, the stages import the
library and never the reverse, no import cycle, no module over 400 lines."""

import json
import subprocess
import sys

from qad_pipeline.core.config import PROJECT_ROOT
from qad_pipeline.core.code_deps import PACKAGES, imports_of, module_file

MAX_LINES = 400
# The command line is the one library module that starts flows (`qad-pipeline run`, `sweep`).
COMMAND_LINE = {"qad_pipeline.cli"}


def project_modules() -> dict[str, object]:
    """Every module of the project's packages, by dotted name (its file's path)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (function-local imports too), packages left out."""
    modules = project_modules()
    return {name: {m for m in imports_of(name, path) if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_every_module_imports_by_its_files_dotted_path_from_anywhere(tmp_path):
    modules = [m for m in project_modules() if not m.endswith("__main__")]  # that one runs the command line
    for name in modules:
        assert module_file(name) == project_modules()[name]
    script = ("import importlib, json, sys\n"
              f"for name in {modules!r}:\n    importlib.import_module(name)\n"
              "print(json.dumps({n: sys.modules[n].__file__ for n in " + repr(modules) + "}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    files = json.loads(done.stdout.splitlines()[-1])
    assert {n: str(module_file(n)) for n in modules} == files


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_a_stage_or_a_flow():
    wrong = {name: sorted(m for m in imported if m.split(".")[0] in ("tasks", "flows"))
             for name, imported in import_graph().items()
             if name.startswith("qad_pipeline") and name not in COMMAND_LINE}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_no_module_over_400_lines():
    folders = [*PACKAGES, "tests", "scripts", "benchmarks", "serving"]
    long = {str(p.relative_to(PROJECT_ROOT)): n for folder in folders for p in (PROJECT_ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_readmes_test_command_is_what_ci_runs():
    readme = (PROJECT_ROOT / "README.md").read_text()
    block = readme.split("**Fresh machine, run the tests:**", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.strip() in (PROJECT_ROOT / ".ci" / "run").read_text(), "README's test command is not what .ci/run runs"


def test_no_two_modules_share_a_name():
    """A module's name says which one it is: `stages` is the registry, never also a flow's helper."""
    by_name: dict[str, list[str]] = {}
    for name in project_modules():
        short = name.rpartition(".")[2]
        if project_modules()[name].name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(short, []).append(name)
    assert {short: found for short, found in by_name.items() if len(found) > 1} == {}


def test_the_library_is_grouped_by_domain_and_every_group_is_installed_and_documented():
    """qad_pipeline/ holds the command line and one folder per domain; each folder says what it holds
    (its __init__ docstring), is a package pyproject.toml installs, and docs/layout.md lists it with
    its modules."""
    import ast
    import tomllib

    library = PROJECT_ROOT / "qad_pipeline"
    top = sorted(p.stem for p in library.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "cli_checks", "cli_options"]
    groups = sorted(p.parent.name for p in library.glob("*/__init__.py"))
    installed = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = [str(p.parent.relative_to(PROJECT_ROOT)).replace("/", ".") for package in PACKAGES
                for p in (PROJECT_ROOT / package).rglob("__init__.py")]
    assert sorted(installed) == sorted(packages)
    layout = (PROJECT_ROOT / "docs" / "layout.md").read_text()
    for group in groups:
        assert ast.get_docstring(ast.parse((library / group / "__init__.py").read_text())), group
        assert f"{group}/" in layout, f"docs/layout.md does not list qad_pipeline/{group}/"
        for module in (library / group).glob("*.py"):
            assert module.name == "__init__.py" or module.stem in layout, f"docs/layout.md misses {group}/{module.name}"
