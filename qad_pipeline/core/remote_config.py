"""params.yaml's `versioning:` section: the DVC remote a run's outputs are pushed to after it.

    versioning:
      remote: {url: s3://qad-dvc/runs, endpoint_url: http://minio:9000, region: null, push: true}

`remote: null` (the default) takes the remote from the environment when `QAD_DVC_REMOTE` is set
(with `QAD_DVC_ENDPOINT_URL`, `QAD_DVC_REGION`): the cluster's ConfigMap names the object store
there, as it names MLflow's with MLFLOW_TRACKING_URI. Credentials never come from here: DVC's S3
client reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or any source boto3 knows) from the
environment, and `config.check_no_secrets` refuses a URL that carries any.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

S3_URL = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?$")  # S3's bucket naming rules
ENV = {"url": "QAD_DVC_REMOTE", "endpoint_url": "QAD_DVC_ENDPOINT_URL", "region": "QAD_DVC_REGION"}


class RemoteParams(BaseModel):
    """A DVC remote: an S3-API bucket (AWS S3, MinIO, ...) or an absolute local/NFS folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str  # s3://bucket[/prefix], or /an/absolute/folder
    endpoint_url: str | None = None  # an S3-API server other than AWS's, e.g. http://minio:9000
    region: str | None = None
    push: bool = True  # false: the outputs are committed to the run's DVC cache, `qad-pipeline push` sends them

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if S3_URL.match(url) or (url.startswith("/") and "://" not in url):
            return url.rstrip("/") or url
        raise ValueError(f"{url!r} is not s3://<bucket>[/<prefix>] (a lowercase bucket name, 3-63 characters) "
                         "or an absolute folder")

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^https?://[^/\s@]+(/[^\s]*)?$", url):
            raise ValueError(f"{url!r} is not an http(s):// URL such as http://minio:9000 (no credentials in it)")
        return url

    def dvc_settings(self) -> dict[str, str]:
        """The remote's settings in DVC's config (`dvc remote modify <name> <key> <value>`)."""
        return {key: value for key, value in (("endpointurl", self.endpoint_url), ("region", self.region)) if value}


class VersioningParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    remote: RemoteParams | None = None


def configured_remote(versioning: VersioningParams, environ=os.environ) -> RemoteParams | None:
    """The remote a run pushes to: `versioning.remote`, else the environment's (`QAD_DVC_REMOTE`);
    None: no remote. A bad environment value is a ValueError naming the variable."""
    if versioning.remote is not None or not environ.get(ENV["url"]):
        return versioning.remote
    values = {key: environ[name] for key, name in ENV.items() if environ.get(name)}
    try:
        return RemoteParams(**values)
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"{ENV[first['loc'][0]]}={first['input']!r}: {first['msg'].removeprefix('Value error, ')}"
                         ) from None
