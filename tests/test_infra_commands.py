"""Offline checks of infra/'s commands and settings: every `prefect`, `mlflow` and `qad-pipeline` command
(workers, compose, Dockerfiles, infra/README.md) parses with the installed tool, the README walks
through the whole setup, and every PREFECT_* variable is a Prefect setting."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex

import yaml

from tests.infra_commands import check_command, readme_commands, shell_commands
from tests.infra_files import (
    BASE,
    INFRA,
    ROOT,
    TEMPLATES,
    WORKERS,
    compose,
    container_args,
    docker_args,
    dockerfile,
    pyproject,
    worker_args,
    yaml_docs,
)
from tests.infra_kustomize import containers, pod_templates, rendered


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
    for name, spec in pod_templates(rendered("trial")).items():  # the trial's servers
        for container in containers(spec):
            checked += check_command(container_args(container), f"overlays/trial {name}")
    assert checked >= 15, f"only {checked} commands found to check"
    assert "qad-pipeline" in pyproject()["project"]["scripts"]


def test_readme_covers_the_walkthrough():
    text = (INFRA / "README.md").read_text()
    commands = [shlex.join(c) for c in readme_commands()]
    assert "kubectl apply -k infra/k8s/overlays/trial" in commands
    for needed in ("prefect --no-prompt deploy --all", "prefect deployment run qad-pipeline/default",
                   "prefect deployment schedule resume watch-base-checkpoints/cron", "qad-pipeline prefect-setup --kubernetes"):
        assert any(needed in c for c in commands), needed
    # No hand edits: the image and every other value are overlay values, not sed.
    for doc in (INFRA / "README.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", doc.read_text(), re.DOTALL):
            assert not [c for c in shell_commands(block) if c[:1] == ["sed"]], f"{doc.name}: a sed step is left"
    # Each worker's init container makes its pool from that pool's template, mounted from qad-work-pools.
    generated = yaml.safe_load((BASE / "kustomization.yaml").read_text())["configMapGenerator"]
    files = next(g["files"] for g in generated if g["name"] == "qad-work-pools")
    for pool, path in TEMPLATES.items():
        (deployment,) = yaml_docs(WORKERS[pool])
        (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
        assert init["command"][:3] == ["python", "/etc/qad/work-pools/sync_work_pool.py", pool]
        assert init["command"][3] == f"/etc/qad/work-pools/{path.name}" and path.name in files
        assert "sync_work_pool.py" in files
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
