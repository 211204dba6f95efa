"""The preflight of a hub model (`qad_pipeline.core.hub_access`): a local stand-in for the hub answers as
the Hugging Face hub does (status and `X-Error-Code`), so nothing here reaches the network. The
offline case through the command line is in tests/test_bad_input.py."""

import socket

import pytest
from huggingface_hub import constants

from qad_pipeline.core.config import BaseModelParams, ConfigError
from qad_pipeline.core.hub_access import cached_snapshot, check_hub_access
from tests.http_stub import serve

REPO = "org/gated-model"
SHA = "a" * 40
TOKEN = "hf_test0123456789abcdef"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An online hub at a local stand-in, an empty cache, no token (neither HF_TOKEN nor a token file)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    servers = []

    def answering(respond):
        server, uri = serve(respond)
        servers.append(server)
        at_endpoint(monkeypatch, uri)
        return uri

    yield answering
    for server in servers:
        server.shutdown()


def at_endpoint(monkeypatch, uri: str):
    """What HF_ENDPOINT=uri sets when huggingface_hub is imported."""
    monkeypatch.setattr(constants, "ENDPOINT", uri)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", uri + "/{repo_id}/resolve/{revision}/{filename}")


def gated(headers):
    """The hub on a gated model: 401 without a token, 403 for one not granted, 200 for the granted one."""
    auth = headers.get("Authorization")
    if auth == f"Bearer {TOKEN}":
        return 200, b"{}", "application/json", {"X-Repo-Commit": SHA, "ETag": '"e"'}
    return (403 if auth else 401), b"", "application/json", {"X-Error-Code": "GatedRepo"}


def refusal(params: BaseModelParams) -> str:
    with pytest.raises(ConfigError) as err:
        check_hub_access(params)
    message = str(err.value)
    assert "\n" not in message and TOKEN not in message
    return message


def test_a_gated_model_needs_a_granted_token(hub, monkeypatch):
    hub(gated)
    message = refusal(BaseModelParams(path=REPO))
    assert message.startswith(f"base_model.path {REPO!r} is a gated model and the hub refused no HF_TOKEN (nor a "
                              "token file of `hf auth login`) (HTTP 401): accept its terms on the hub and set HF_TOKEN")
    assert "the qad-hf Secret" in message and "give a local folder" in message
    monkeypatch.setenv("HF_TOKEN", "hf_not0granted0123456")
    assert "the hub refused this HF_TOKEN (HTTP 403)" in refusal(BaseModelParams(path=REPO))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    check_hub_access(BaseModelParams(path=REPO))  # granted: the stages can download it


@pytest.mark.parametrize("code, status, expected", [
    ("RepoNotFound", 401, f"base_model.path {REPO!r}: no such model on the hub, or a private one that no HF_TOKEN"),
    ("RevisionNotFound", 404, f"base_model.revision 'v9' is not a revision of {REPO!r} on the hub"),
    (None, 503, f"the hub answered HTTP 503 for base_model.path {REPO!r}@v9: try again later"),
])
def test_what_the_hub_refuses_is_named(hub, code, status, expected):
    hub(lambda headers: (status, b"", "application/json", {"X-Error-Code": code} if code else {}))
    assert refusal(BaseModelParams(path=REPO, revision="v9")).startswith(expected)


def test_an_unreachable_hub_is_refused_when_the_model_is_not_cached(hub, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    at_endpoint(monkeypatch, f"http://127.0.0.1:{port}")
    message = refusal(BaseModelParams(path=REPO))
    assert message.startswith(f"the hub http://127.0.0.1:{port} cannot be reached for base_model.path {REPO!r} (")
    assert "and it is not in the local cache: give a local folder as base_model.path, or download it" in message


def cache_snapshot(cache, files: dict[str, str]):
    """A model in the Hugging Face cache layout: refs/main -> snapshots/<sha>/ holding `files`."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    folder = repo / "snapshots" / SHA
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_a_cached_model_needs_no_hub(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "cache"
    folder = cache_snapshot(cache, {"config.json": "{}"})  # its config only, as planning leaves it
    assert cached_snapshot(REPO, None) is None
    assert "HF_HUB_OFFLINE is set and its weights are not in the local cache" in refusal(BaseModelParams(path=REPO))
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-1.safetensors", '
                                                         '"v": "model-2.safetensors"}}')
    (folder / "model-1.safetensors").write_text("")
    assert cached_snapshot(REPO, None) is None  # one of the two files the index names
    (folder / "model-2.safetensors").write_text("")
    assert cached_snapshot(REPO, None) == folder
    check_hub_access(BaseModelParams(path=REPO))  # offline, and cached
    assert cached_snapshot(REPO, "v9") is None  # another revision is not
