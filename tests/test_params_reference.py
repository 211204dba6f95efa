"""docs/params.md, generated from params.yaml's comments: every key of the Params model described,
and the page what `qad-pipeline params-doc` writes."""

import re

from typer.testing import CliRunner

from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_PARAMS, Params
from qad_pipeline.core.params_reference import REFERENCE, model_keys, read_reference, reference_markdown, undocumented


def test_every_key_of_the_model_has_a_description_in_params_yaml():
    assert len(model_keys()) == sum(len(field.annotation.model_fields) for field in Params.model_fields.values())
    assert undocumented() == [], "describe these keys with a comment in params.yaml, then run `qad-pipeline params-doc`"


def test_a_key_without_a_comment_or_absent_from_params_yaml_is_undocumented(tmp_path):
    text = PROJECT_PARAMS.read_text()
    text = text.replace("  seed: 0                   # the split into", "  seed: 0\n  #                 the split into")
    text = text.replace("  compile: false            # torch.compile", "  # compile: false  # torch.compile")
    bare = tmp_path / "params.yaml"
    bare.write_text(text)
    assert undocumented(bare) == ["calibration.seed", "qad.compile"]


def test_the_reference_is_current():
    assert REFERENCE.read_text() == reference_markdown(), "docs/params.md is stale: run `qad-pipeline params-doc`"
    result = CliRunner().invoke(app, ["params-doc", "--check"])
    assert result.exit_code == 0 and "is current" in result.output


def test_the_page_has_one_table_per_section_with_every_key():
    text = REFERENCE.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Parameters" and "`qad-pipeline params-doc`" in lines[2]
    headings = [line for line in lines if line.startswith("## ")]  # in params.yaml's order
    assert sorted(headings) == sorted(f"## `{name}`" for name in Params.model_fields)
    rows = [line for line in lines if line.startswith("| `")]
    assert sorted(row.split("`")[1] for row in rows) == sorted(model_keys())
    assert all(len(re.split(r"(?<!\\)\|", row)) == 5 for row in rows)  # three cells: a `|` in the text is escaped
    assert "| `hardware.device` | `auto` | auto: CUDA when this process sees a GPU, else CPU \\| cpu \\| cuda |" in rows
    assert "&lt;recipe>" in text and "<recipe>" not in text  # no stray HTML tag


def test_comments_are_read_as_yaml_writes_them(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        "# The page's introduction,\n# two lines.\n\n# Not the introduction.\n"
        "hardware:\n"
        "  # The section.\n"
        "  max_memory: {\"0\": \"70#GiB\"}  # a '#' in a quoted value is no comment\n"
        "                            # and this line continues it\n"
        "  # The comment above a later key\n"
        "  target: null   # and its own\n"
        "  device: cpu\n"
    )
    header, [section] = read_reference(params)
    assert header == ["The page's introduction,", "two lines."]
    assert section.intro == ["The section."]
    described = {key.name: (key.default, key.description) for key in section.keys}
    assert described == {
        "hardware.max_memory": ({"0": "70#GiB"}, "a '#' in a quoted value is no comment and this line continues it"),
        "hardware.target": (None, "The comment above a later key and its own"),
        "hardware.device": ("cpu", ""),
    }
