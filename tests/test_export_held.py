"""The export's refusal to overwrite a folder it did not write (tasks/export.py: check_target), for
any manifest a folder may hold: the source it names, another one, or none."""

import pytest

from qad_pipeline.core.artifacts import write_json
from qad_pipeline.core.config import ConfigError
from tasks.export import MANIFEST, check_target

SOURCE = "0123456789abcdef" * 4


def test_an_empty_or_missing_folder_and_an_export_of_the_same_source_are_accepted(tmp_path):
    check_target(tmp_path / "absent", SOURCE)
    check_target(tmp_path, SOURCE)
    write_json(tmp_path / MANIFEST, {"source": SOURCE, "exported": "qad"})
    check_target(tmp_path, SOURCE)


def test_an_export_of_another_source_is_refused_with_that_source(tmp_path):
    write_json(tmp_path / MANIFEST, {"source": "fedcba9876543210" * 4})
    with pytest.raises(ConfigError, match=r"holds a different checkpoint \(source fedcba987654…\)"):
        check_target(tmp_path, SOURCE)


@pytest.mark.parametrize("manifest", [{}, {"source": None}, {"source": 12}, {"exported": "qad"}])
def test_a_manifest_without_a_source_is_refused_with_a_reason_not_a_type_error(tmp_path, manifest):
    write_json(tmp_path / MANIFEST, manifest)
    with pytest.raises(ConfigError, match=f"holds an export whose {MANIFEST} names no source; remove it"):
        check_target(tmp_path, SOURCE)


def test_a_folder_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a qad-pipeline export"):
        check_target(tmp_path, SOURCE)
