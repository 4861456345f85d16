"""Secrets in a run config: ``${ENV_VAR}`` references read from the environment, and the values that must never
reach a file or a log in clear.

A config is written to ``<out>/config.json``, printed, and handed to trackers (W&B, MLflow), so a bearer token in
``roles.reward.http.headers`` would travel with every copy of the run. ``redacted`` is what every one of those
copies is made from: HTTP header values, and the text of any key named like a credential (token, password,
secret, api_key, authorization: ``is_secret_key``), are replaced by ``REDACTED``. Only text is a credential: a
number under such a name (``experts_per_token: 2``) is a setting, and a redacted one would not load again. A
``${VAR}`` reference is kept as written: it names the variable, not its value. ``resolve_env`` replaces the
references by the variables' values when the config is loaded, so the run itself uses the real value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

#: what a redacted value is written as.
REDACTED = "<redacted>"
#: the last word(s) of a key (split at ``_``, ``-``, ``.`` and case changes) that make its value a credential:
#: ``hf_token``, ``X-Api-Key``, ``client_secret``; not ``max_new_tokens``, ``pad_token_id`` or ``tokenizer``.
SECRET_WORDS = frozenset({"token", "password", "passwd", "secret", "authorization", "authorisation", "credential",
                          "credentials", "apikey"})
SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")})
#: keys whose every value is redacted (an ``Authorization`` header may be spelt any way).
SECRET_MAPS = frozenset({"headers"})
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: the password of a URL's ``user:password@`` part (``https://me:hunter2@host/score``).
URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")


def is_secret_key(key: str) -> bool:
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()) if w]
    return bool(words) and (words[-1] in SECRET_WORDS or tuple(words[-2:]) in SECRET_PAIRS)


def redacted(data: Any, _secret: bool = False) -> Any:
    """A copy of ``data`` (a config as plain dicts and lists) with every secret value replaced by ``REDACTED``;
    a value that only refers to environment variables (``${TOKEN}``) is kept, since it holds no secret."""
    if isinstance(data, Mapping):
        return {k: redacted(v, _secret or is_secret_key(str(k)) or str(k) in SECRET_MAPS) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redacted(v, _secret) for v in data]
    if _secret and isinstance(data, str) and not _only_env_refs(data):
        return REDACTED
    if isinstance(data, str) and "://" in data:
        return URL_PASSWORD.sub(rf"\1{REDACTED}@", data)
    return data


def _only_env_refs(text: str) -> bool:
    return ENV_REF.search(text) is not None and not ENV_REF.sub("", text).strip(" ")


def resolve_env(data: Any, environ: Mapping[str, str] | None = None, path: str = ""
                ) -> tuple[Any, list[tuple[str, str]]]:
    """``data`` with every ``${VAR}`` in its strings replaced by the variable's value, and the problems:
    ``(key path, 'environment variable VAR is not set')`` for each one missing."""
    env = os.environ if environ is None else environ
    problems: list[tuple[str, str]] = []
    if isinstance(data, Mapping):
        out = {}
        for key, value in data.items():
            out[key], found = resolve_env(value, env, f"{path}.{key}" if path else str(key))
            problems += found
        return out, problems
    if isinstance(data, list):
        items = []
        for i, value in enumerate(data):
            item, found = resolve_env(value, env, f"{path}[{i}]")
            items.append(item)
            problems += found
        return items, problems
    if isinstance(data, str) and "${" in data:
        missing = [name for name in ENV_REF.findall(data) if name not in env]
        problems += [(path, f"environment variable {name} is not set (the value is '{data}')") for name in missing]
        return ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), data), problems
    return data, problems
