"""The stages' JSON files as pydantic models, one per file (the comments name each file), in one
module per stage that writes them, so a stage's code dependencies hold only the schemas it reads
or writes: a field added to the export's file re-runs the export, not calibration or PTQ.
This package imports nothing: import the module (`from qad_pipeline.results.export_metrics import ...`).

A stage writes its file with `write_result(path, model)`; its readers read it with
`read_result(path, Model)` and use attributes. Each file's top level, and every nested object that
code reads by key, forbids unknown keys: a file that does not match is refused with the file and
the key named. Free-form maps (lm-eval's metrics, per-layer formats, the export's check results)
stay dicts. The JSON is what the stages wrote before these models (DVC, MLflow and users read it):
a model declares its fields in the order its writer writes them, and an optional field that a
writer does not set stays out of the file (`dump_result`).
"""
