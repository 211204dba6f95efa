"""Whether a hub model can be had, said in one line before any work (`check_hub_access`).

A `base_model.path` that is a hub id (not a local folder) is downloaded by the stages, hours into a
run on a cluster. The preflight asks first, cheaply: is that revision's config and weights in the
local Hugging Face cache (then nothing else matters), else may the hub be used (not
`HF_HUB_OFFLINE`), does it answer, and does it serve the model's `config.json` to the token at
hand (`HF_TOKEN`, or the token file of `hf auth login`: `huggingface_hub.get_token`)? One HEAD
request, as a download starts with; no weights. A gated model without access, a private or unknown
id, an unknown revision, an unreachable hub: each is one `ConfigError` line naming the value and
what would work (a local folder, HF_TOKEN, the cache).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from qad_pipeline.core.config import BaseModelParams, ConfigError

HUB_TIMEOUT_S = 10  # huggingface_hub's own default for a metadata request
TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub reads as set


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, as this process's huggingface_hub read it at import or as it is set now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE


def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The local cache's folder of that revision when it holds the config and the weight files
    (all that the safetensors index names, else some *.safetensors or *.bin), else None."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo, "config.json", revision=revision or "main")
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return folder if all((folder / name).is_file() for name in files) else None
    return folder if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) else None


def check_hub_access(params: BaseModelParams) -> None:
    """The stages can download the hub model `params.path` at `params.revision`: a `ConfigError`
    line naming it and what would work otherwise."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    repo, revision = params.path, params.revision
    if cached_snapshot(repo, revision) is not None:
        return
    at = f"@{revision}" if revision else ""
    cache = constants.HF_HUB_CACHE
    local = f"give a local folder as base_model.path, or download it into the Hugging Face cache {cache} " \
            f"(`hf download {repo}{f' --revision {revision}' if revision else ''}`)"
    if hub_offline():
        raise ConfigError(f"base_model.path {repo!r}{at} is a hub id, HF_HUB_OFFLINE is set and its weights are not in "
                          f"the local cache: {local}, or unset HF_HUB_OFFLINE")
    token = huggingface_hub.get_token()
    who = "this HF_TOKEN" if token else "no HF_TOKEN (nor a token file of `hf auth login`)"
    url = huggingface_hub.hf_hub_url(repo, "config.json", revision=revision)  # at $HF_ENDPOINT
    try:
        huggingface_hub.get_hf_file_metadata(url, token=token or False, timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError as err:
        raise ConfigError(f"base_model.path {repo!r} is a gated model and the hub refused {who} "
                          f"(HTTP {err.response.status_code}): accept its terms on the hub and set HF_TOKEN to a "
                          f"token of that account (on Kubernetes: the qad-hf Secret), or {local}") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"base_model.revision {revision!r} is not a revision of {repo!r} on the hub") from None
    except errors.RemoteEntryNotFoundError:
        return  # the repository is there; reading its config says what it lacks
    except errors.RepositoryNotFoundError as err:
        raise ConfigError(f"base_model.path {repo!r}: no such model on the hub, or a private one that {who} cannot "
                          f"read (HTTP {err.response.status_code}): check the id, set HF_TOKEN, or {local}") from None
    except errors.HfHubHTTPError as err:
        raise ConfigError(f"the hub answered HTTP {err.response.status_code} for base_model.path {repo!r}{at}: "
                          f"try again later, or {local}") from None
    except Exception as err:  # noqa: BLE001 (no answer at all: DNS, refused, timeout, proxy, TLS)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"the hub {constants.ENDPOINT} cannot be reached for base_model.path {repo!r}{at} "
                          f"({reason}) and it is not in the local cache: {local} where the hub can be reached, "
                          "or set HF_ENDPOINT to a mirror") from None
