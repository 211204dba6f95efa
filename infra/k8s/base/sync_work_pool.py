"""Create or update one Prefect work pool from its base job template and the overlay's values.

Run by the init container of each Prefect worker (infra/k8s/base/worker-*.yaml), from the worker's
own image, before the worker starts:

    python /etc/qad/work-pools/sync_work_pool.py qad-gpu /etc/qad/work-pools/gpu-base-job-template.json /etc/qad/pool-values

The template is one of the JSON files of infra/k8s/base/ (a ConfigMap mounted there). The values
folder is the pool's ConfigMap (`qad-pool-gpu`, `qad-pool-control`), one file per key:

- a job variable of the template (`image`, `memory_request`, `node_selector`, `tolerations`, ...)
  sets that variable's default: a string variable takes the text as it is, any other the text
  parsed as JSON. Kustomize's `images:` rewrites the `image` key; overlays merge the others.
- `gpus` is the GPUs of one node of the pool: the `maximum` of the template's `gpus` variable (the
  Job's `nvidia.com/gpu` request and limit, which each flow run sets to what its stage needs:
  qad_pipeline/plan/pools.py), only in a template that has that variable. Prefect's server refuses a
  flow run that asks for more, and the pipeline's preflight refuses the run before that.

The namespace's default is the pod's own (POD_NAMESPACE, from the downward API): the worker's Role
lets it run Jobs there only. The pool is created when missing; otherwise only its base job
template is replaced (its concurrency limit and paused state stay). A pool of another type (a
process pool of the same name) is refused. Uses Prefect's own client (PREFECT_API_URL,
PREFECT_API_AUTH_STRING); a server that is not up yet fails the container, which Kubernetes retries.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

GPU = "nvidia.com/gpu"


def read_values(folder: Path) -> dict[str, str]:
    """The ConfigMap's keys and texts (a mounted ConfigMap also holds hidden `..data` links)."""
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def with_values(template: dict, values: dict[str, str], namespace: str | None = None) -> dict:
    """The template with the values as defaults (see the module's docstring); raises ValueError
    naming a bad key or value."""
    import jsonschema

    out = copy.deepcopy(template)
    props = out["variables"]["properties"]
    for key, text in values.items():
        if key == "gpus":
            set_gpus(out, text)
            continue
        if key not in props:
            raise ValueError(f"{key!r} is not a job variable of this template (valid: {', '.join(sorted({*props, 'gpus'}))})")
        types = {option.get("type") for option in props[key].get("anyOf", [props[key]])}
        if types <= {"string", "null"}:
            props[key]["default"] = text
        else:
            try:
                props[key]["default"] = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{key}: {text!r} is not JSON ({err})") from None
    if namespace:
        props["namespace"]["default"] = namespace
    defaults = {k: v["default"] for k, v in props.items() if "default" in v}
    try:
        jsonschema.validate(defaults, out["variables"])
    except jsonschema.ValidationError as err:
        raise ValueError(f"{'.'.join(map(str, err.absolute_path)) or 'values'}: {err.message}") from None
    return out


def set_gpus(template: dict, text: str) -> None:
    """The pool's GPUs per node: the most one Job may ask for (its default is kept, capped at that)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"gpus: {text!r} is not a GPU count (a whole number, 1 or more)")
    variable = template["variables"]["properties"].get("gpus")
    if variable is None:
        raise ValueError("gpus: this template requests no GPU (only a GPU pool's count can be changed)")
    variable["maximum"] = int(text)
    variable["default"] = min(variable.get("default", 1), int(text))


def sync(pool: str, template: dict) -> str:
    """Create the Kubernetes work pool, or replace its base job template; returns what was done."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="kubernetes", base_job_template=template))
            return f"work pool {pool} created"
        if existing.type != "kubernetes":
            raise ValueError(f"work pool {pool} exists as a {existing.type!r} pool, not a Kubernetes one: "
                             f"delete it (prefect work-pool delete {pool}) and restart this worker")
        if existing.base_job_template == template:
            return f"work pool {pool}: base job template unchanged"
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
        return f"work pool {pool}: base job template updated"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: sync_work_pool.py POOL TEMPLATE_JSON VALUES_DIR", file=sys.stderr)
        return 2
    pool, template_file, values_dir = argv
    try:
        template = with_values(json.loads(Path(template_file).read_text()), read_values(Path(values_dir)),
                               os.environ.get("POD_NAMESPACE"))
        print(sync(pool, template))
    except ValueError as err:
        print(f"{pool}: {err}", file=sys.stderr)
        return 1
    image = template["variables"]["properties"]["image"]["default"]
    print(f"work pool {pool}: image {image}, namespace {template['variables']['properties']['namespace']['default']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
