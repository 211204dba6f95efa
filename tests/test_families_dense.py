"""The architecture matrix (tests/families.py): Dense families, each through every stage of the DAG."""

import pytest

from tests.families import FAMILIES, run_family
from tests.family_checks import check_family


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mistral", "phi3"])
def test_family_through_the_dag(name, tmp_path, demo_model_path):
    params, layout = run_family(FAMILIES[name], tmp_path, demo_model_path)
    check_family(name, params, layout)
