"""The calibration and held-out eval data as MLflow datasets: known by their manifest (name,
fingerprint, source, counts), holding no data, logged as run inputs."""

from __future__ import annotations

import functools
import json
import warnings
from typing import TYPE_CHECKING

from qad_pipeline.core.config import Params, resolve
from qad_pipeline.core.redaction import redact, redact_text
from qad_pipeline.results.base import dump_result
from qad_pipeline.results.data import CalibrationManifest

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient
    from mlflow.data.dataset import Dataset


@functools.cache
def _manifest_dataset_class() -> type:
    """A MetaDataset with a profile: known by its manifest (name, fingerprint, source, counts),
    holding no data. Built on first use: mlflow is imported lazily."""
    from mlflow.data.meta_dataset import MetaDataset

    class ManifestDataset(MetaDataset):
        def __init__(self, source, name: str, digest: str, schema, profile: dict):
            self._profile = profile
            super().__init__(source=source, name=name, digest=digest, schema=schema)

        @property
        def profile(self) -> dict:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile)}

    return ManifestDataset


def dataset_source(source: str, params: Params):
    """The calibration source as an MLflow dataset source: a local path or a Hugging Face dataset."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    source = redact_text(source)
    local = resolve(source)
    if local.exists():
        try:
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": all are local
                warnings.simplefilter("ignore", UserWarning)
                return resolve_dataset_source(str(local))
        except Exception:  # noqa: BLE001 (no local source registered: fall through)
            pass
    cal = params.calibration
    config = None if cal.dataset_config is None else redact("dataset_config", cal.dataset_config)
    return HuggingFaceDatasetSource(path=source, config_name=config, split=cal.split)


def manifest_datasets(manifest: CalibrationManifest, params: Params) -> list[tuple[Dataset, str]]:
    """The calibration and held-out eval datasets of a calibration manifest, with their contexts.

    Name `calibration` / `eval`; digest: the manifest's fingerprint, cut to the 36 characters
    MLflow stores (the full fingerprint is in the dataset's profile and the input tag
    `fingerprint`); source: the calibration source (a local path or a Hugging Face dataset).
    """
    import numpy as np
    from mlflow.types import Schema, TensorSpec
    from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

    source = dataset_source(manifest.source or params.calibration.source, params)
    out = []
    for name, context, part in (("calibration", "calibration", manifest.calibration),
                                ("eval", "evaluation", manifest.eval)):
        schema = Schema([TensorSpec(np.dtype("int64"), (-1, part.seq_len), "input_ids")]) if part.seq_len else None
        digest = part.fingerprint[:MAX_DATASET_DIGEST_SIZE]
        out.append((_manifest_dataset_class()(source, name, digest, schema, dump_result(part)), context))
    return out


def log_inputs(client: MlflowClient, run_id: str, datasets: list[tuple[Dataset, str]]) -> None:
    """mlflow.log_input's entity, logged through the client (no active run needed), each dataset
    with its context and its full fingerprint as input tags."""
    from mlflow.entities import Dataset as DatasetEntity
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
    from mlflow.utils.validation import MAX_INPUT_TAG_VALUE_SIZE

    inputs = []
    for dataset, context in datasets:
        d = dataset.to_dict()  # the public form of what mlflow.log_input turns into the entity
        entity = DatasetEntity(name=d["name"], digest=d["digest"], source_type=d["source_type"], source=d["source"],
                               schema=d.get("schema"), profile=d.get("profile"))
        full = json.loads(d["profile"]).get("fingerprint", dataset.digest)
        inputs.append(DatasetInput(dataset=entity, tags=[
            InputTag(MLFLOW_DATASET_CONTEXT, context),
            InputTag("fingerprint", str(full)[:MAX_INPUT_TAG_VALUE_SIZE]),
        ]))
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
