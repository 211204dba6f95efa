"""`qad-pipeline prefect-setup`: the work pools and the crash-detection automation, in one command.

- `qad-control` and `qad-gpu` work pools: process pools (a local machine), or Kubernetes pools
  with the base job templates of infra/k8s/base/ (`--kubernetes`; one `nvidia.com/gpu` per recipe run).
  An existing pool is left as it is.
- The automation "qad-pipeline: crash unresponsive flow runs": a flow run that was sending
  heartbeats and stops for `heartbeat_timeout` seconds without reaching a final state is marked
  Crashed. This is what reports a recipe run whose worker died with it (a lost node); the parent
  `qad-pipeline` run then reports the recipe as missing. Heartbeats are on when the workers run
  with `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` set (30 s or more; the infra manifests set it).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from qad_pipeline.core.config import PROJECT_ROOT

POOLS = {"qad-control": "control-base-job-template.json", "qad-gpu": "gpu-base-job-template.json"}
AUTOMATION = "qad-pipeline: crash unresponsive flow runs"


def create_pools(kubernetes: bool, template_dir: Path = PROJECT_ROOT / "infra" / "k8s" / "base") -> list[str]:
    """Create the two work pools that do not exist yet; returns what was done, one line each."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    done = []
    with get_client(sync_client=True) as client:
        for name, template in POOLS.items():
            pool = WorkPoolCreate(name=name, type="kubernetes" if kubernetes else "process")
            if kubernetes:
                pool.base_job_template = json.loads((template_dir / template).read_text())
            try:
                client.create_work_pool(pool)
                done.append(f"work pool {name} ({pool.type}) created")
            except ObjectAlreadyExists:
                done.append(f"work pool {name} exists, left as it is")
    return done


def create_crash_automation(heartbeat_timeout: int = 90) -> str:
    """Create the automation unless one of that name exists; returns what was done."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        Automation.read(name=AUTOMATION)
        return f"automation {AUTOMATION!r} exists, left as it is"
    except ValueError:
        pass
    Automation(
        name=AUTOMATION,
        description="A flow run that stopped sending heartbeats (its process or node died) is marked Crashed.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=heartbeat_timeout),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {heartbeat_timeout} s: its process or node died")],
    ).create()
    return f"automation {AUTOMATION!r} created (heartbeat timeout {heartbeat_timeout} s)"
