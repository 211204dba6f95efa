"""Offline checks of infra/: the image, the compose services, the work-pool templates and the workers.

Nothing here needs Docker, a cluster or a network. The files are checked against the tools that
consume them, as installed here:

- the base job templates against Prefect's work-pool validation, JSON Schema, and prefect-kubernetes'
  own `KubernetesWorkerJobConfiguration`, which renders them exactly as the worker does;
- every Kubernetes manifest (the rendered Jobs included) field by field against the Kubernetes API
  models of `kubernetes_asyncio` (a prefect-kubernetes dependency) or `kubernetes`;
- every command (workers, compose, Dockerfile, README) against the installed `prefect`, `mlflow` and
  `qad-pipeline` command lines, and every PREFECT_* variable against Prefect's settings.

Without prefect-kubernetes the Kubernetes checks are skipped with a message that says so.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import functools
import importlib
import importlib.util
import itertools
import json
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from qad_pipeline.stages import module_file

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
TEMPLATES = {"qad-gpu": K8S / "gpu-base-job-template.json", "qad-control": K8S / "control-base-job-template.json"}
WORKERS = {"qad-gpu": K8S / "worker-gpu.yaml", "qad-control": K8S / "worker-control.yaml"}
MANIFESTS = [K8S / "base.yaml", *WORKERS.values()]
# The deployments of prefect.yaml (written elsewhere) and the pool each must run on.
DEPLOYMENT_POOLS = {
    "qad-pipeline/default": "qad-control",
    "ptq-recipe/gpu": "qad-gpu",
    "gpu-stage/gpu": "qad-gpu",
    "watch-base-checkpoints/cron": "qad-control",
}
GPU = "nvidia.com/gpu"
# prefect-kubernetes refuses a job manifest without these two keys in the pod template's spec
# (KubernetesWorkerJobConfiguration._validate_job_manifest), although they are Job fields, not pod
# fields; the API server drops them with a warning. They are the only unknown fields allowed.
WORKER_REQUIRED_EXTRAS = {"spec.template.spec.parallelism", "spec.template.spec.completions"}
NEEDS_PREFECT_KUBERNETES = (
    "prefect-kubernetes is not installed (add `prefect-kubernetes>=0.8` to the test extra): "
    "the Kubernetes checks of infra/ are skipped"
)


# ---------------------------------------------------------------------------------------------
# loading


@functools.cache
def yaml_docs(path: Path) -> tuple:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


@functools.cache
def template(pool: str) -> dict:
    return json.loads(TEMPLATES[pool].read_text())


@functools.cache
def pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib

        return tomllib.loads(text)
    except ModuleNotFoundError:  # Python 3.10
        import toml

        return toml.loads(text)


def requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    return next(r for r in reqs if r.name == name)


@functools.cache
def dotenv_example() -> dict:
    env = {}
    for line in (INFRA / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


_COMPOSE_VAR = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def compose_variables(text: str) -> list[tuple[str, str | None]]:
    """(name, operator) of every ${...} in `text`."""
    return [(m["name"] or m["bare"], m["op"]) for m in _COMPOSE_VAR.finditer(text) if m[0] != "$$"]


def interpolate(value, env: dict):
    """Compose's variable interpolation (${X}, ${X:-default}, ${X-default}, ${X:?err}, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"], m["arg"]
        val = env.get(name)
        if op in (":-", ":?") and not val or op in ("-", "?") and val is None:
            if op.endswith("?"):
                raise AssertionError(f"compose needs {name}: {arg}")
            return arg
        return val or ""

    return _COMPOSE_VAR.sub(one, value)


@functools.cache
def compose() -> dict:
    return interpolate(yaml_docs(INFRA / "compose.yaml")[0], dotenv_example())


@functools.cache
def dockerfile(path: Path = INFRA / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def docker_args(path: Path = INFRA / "Dockerfile") -> dict:
    """ARG defaults of a Dockerfile."""
    args = {}
    for word, rest in dockerfile(path):
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def walk_strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from walk_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk_strings(v)
    elif isinstance(obj, str):
        yield obj


# ---------------------------------------------------------------------------------------------
# Kubernetes API models


@functools.cache
def k8s_models():
    for name in ("kubernetes_asyncio.client.models", "kubernetes.client.models"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip(NEEDS_PREFECT_KUBERNETES)


_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool, "datetime": str, "date": str}


def model_errors(obj, type_name: str, path: str = "") -> list[str]:
    """Every field of `obj` that the Kubernetes model `type_name` does not have, or has another type.

    Walks the models' `attribute_map` (JSON name) and `openapi_types` recursively; required fields
    are checked by building each model, which refuses a missing one.
    """
    models = k8s_models()
    here = path or "<root>"
    if type_name.startswith("list["):
        if not isinstance(obj, list):
            return [f"{here}: a list expected, got {type(obj).__name__}"]
        return [e for i, item in enumerate(obj) for e in model_errors(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("dict("):
        value_type = type_name[5:-1].split(", ", 1)[1]
        if not isinstance(obj, dict):
            return [f"{here}: a mapping expected, got {type(obj).__name__}"]
        return [e for k, v in obj.items() for e in model_errors(v, value_type, f"{path}[{k!r}]")]
    if type_name == "object":
        return []
    if type_name in _PRIMITIVES:
        ok = isinstance(obj, _PRIMITIVES[type_name]) and not (type_name in ("int", "float") and isinstance(obj, bool))
        return [] if ok else [f"{here}: {type_name} expected, got {obj!r}"]
    cls = getattr(models, type_name)
    if not isinstance(obj, dict):
        return [f"{here}: a {type_name} mapping expected, got {obj!r}"]
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    errors, kwargs = [], {}
    for key, value in obj.items():
        sub = f"{path}.{key}" if path else key
        if key not in by_json:
            errors.append(f"{sub}: no such field in {type_name}")
            continue
        kwargs[by_json[key]] = value
        errors += model_errors(value, cls.openapi_types[by_json[key]], sub)
    try:
        cls(**kwargs)
    except ValueError as err:
        errors.append(f"{here} ({type_name}): {err}")
    return errors


def manifest_errors(doc: dict) -> list[str]:
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    type_name = version[0].upper() + version[1:] + doc["kind"]
    if not hasattr(k8s_models(), type_name):
        return [f"{doc['apiVersion']} {doc['kind']}: no Kubernetes model {type_name}"]
    return model_errors(doc, type_name)


QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")


def resource_quantities(pod_spec: dict):
    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        for kind in ("limits", "requests"):
            for name, value in (container.get("resources", {}).get(kind) or {}).items():
                yield f"{container['name']}.{kind}.{name}", value


# ---------------------------------------------------------------------------------------------
# rendering a base job template as the Kubernetes worker does


def sample_value(schema: dict):
    """A value of the schema's first non-null type (to render every optional placeholder)."""
    options = schema.get("anyOf", [schema])
    kind = next(o.get("type") for o in options if o.get("type") != "null")
    if "enum" in schema:
        return schema["enum"][-1]
    return {"string": "2", "integer": 3600, "boolean": False, "object": {}, "array": []}[kind]


def render(pool: str, values: dict) -> dict:
    """The Job manifest prefect-kubernetes would submit for a flow run of a deployment on `pool`."""
    if importlib.util.find_spec("prefect_kubernetes") is None:
        pytest.skip(NEEDS_PREFECT_KUBERNETES)
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    class NoApi:
        """Stands in for the API client: the templates hold no block or variable references."""

    async def build():
        return await KubernetesWorkerJobConfiguration.from_template_and_values(
            copy.deepcopy(template(pool)), values, client=NoApi()
        )

    with temporary_settings({PREFECT_API_URL: "http://prefect-server.qad.svc:4200/api"}):
        config = asyncio.run(build())
        config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    return config.job_manifest


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]


# ---------------------------------------------------------------------------------------------
# command lines


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
    assert args[:1] == ["server"], f"`mlflow {shlex.join(args)}`: only `mlflow server` is expected in infra/"
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


# ---------------------------------------------------------------------------------------------
# the files parse


def test_every_infra_file_parses():
    expected = {
        "Dockerfile", "Dockerfile.dockerignore", "README.md", "compose.yaml", "mlflow.Dockerfile",
        "postgres-init.sql", ".env.example", "k8s/base.yaml", "k8s/gpu-base-job-template.json",
        "k8s/control-base-job-template.json", "k8s/worker-gpu.yaml", "k8s/worker-control.yaml",
    }
    present = {p.relative_to(INFRA).as_posix() for p in INFRA.rglob("*") if p.is_file()}
    assert expected <= present, f"missing in infra/: {sorted(expected - present)}"
    for path in INFRA.rglob("*"):
        if path.suffix in (".yaml", ".yml"):
            assert yaml_docs(path), f"{path} is empty"
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
    for path in (INFRA / "Dockerfile", INFRA / "mlflow.Dockerfile"):
        words = [w for w, _ in dockerfile(path)]
        unknown = set(words) - {"ARG", "FROM", "LABEL", "ENV", "RUN", "WORKDIR", "COPY", "USER", "CMD", "EXPOSE",
                                "ENTRYPOINT", "HEALTHCHECK", "SHELL"}
        assert not unknown, f"{path}: unknown instructions {unknown}"
        assert "FROM" in words and words.index("FROM") <= min(i for i, w in enumerate(words) if w != "ARG")
    assert "not written yet" not in (INFRA / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# the base job templates


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
def test_base_job_template_passes_prefects_work_pool_validation(pool):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import find_placeholders

    tpl = template(pool)
    # What the server runs on `prefect work-pool create --base-job-template`: every placeholder of the
    # job configuration must be a declared variable.
    WorkPoolCreate(name=pool, type="kubernetes", base_job_template=tpl)
    used = {p.name for p in find_placeholders(json.dumps(tpl["job_configuration"]))}
    declared = set(tpl["variables"]["properties"])
    assert used <= declared, f"undeclared variables: {sorted(used - declared)}"
    assert declared <= used, f"variables that change nothing: {sorted(declared - used)}"

    schema = tpl["variables"]
    jsonschema.validators.validator_for(schema).check_schema(schema)
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    jsonschema.validate(defaults, schema)  # what a deployment without job variables gets
    every = {k: sample_value(v) for k, v in schema["properties"].items()}
    jsonschema.validate(every, schema)


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
def test_base_job_template_has_the_structure_of_prefect_kubernetes_default(pool):
    if importlib.util.find_spec("prefect_kubernetes") is None:
        pytest.skip(NEEDS_PREFECT_KUBERNETES)
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    tpl = template(pool)
    # cluster_config (kubeconfig block for an out-of-cluster worker) is left out: the workers run
    # in the cluster.
    assert set(tpl["job_configuration"]) == set(default["job_configuration"]) - {"cluster_config"}
    for name, spec in default["variables"]["properties"].items():
        if name != "cluster_config":
            assert name in tpl["variables"]["properties"], f"{pool}: the worker's variable {name!r} is missing"
            if "enum" in spec:
                assert tpl["variables"]["properties"][name]["enum"] == spec["enum"]


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
@pytest.mark.parametrize("variables", ["defaults", "every variable set"])
def test_rendered_job_is_a_valid_kubernetes_job(pool, variables):
    props = template(pool)["variables"]["properties"]
    values = {} if variables == "defaults" else {k: sample_value(v) for k, v in props.items() if k != "command"}
    manifest = render(pool, values)
    errors = manifest_errors(manifest)
    unknown = {e.split(":")[0] for e in errors if "no such field" in e}
    assert unknown == WORKER_REQUIRED_EXTRAS, errors
    assert all("no such field" in e for e in errors), errors
    for name, value in resource_quantities(pod_spec(manifest)):
        assert isinstance(value, str) and QUANTITY.match(value), f"{name}: {value!r} is not a Kubernetes quantity"
    container = pod_spec(manifest)["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PREFECT_API_URL"] == "http://prefect-server.qad.svc:4200/api", "the worker passes its API URL on"
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]


def test_every_gpu_job_requests_exactly_one_gpu():
    tpl = template("qad-gpu")
    raw = tpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert len(raw) == 1
    for kind in ("limits", "requests"):
        assert raw[0]["resources"][kind][GPU] == "1", f"{kind}: the GPU count is fixed in the manifest, not a variable"
    for values in ({}, {"cpu_limit": "64", "memory_limit": "1Ti", "node_selector": {}, "tolerations": []}):
        spec = pod_spec(render("qad-gpu", values))
        gpus = [c["resources"]["limits"].get(GPU) for c in spec["containers"]]
        assert gpus == ["1"], f"GPU limits of the rendered Job: {gpus}"
        assert spec["containers"][0]["resources"]["requests"][GPU] == "1"
    spec = pod_spec(render("qad-gpu", {}))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_control_jobs_request_no_gpu():
    manifest = render("qad-control", {})
    assert GPU not in json.dumps(manifest)
    assert pod_spec(manifest).get("nodeSelector", {}) == {} and pod_spec(manifest).get("tolerations", []) == []


def test_the_two_templates_differ_only_in_the_gpu():
    gpu, control = copy.deepcopy(template("qad-gpu")), template("qad-control")
    container = gpu["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    for kind in ("limits", "requests"):
        del container["resources"][kind][GPU]
    assert gpu["job_configuration"] == control["job_configuration"]
    assert gpu["variables"]["properties"].keys() == control["variables"]["properties"].keys()


# ---------------------------------------------------------------------------------------------
# the Kubernetes manifests


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_fields_are_kubernetes_fields(path):
    for doc in yaml_docs(path):
        errors = manifest_errors(doc)
        assert not errors, f"{path.name} {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors)
        if doc["kind"] == "Deployment":
            for name, value in resource_quantities(doc["spec"]["template"]["spec"]):
                assert isinstance(value, str) and QUANTITY.match(value), f"{name}: {value!r}"


def objects() -> dict[tuple[str, str], dict]:
    found = {}
    for path in MANIFESTS:
        for doc in yaml_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} is declared twice"
            found[key] = doc
    return found


def test_cluster_objects_fit_together():
    objs = objects()
    namespaces = {name for kind, name in objs if kind == "Namespace"}
    assert namespaces == {"qad"}
    for (kind, name), doc in objs.items():
        if kind != "Namespace":
            assert doc["metadata"].get("namespace") == "qad", f"{kind} {name} is not in namespace qad"

    # What the templates' defaults name exists.
    for pool in TEMPLATES:
        props = template(pool)["variables"]["properties"]
        assert props["namespace"]["default"] == "qad"
        assert ("ServiceAccount", props["service_account_name"]["default"]) in objs
        assert ("ConfigMap", props["config_map_name"]["default"]) in objs
        claim = objs.get(("PersistentVolumeClaim", props["workspace_claim"]["default"]))
        assert claim and "ReadWriteMany" in claim["spec"]["accessModes"], "pods of both pools share the volume"
        secret = props["secret_name"]["default"]
        assert f"create secret generic {secret}" in (INFRA / "README.md").read_text(), (
            f"the README must say how to create the Secret {secret!r}")
    job_sa = objs[("ServiceAccount", template("qad-gpu")["variables"]["properties"]["service_account_name"]["default"])]
    assert job_sa.get("automountServiceAccountToken") is False, "flow-run pods need no Kubernetes API token"

    config = objs[("ConfigMap", "qad-config")]["data"]
    assert config["PREFECT_API_URL"].endswith("/api")
    assert config["HF_HOME"].startswith("/workspace/"), "the Hugging Face cache belongs on the shared volume"
    assert config["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith("/workspace/"), (
        "persisted results (the PTQ cache of a re-run) must outlive the pod")
    # The crash automation of `qad-pipeline prefect-setup` needs heartbeats, every 30 s or more.
    assert int(config["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) >= 30

    # The workers' service account may run Jobs and follow their pods, in this namespace.
    rules = {}
    for binding in (d for (k, _), d in objs.items() if k == "RoleBinding"):
        role = objs[("Role", binding["roleRef"]["name"])]
        for subject in binding["subjects"]:
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        rules.setdefault((subject["name"], group, resource), set()).update(rule["verbs"])
    for pool, path in WORKERS.items():
        (deployment,) = yaml_docs(path)
        spec = deployment["spec"]["template"]["spec"]
        sa = spec["serviceAccountName"]
        assert ("ServiceAccount", sa) in objs
        assert {"create", "delete", "get", "list", "watch"} <= rules.get((sa, "batch", "jobs"), set())
        for resource in ("pods", "pods/log", "events"):
            assert {"get", "list", "watch"} <= rules.get((sa, "", resource), set()), resource
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        ref = env["PREFECT_API_URL"]["valueFrom"]["configMapKeyRef"]
        assert ref["key"] in objs[("ConfigMap", ref["name"])]["data"]
        # A namespaced Role needs a namespaced observer; cluster-wide it would need a ClusterRole.
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"]["value"] == "qad"
        assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
            "labels"].items()


# ---------------------------------------------------------------------------------------------
# workers, pools and deployments


def worker_args(pool: str) -> list[str]:
    (deployment,) = yaml_docs(WORKERS[pool])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container.get("command", []) + container["args"]


@pytest.mark.parametrize("pool", sorted(WORKERS))
def test_workers_poll_their_pool(pool):
    args = worker_args(pool)
    assert check_command(args, WORKERS[pool].name)
    assert args[:3] == ["prefect", "worker", "start"]
    option = dict(itertools.pairwise(args))
    assert option["--pool"] == pool and option["--type"] == "kubernetes"
    assert int(option["--limit"]) >= 1, "a worker without --limit would start every queued run at once"
    assert "--no-create-pool-if-not-found" in args, "a worker must not create its pool with the default template"
    (deployment,) = yaml_docs(WORKERS[pool])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    if "--with-healthcheck" in args:
        probe = container["livenessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert probe["path"] == "/health" and ports.get(probe["port"], probe["port"]) == 8080  # Prefect's default
    assert deployment["spec"]["replicas"] == 1, "each replica applies its own --limit"


def entrypoint_source(entrypoint: str) -> tuple[Path, str]:
    """The source file and function name of a prefect.yaml entrypoint `package.module:function`."""
    module, _, function = entrypoint.partition(":")
    assert not module.endswith(".py") and "/" not in module, (
        f"prefect.yaml entrypoint {entrypoint}: a file path loads a second copy of the flow's module; "
        "name it by module path (flows.pipeline:qad_pipeline)")
    return module_file(module), function


def flow_name(entrypoint: str) -> str:
    """The @flow(name=...) of a prefect.yaml entrypoint `package.module:function`."""
    file, function = entrypoint_source(entrypoint)
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", getattr(dec.func, "attr", "")) == "flow":
                    for kw in dec.keywords:
                        if kw.arg == "name":
                            value = kw.value
                            if isinstance(value, ast.Name):  # name=FLOW_NAME, a module constant
                                value = next(n.value for n in ast.parse(file.read_text()).body
                                             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == value.id)
                            return value.value
            return function.replace("_", "-")
    raise AssertionError(f"prefect.yaml entrypoint {entrypoint}: no function {function} in {file}")


def test_pools_match_prefect_yaml():
    path = ROOT / "prefect.yaml"
    assert path.is_file(), "prefect.yaml is missing: the deployments' work pools cannot be checked against infra/"
    declared = yaml.safe_load(path.read_text()) or {}
    found = {}
    for dep in declared.get("deployments") or []:
        pool = (dep.get("work_pool") or {}).get("name")
        full = f"{flow_name(dep['entrypoint'])}/{dep['name']}"
        found[full] = pool
        assert pool in TEMPLATES, f"prefect.yaml: {full} runs on {pool!r}; infra/ has pools {sorted(TEMPLATES)}"
        # Job variables must be variables of the pool's template, with valid values.
        job_variables = (dep.get("work_pool") or {}).get("job_variables") or {}
        props = template(pool)["variables"]["properties"]
        unknown = set(job_variables) - set(props)
        assert not unknown, f"prefect.yaml: {full} sets job variables its pool lacks: {sorted(unknown)}"
        merged = {k: v["default"] for k, v in props.items() if "default" in v} | job_variables
        jsonschema.validate(merged, template(pool)["variables"])
    for full, pool in DEPLOYMENT_POOLS.items():
        assert found.get(full) == pool, f"prefect.yaml: {full} should run on {pool}, found {found.get(full)!r}"


def test_prefect_yaml_entrypoints_load_the_imported_flows():
    """What a worker and `prefect deploy` load (`load_flow_from_entrypoint`) is the flow object of the
    imported module, so a process holds one copy of each flow module (a file path would load another)."""
    from prefect.flows import load_flow_from_entrypoint

    for dep in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]:
        module, _, function = dep["entrypoint"].partition(":")
        loaded = load_flow_from_entrypoint(dep["entrypoint"], use_placeholder_flow=False)
        assert loaded is getattr(importlib.import_module(module), function), dep["entrypoint"]
        assert loaded.name == flow_name(dep["entrypoint"])


def flow_defaults(entrypoint: str) -> dict:
    """The literal parameter defaults of a prefect.yaml entrypoint's flow function."""
    file, function = entrypoint_source(entrypoint)
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            args = node.args
            pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            defaults = {}
            for arg, default in pairs:
                try:
                    defaults[arg.arg] = ast.literal_eval(default)
                except ValueError:
                    pass
            return defaults
    raise AssertionError(f"{entrypoint}: no function {function} in {file}")


def shared_mounts(pool: str) -> dict[str, str]:
    """mountPath -> subPath ("" for all of it) of the pool's shared volume in its Jobs."""
    spec = template(pool)["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    shared = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    (container,) = spec["containers"]
    return {m["mountPath"]: m.get("subPath", "") for m in container["volumeMounts"] if m["name"] in shared}


def test_flow_outputs_land_on_the_shared_volume():
    workdir = next(rest for word, rest in dockerfile() if word == "WORKDIR")
    for pool in TEMPLATES:
        mounts = shared_mounts(pool)
        assert mounts.get("/workspace") == "", f"{pool}: the whole volume belongs at /workspace"
        for path, sub in mounts.items():
            assert not sub or path == f"{workdir}/{sub}", f"{pool}: {sub}/ should be mounted at {workdir}/{sub}"

    def on_volume(pool: str, path: str) -> bool:
        full = Path(path) if path.startswith("/") else Path(workdir) / path
        return any(full == Path(m) or Path(m) in full.parents for m in shared_mounts(pool) if m != workdir)

    for pool in TEMPLATES:  # out_root's default is the working directory: its outputs must be shared
        assert on_volume(pool, "artifacts/calibration") and on_volume(pool, "metrics/baseline.json")
    path = ROOT / "prefect.yaml"
    assert path.is_file(), "prefect.yaml is missing: the deployments' paths cannot be checked"
    for dep in (yaml.safe_load(path.read_text()) or {}).get("deployments") or []:
        pool = (dep.get("work_pool") or {}).get("name")
        values = flow_defaults(dep["entrypoint"]) | (dep.get("parameters") or {})
        for key in ("out_root", "state_file", "runs_root", "watch_dir"):
            if isinstance(values.get(key), str):
                assert on_volume(pool, values[key]), (
                    f"prefect.yaml {dep['name']}: {key}={values[key]!r} is not on the shared volume in {pool}'s pods")


# ---------------------------------------------------------------------------------------------
# commands and settings


def test_every_command_in_infra_exists():
    checked = 0
    for pool, path in WORKERS.items():
        checked += check_command(worker_args(pool), path.name)
    for name, service in compose()["services"].items():
        command = service.get("command")
        if isinstance(command, list):
            checked += check_command(command, f"compose.yaml {name}")
    for path in (INFRA / "Dockerfile", INFRA / "mlflow.Dockerfile"):
        for word, rest in dockerfile(path):
            if word == "CMD":
                checked += check_command(json.loads(rest), f"{path.name} CMD")
            elif word == "RUN":
                for argv in shell_commands(rest):
                    checked += check_command(argv, f"{path.name} RUN")
    for argv in readme_commands():
        checked += check_command(argv, "infra/README.md")
    assert checked >= 15, f"only {checked} commands found to check"
    assert "qad-pipeline" in pyproject()["project"]["scripts"]


def test_readme_covers_the_walkthrough():
    text = (INFRA / "README.md").read_text()
    commands = [shlex.join(c) for c in readme_commands()]
    for pool, path in TEMPLATES.items():
        wanted = f"prefect work-pool create {pool} --type kubernetes --base-job-template {path.relative_to(ROOT)}"
        assert wanted in commands, f"the README does not create {pool} with its template"
    for needed in ("prefect --no-prompt deploy --all", "prefect deployment run qad-pipeline/default",
                   "prefect deployment schedule resume watch-base-checkpoints/cron"):
        assert any(needed in c for c in commands), needed
    # The image is set as the templates' default with sed: its pattern must be that default.
    (sed,) = [c for c in readme_commands() if c[:2] == ["sed", "-i"]]
    old_image = re.fullmatch(r's#"([^"]+)"#"[^"]+"#', sed[2])[1]
    for pool, path in TEMPLATES.items():
        assert template(pool)["variables"]["properties"]["image"]["default"] == old_image
        assert str(path.relative_to(ROOT)) in sed[3:]
    for path in set(re.findall(r"(?<![\w/])(infra/[\w./-]+[\w])", text)) - {"infra/.env"}:  # .env: the reader's
        assert (ROOT / path).exists(), f"the README names {path}, which does not exist"


def test_prefect_settings_exist():
    from prefect.settings import Settings
    from prefect.settings.legacy import _get_valid_setting_names

    valid = _get_valid_setting_names(Settings)
    if importlib.util.find_spec("prefect_kubernetes") is not None:
        from prefect_kubernetes.settings import KubernetesSettings

        valid |= _get_valid_setting_names(KubernetesSettings)
    texts = [p.read_text() for p in INFRA.rglob("*") if p.is_file()]
    build_args = set(docker_args()) | set(docker_args(INFRA / "mlflow.Dockerfile"))
    used = set(re.findall(r"\bPREFECT_[A-Z0-9_]*[A-Z0-9]", "\n".join(texts))) - build_args
    if importlib.util.find_spec("prefect_kubernetes") is None:
        used = {u for u in used if not u.startswith("PREFECT_INTEGRATIONS_KUBERNETES_")}
    assert used, "no Prefect settings found in infra/"
    assert not used - valid, f"not Prefect settings: {sorted(used - valid)}"


# ---------------------------------------------------------------------------------------------
# compose


def listening_ports(service: dict) -> set[int]:
    """Ports a compose service's container listens on: from its command, or its image's default."""
    command, image = service.get("command") or [], service.get("image", "")
    ports = set()
    if isinstance(command, list):
        if "--port" in command:
            ports.add(int(command[command.index("--port") + 1]))
        if "--console-address" in command:
            ports.add(int(command[command.index("--console-address") + 1].rsplit(":", 1)[1]))
    if image.startswith("postgres:"):
        ports.add(5432)
    if image.startswith(("minio/minio:", "quay.io/minio/minio:")):
        ports.add(9000)
    return ports


URL = re.compile(r"\b([a-z][a-z0-9+.-]*)://(?:[^@/\s'\"]*@)?([A-Za-z0-9_.-]+):(\d+)")


def test_compose_services_reference_each_other():
    services = compose()["services"]
    raw_services = yaml_docs(INFRA / "compose.yaml")[0]["services"]

    def needs(name: str, seen=()) -> set[str]:
        direct = set(services[name].get("depends_on") or {})
        return direct.union(*(needs(d, seen + (name,)) for d in direct if d not in seen))

    for name, service in services.items():
        for dep, condition in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on {dep!r}, which is not a service"
            condition = condition["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is one-shot; it must not restart"
            else:
                assert condition == "service_started", condition
        if service.get("restart") != "no":
            assert "healthcheck" in service, f"{name} has no healthcheck"
        own = listening_ports(service)
        for published in service.get("ports", []):
            assert int(str(published).rsplit(":", 1)[1]) in own, f"{name} publishes {published}, not a port it listens on"
        for text in walk_strings(service.get("healthcheck", {})):
            for _, host, port in URL.findall(text):
                assert host in ("127.0.0.1", "localhost") and int(port) in own, f"{name} healthcheck: {text}"
        for key, text in [*((k, v) for k, v in (service.get("environment") or {}).items()),
                          *(("command", c) for c in walk_strings(service.get("command", [])))]:
            for _, host, port in URL.findall(str(text)):
                if key.endswith("UI_API_URL"):  # the browser's URL of this service: its published port
                    published = {int(str(p).rsplit(":", 2)[-2]) for p in service.get("ports", [])}
                    assert int(port) in published, f"{name} {key}={text}: not a published port"
                    continue
                assert host in services, f"{name} {key}: {text} names no service"
                assert int(port) in listening_ports(services[host]), f"{name} {key}: {host} does not listen on {port}"
                assert host in needs(name), f"{name} uses {host} ({key}) without depending on it"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (INFRA / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in (compose().get("volumes") or {}), f"{name}: volume {source} is not declared"
        if "build" in service:
            build = service["build"]
            assert (INFRA / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
        image = service.get("image", "")
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image ({image!r})"
        # No secret in the file itself: every password, secret or key comes from the environment.
        for key, value in (raw_services[name].get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY", key):
                assert "${" in str(value), f"{name} {key} holds a literal value"
    for text in walk_strings(raw_services):
        for user_pass in re.findall(r"://[^:/@\s]+:([^@\s]+)@", text):
            assert user_pass.startswith("${"), f"a literal password in {text}"


def test_compose_publishes_on_localhost_unless_configured():
    """Prefect, MLflow and MinIO have no authentication of their own here: published on 127.0.0.1 by default."""
    env = {k: v for k, v in dotenv_example().items() if k != "QAD_PUBLISH_ADDRESS"}
    services = interpolate(yaml_docs(INFRA / "compose.yaml")[0], env)["services"]
    published = [(name, str(p)) for name, service in services.items() for p in service.get("ports", [])]
    assert {name for name, _ in published} == {"minio", "mlflow", "prefect-server"}
    for name, port in published:
        assert port.count(":") == 2 and port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    exposed = interpolate(yaml_docs(INFRA / "compose.yaml")[0], {**env, "QAD_PUBLISH_ADDRESS": "0.0.0.0"})
    assert all(str(p).startswith("0.0.0.0:") for s in exposed["services"].values() for p in s.get("ports", []))
    assert "QAD_PUBLISH_ADDRESS" in (INFRA / "README.md").read_text()


def test_compose_variables_are_documented():
    text = "\n".join(walk_strings(yaml_docs(INFRA / "compose.yaml")[0]))
    documented = dotenv_example()
    for name, op in compose_variables(text):
        assert name in documented or (op or "").endswith("-"), f"{name} is neither in .env.example nor defaulted"
    required = {name for name, op in compose_variables(text) if (op or "").endswith("?")}
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"} <= required, "passwords must be required, never defaulted"


def test_compose_databases_and_stores():
    services = compose()["services"]
    mlflow_cmd = services["mlflow"]["command"]
    option = dict(itertools.pairwise(mlflow_cmd))
    backend = option["--backend-store-uri"]
    # The driver must be named: SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3, older ones as psycopg2.
    driver = re.match(r"postgresql\+(psycopg2|psycopg)://[^@]+@postgres:5432/(\w+)$", backend)
    assert driver, backend
    package = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]"}[driver[1]]
    assert package in (INFRA / "mlflow.Dockerfile").read_text(), f"the MLflow image lacks {package} for {backend}"
    created = re.findall(r"CREATE DATABASE (\w+)", (INFRA / "postgres-init.sql").read_text(), re.IGNORECASE)
    assert backend.rsplit("/", 1)[1] in created
    assert option["--artifacts-destination"].startswith("s3://")
    bucket = option["--artifacts-destination"][len("s3://"):].split("/")[0]
    assert services["create-bucket"]["environment"]["MLFLOW_BUCKET"] == bucket
    assert option["--host"] == "0.0.0.0"
    prefect_db = services["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert re.match(r"postgresql\+asyncpg://[^@]+@postgres:5432/(\w+)$", prefect_db), prefect_db
    assert prefect_db.rsplit("/", 1)[1] == services["postgres"]["environment"]["POSTGRES_DB"]
    assert services["prefect-server"]["environment"]["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    # The ConfigMap's server URLs use the ports compose publishes.
    config = next(d for d in yaml_docs(K8S / "base.yaml") if d["kind"] == "ConfigMap")["data"]
    for key, service in (("PREFECT_API_URL", "prefect-server"), ("MLFLOW_TRACKING_URI", "mlflow")):
        port = int(re.search(r":(\d+)", config[key].split("://", 1)[1])[1])
        assert port in {int(str(p).rsplit(":", 2)[-2]) for p in services[service]["ports"]}, key


# ---------------------------------------------------------------------------------------------
# the image and the versions


def test_versions_agree_everywhere():
    args = docker_args()
    prefect_version, mlflow_version = args["PREFECT_VERSION"], args["MLFLOW_VERSION"]
    assert Version(prefect_version) in requirement("prefect").specifier
    assert Version(mlflow_version) in requirement("mlflow").specifier
    images = [compose()["services"]["prefect-server"]["image"]]
    for path in WORKERS.values():
        (deployment,) = yaml_docs(path)
        images += [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]
    for image in images:
        assert re.fullmatch(rf"prefecthq/prefect:{re.escape(prefect_version)}-python3\.\d+(-kubernetes)?", image), (
            f"{image}: the Prefect server, the workers and the flow image share Prefect {prefect_version}")
    assert docker_args(INFRA / "mlflow.Dockerfile")["MLFLOW_VERSION"] == mlflow_version
    for name in ("mlflow", "create-bucket"):
        assert compose()["services"][name]["image"].endswith(f":{mlflow_version}")


def test_dockerfile_builds_the_project_on_cuda_torch():
    instructions = dockerfile()
    args = docker_args()
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"(nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3|pytorch/pytorch:[\d.]+-cuda1[2-9]\.\d+-cudnn\d+-(runtime|devel))",
                        base), f"{base}: not a CUDA PyTorch image"
    assert ("FROM", "${BASE_IMAGE}") in instructions
    text = (INFRA / "Dockerfile").read_text()
    assert not re.search(r"torch==2\.13\.0|download\.pytorch\.org/whl/cpu|\+cpu", text), "the CPU torch must stay out"
    runs = [rest for word, rest in instructions if word == "RUN"]
    installs = [part for run in runs for part in run.split("&&") if re.search(r"\bpip install\b", part)]
    assert installs and all("PIP_CONSTRAINT=" in part for part in installs), "every pip install keeps the base torch"
    assert any(re.search(r"pip install -e \.", part) for part in installs)
    for run in runs:  # the inline Python of the RUN lines at least compiles
        for argv in shell_commands(run):
            if argv[:2] == ["python", "-c"]:
                compile(argv[2], "<Dockerfile RUN>", "exec")

    workdir = next(rest for word, rest in instructions if word == "WORKDIR")
    assert workdir.startswith("/")
    copied = set()
    for word, rest in instructions:
        if word == "COPY":
            *sources, _ = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
                copied.add(source.rstrip("/"))
    # What the package and the default params need at run time is in the image.
    packages = {p.replace(".", "/") for p in pyproject()["tool"]["setuptools"]["packages"]}
    needed = packages | {"pyproject.toml", "params.yaml", "prefect.yaml"}  # deployed from inside the image
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for value in (params["base_model"]["path"], params["calibration"]["source"], params["ptq"]["recipe_dir"],
                  params["eval"]["task_dir"]):
        if not value.startswith("/") and (ROOT / value).exists():
            needed.add(value)
    missing = {n for n in needed if not any(n == c or n.startswith(c + "/") for c in copied)}
    assert not missing, f"not copied into the image: {sorted(missing)}"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "run as a non-root user"
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)
