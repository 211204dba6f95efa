"""The command lines of infra/ (workers, compose, Dockerfiles, infra/README.md), checked against the
installed `prefect`, `mlflow` and `qad-pipeline` command lines, for the tests/test_infra_*.py checks."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.infra_files import INFRA, pyproject


@functools.cache
def prefect_cli():
    try:
        from prefect.cli._app import _app
    except ImportError:
        pytest.skip("this Prefect's CLI is not the cyclopts one (prefect.cli._app); commands not checked")
    import prefect.cli._app as cli

    return _app, getattr(cli, "_normalize_command_names", tuple)


def check_prefect(args: list[str]) -> None:
    app, normalize = prefect_cli()
    args = list(args)
    while args and args[0] in ("--no-prompt", "--prompt", "--profile"):  # the root's session parameters
        del args[: 2 if args[0] == "--profile" else 1]
    if "--help" in args:
        args = args[: args.index("--help")]
    try:
        app.parse_args(list(normalize(tuple(args))), exit_on_error=False, print_error=False)
    except Exception as err:  # noqa: BLE001 (cyclopts' errors name the bad token)
        raise AssertionError(f"`prefect {shlex.join(args)}`: {err}") from None


@functools.cache
def mlflow_server_options() -> frozenset[str]:
    """Options of `mlflow server`, read from MLflow's source (importing mlflow takes seconds)."""
    spec = importlib.util.find_spec("mlflow")
    base = Path(next(iter(spec.submodule_search_locations)))
    opts: set[str] = set()
    cli_file, shared_file = base / "cli" / "__init__.py", base / "utils" / "cli_args.py"
    if cli_file.is_file() and shared_file.is_file():
        shared = {
            node.targets[0].id: node.value
            for node in ast.parse(shared_file.read_text()).body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        }

        def names(call) -> set[str]:
            if not isinstance(call, ast.Call):
                return set()
            return {p.strip() for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and a.value.startswith("-") for p in a.value.split("/")}

        for node in ast.walk(ast.parse(cli_file.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "server":
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "option":
                        opts |= names(dec)
                    elif isinstance(dec, ast.Attribute) and getattr(dec.value, "id", "") == "cli_args":
                        opts |= names(shared.get(dec.attr))
    if not {"--backend-store-uri", "--host", "--port"} <= opts:  # source layout changed: ask MLflow
        out = subprocess.run([sys.executable, "-m", "mlflow", "server", "--help"], capture_output=True, text=True,
                             timeout=120, check=False).stdout
        opts = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", out))
    return frozenset(opts)


def check_mlflow(args: list[str]) -> None:
    if args[:1] != ["server"]:  # a client command (infra/README.md: `mlflow artifacts download`): MLflow's click CLI
        import mlflow.cli

        command, rest, prog = mlflow.cli.cli, list(args), "mlflow"
        while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
            sub = command.commands.get(rest[0])
            assert sub is not None, f"`mlflow {shlex.join(args)}`: no command {rest[0]!r}"
            prog, command, rest = f"{prog} {rest[0]}", sub, rest[1:]
        try:
            command.make_context(prog, rest)
        except Exception as err:  # noqa: BLE001 (click's usage errors name the bad option)
            raise AssertionError(f"`mlflow {shlex.join(args)}`: {getattr(err, 'format_message', err.__str__)()}") from None
        return
    options = mlflow_server_options()
    for arg in args[1:]:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in options, f"`mlflow server` has no option {arg} (it has {sorted(options)})"


def check_qad_pipeline(args: list[str]) -> None:
    import typer.main

    script = pyproject()["project"]["scripts"]["qad-pipeline"]
    module, _, attr = script.partition(":")
    # A click command, from typer's own copy of click in recent typer: duck-typed below.
    command = typer.main.get_command(getattr(importlib.import_module(module), attr))
    prog, rest = "qad-pipeline", list(args)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        assert sub is not None, f"`qad-pipeline {shlex.join(args)}`: no command {rest[0]!r} ({sorted(command.commands)})"
        prog, command, rest = f"{prog} {rest[0]}", sub, rest[1:]
    if rest == ["--help"]:
        return
    try:
        command.make_context(prog, rest)
    except Exception as err:  # click's usage errors, from click or from typer's copy of it
        if not hasattr(err, "format_message"):
            raise
        raise AssertionError(f"`qad-pipeline {shlex.join(args)}`: {err.format_message()}") from None


def check_command(argv: list[str], where: str) -> bool:
    """Check a command line of one of the project's tools; False when it is someone else's tool."""
    argv = list(argv)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value prefixes
        argv.pop(0)
    if argv[:2] == ["docker", "run"]:  # the command run in the image
        tools = [i for i, a in enumerate(argv) if a in ("prefect", "qad-pipeline", "mlflow")]
        argv = argv[tools[0]:] if tools else []
    if argv[:3] == ["python", "-m", "qad_pipeline"] or argv[:3] == [sys.executable, "-m", "qad_pipeline"]:
        argv = ["qad-pipeline", *argv[3:]]
    if not argv:
        return False
    checks = {"prefect": check_prefect, "mlflow": check_mlflow, "qad-pipeline": check_qad_pipeline}
    if argv[0] not in checks:
        return False
    try:
        checks[argv[0]](argv[1:])
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None
    return True


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of shell text: split at ; && || | &, redirections dropped."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current, skip = [], [], False
    for token in [*lexer, ";"]:
        if skip:
            skip = False
        elif token and set(token) <= set(";&|") or token == "\n":
            if current:
                commands.append(current)
            current = []
        elif token and set(token) <= set("<>"):
            skip = True  # the redirection's target
        else:
            current.append(token)
    return commands


def readme_commands() -> list[list[str]]:
    """Every simple command in the ```bash blocks of infra/README.md, <..._ID> placeholders filled in."""
    text = (INFRA / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"<([A-Z_]+)>", lambda m: str(uuid.UUID(int=1)) if m[1].endswith("ID") else m[1], line)
            commands += shell_commands(line)
    return commands
