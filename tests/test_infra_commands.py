"""Offline checks of infra/'s commands and settings: every `prefect`, `mlflow` and `qad-pipeline` command
(workers, compose, Dockerfiles, infra/README.md) parses with the installed tool, the README walks
through the whole setup, and every PREFECT_* variable is a Prefect setting."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex

from tests.infra_commands import check_command, readme_commands, shell_commands
from tests.infra_files import (
    INFRA,
    ROOT,
    TEMPLATES,
    WORKERS,
    compose,
    docker_args,
    dockerfile,
    pyproject,
    template,
    worker_args,
)


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
