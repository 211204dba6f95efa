"""Secrets kept out of every output: each MLflow param, tag and JSON/text artifact, and each error
line the CLI prints, passes through here; `secret_in` lets the params loader refuse a value that
holds one before it can reach a log, MLflow or Prefect's database.

A key is secret-like when its last word (before an `_ID`) is token, secret, password, key or
credential, alone or after api/access/auth/private/... (`HF_TOKEN`, `api_key`, `apiKey`, not
`tokenizer`, `monkey` or `token_count`); the values of such environment variables and URL
credentials (`user:pass@`) are scrubbed out of any text.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"
# A name is split into words (at '_', '.', '-', digits and camelCase humps); it is secret-like when its
# last word is one of these, alone or joined to a prefix that makes one: HF_TOKEN, api_key, apiKey,
# AWS_SECRET_ACCESS_KEY, db.password, accesstoken; not tokenizer, tokens_per_step, token_count,
# keyframes or monkey.
SECRET_WORD = re.compile(r"^(hf|api|access|auth|bearer|client|private|refresh|session|secret|db)?"
                         r"(token|secrets?|password|passwd|pwd|key|credentials?)$")
NAME_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")
MIN_SECRET_LENGTH = 6  # environment values shorter than this are not scrubbed out of text
SHELL_PATHS = {"PWD"}  # the shell's working directory: named like a password, never one
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s:]*(?::[^/@\s]*)?@")


def is_secret_name(key: str) -> bool:
    """A key named like a secret: its last word is token, secret, password, key or credential."""
    words = [w.lower() for w in NAME_WORDS.findall(str(key))]
    if len(words) > 1 and words[-1] == "id":  # AWS_ACCESS_KEY_ID: the key's own name
        words.pop()
    return bool(words) and SECRET_WORD.search(words[-1]) is not None


def _secret_variable(name: str, value: str) -> bool:
    return name not in SHELL_PATHS and is_secret_name(name) and bool(value) and len(value) >= MIN_SECRET_LENGTH


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables named like secrets, longest first."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if _secret_variable(k, v)}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str) -> str:
    """`text` with every secret environment value and URL credential (`user:pass@`) replaced."""
    for value in secret_values():
        text = text.replace(value, REDACTED)
    return URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def secret_in(text: str) -> str | None:
    """What secret `text` holds, named without its value (an environment variable's name, or URL
    credentials); None when it holds none."""
    for name, value in sorted(os.environ.items()):
        if _secret_variable(name, value) and value in text:
            return f"the value of ${name}"
    if URL_CREDENTIALS.search(text):
        return "credentials in a URL (user:password@)"
    return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def redact(key: str, value: Any) -> str:
    """The text to log for a param or tag: REDACTED under a secret-like key, else scrubbed text.

    Numbers and booleans are not secrets and pass unchanged, even under such a key
    (`tokens_per_step`); `None` and empty strings stay as they are.
    """
    if value is None or value == "":
        return _as_text(value)
    if is_secret_name(key) and not isinstance(value, (bool, int, float)):
        return REDACTED
    return redact_text(_as_text(value))


def redact_data(data: Any, key: str = "") -> Any:
    """A JSON-like structure with `redact`'s rules applied to every string leaf."""
    if isinstance(data, Mapping):
        return {k: redact_data(v, str(k)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, key) for v in data]
    if isinstance(data, str):
        return redact(key, data)
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened with dots: {"qad": {"lr": 1e-4}} -> {"qad.lr": 1e-4}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
