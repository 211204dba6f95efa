"""Offline checks of infra/compose.yaml: services reference each other by names and ports that exist,
publish on localhost unless configured, take every secret from the environment, and wire MLflow and
Prefect to their databases and stores."""

from __future__ import annotations

import itertools
import re

from tests.infra_files import BASE, INFRA, compose, compose_variables, dotenv_example, env_file, interpolate, yaml_docs


def walk_strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from walk_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk_strings(v)
    elif isinstance(obj, str):
        yield obj


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
    prefect_env = services["prefect-server"]["environment"]
    assert prefect_env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    # Concurrency leases on disk (docs/faults.md), under PREFECT_HOME on a named volume.
    assert prefect_env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == "prefect.server.concurrency.lease_storage.filesystem"
    mounts = dict(v.split(":")[:2][::-1] for v in services["prefect-server"]["volumes"])
    assert mounts.get(prefect_env["PREFECT_HOME"]) in compose()["volumes"], "PREFECT_HOME must be on a volume"
    # The base ConfigMap's example server URLs use the ports compose publishes.
    config = env_file(BASE / "qad-config.env")
    for key, service in (("PREFECT_API_URL", "prefect-server"), ("MLFLOW_TRACKING_URI", "mlflow")):
        port = int(re.search(r":(\d+)", config[key].split("://", 1)[1])[1])
        assert port in {int(str(p).rsplit(":", 2)[-2]) for p in services[service]["ports"]}, key
