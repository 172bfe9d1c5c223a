"""Keeping secrets out of what batchbench shows.

The Hugging Face token (``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``) is passed
to the servers that need it and never reaches a log, a result or a report:
environment listings show secret-looking names with :data:`REDACTED` values,
and text (server logs, exception messages, commands) has every secret value
replaced.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from batchbench.core.command import REDACTED, is_secret_name

__all__ = ["REDACTED", "TOKEN_VARS", "is_secret_name", "redact", "redact_env", "token_env"]

#: Environment variables passed through from the caller when set. Both names
#: are set for the server: TGI and huggingface_hub read HF_TOKEN, older
#: stacks read HUGGING_FACE_HUB_TOKEN.
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment with secret-looking values replaced."""
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in env.items()}


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret value replaced (longest first)."""
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def token_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Hugging Face token from the caller's environment, under both names; {} when unset."""
    environ = os.environ if environ is None else environ
    token = next((environ[name] for name in TOKEN_VARS if environ.get(name)), None)
    return {name: token for name in TOKEN_VARS} if token else {}
