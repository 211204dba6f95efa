"""Shared fixtures: the bundled demo model and the project's own paths."""

import os

import pytest

from qad_pipeline.config import PROJECT_ROOT

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

DEMO_MODEL = PROJECT_ROOT / "demo" / "model"


@pytest.fixture(scope="session")
def demo_model_path():
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.fail(f"the bundled demo model is missing at {DEMO_MODEL}; retrain it with demo/train_demo_model.py")
    return DEMO_MODEL
