"""What a client sends to be let in: an API key (``Authorization: Bearer``) and headers of the user's own.

Treated as secrets exactly as the Hugging Face token is (:mod:`batchbench.adapters.launch.secrets`): the values
go into the requests and nowhere else. :class:`Auth` shows itself redacted (its ``repr``, :meth:`Auth.describe`
for the results), and :meth:`Auth.redact` takes its values out of any text a server sends back before that text
becomes an error message. Every header value counts as a secret: ``--header X-Api-Key=...`` is one too.

A server that answers 401 or 403 wants a key, or refused the one sent: :func:`auth_failure` says which, naming
the URL, as a permanent error (waiting will not change it), so a command stops in seconds before any run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from batchbench.adapters.base import EngineHTTPError
from batchbench.adapters.launch.secrets import REDACTED, redact

#: Where the key comes from when ``--api-key`` is not given (what ``vllm bench serve`` and OpenAI's clients read).
API_KEY_ENV = "OPENAI_API_KEY"
#: Statuses that mean "not let in": no key, or a key the server refused.
AUTH_STATUSES = frozenset({401, 403})
#: An HTTP header name (RFC 9110's token).
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: Headers the clients write themselves: one given again would break the request's framing.
_RESERVED = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


@dataclass(frozen=True, repr=False)
class Auth:
    """An API key and extra headers, sent with every request to an engine; never shown."""

    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"Auth(api_key={REDACTED if self.api_key else None}, headers={[n for n, _ in self.headers]})"

    def http_headers(self) -> dict[str, str]:
        """The headers every request carries: the user's, then ``Authorization: Bearer KEY``."""
        found = dict(self.headers)
        if self.api_key:
            found["Authorization"] = f"Bearer {self.api_key}"
        return found

    @property
    def sends_credentials(self) -> bool:
        """Whether anything that could be a credential is sent (a key, or a header of the user's)."""
        return bool(self.api_key or self.headers)

    def secrets(self) -> tuple[str, ...]:
        """Every value that must never be shown."""
        return tuple(v for v in (self.api_key, *(value for _, value in self.headers)) if v)

    def redact(self, text: str) -> str:
        """``text`` with every secret value replaced."""
        return redact(text, self.secrets()) if self.sends_credentials else text

    def describe(self) -> dict[str, object]:
        """For the results: whether a key was sent and which headers, their values redacted."""
        return {"api_key": REDACTED if self.api_key else None, "headers": {n: REDACTED for n, _ in self.headers}}


def parse_headers(values: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``--header NAME=VALUE`` values; ValueError naming the header (never its value) when one is malformed, given
    twice, or one the client writes itself."""
    found: dict[str, tuple[str, str]] = {}
    for text in values:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep or not _HEADER_NAME.match(name):
            raise ValueError(f"--header {name or '(empty)'}=...: expected NAME=VALUE with NAME an HTTP header name "
                             "(letters, digits, '-'), e.g. --header X-Tenant=team-a")
        if not _printable(value):
            raise ValueError(f"--header {name}: the value must be printable ASCII (no line break, no control "
                             "character), as an HTTP header's is")
        if name.lower() in _RESERVED:
            raise ValueError(f"--header {name}: batchbench writes this header itself; leave it out")
        if name.lower() in found:
            raise ValueError(f"--header {name} is given twice")
        found[name.lower()] = (name, value.strip())
    return tuple(found.values())


def _printable(text: str) -> bool:
    return text.isascii() and all(" " <= c <= "~" or c == "\t" for c in text)


def auth_from(api_key: str | None, headers: Sequence[str], environ: Mapping[str, str] | None = None) -> Auth:
    """The :class:`Auth` of ``--api-key`` (default ``$OPENAI_API_KEY``) and ``--header`` values; ValueError for a
    malformed header, or an ``Authorization`` header beside a key (two ways to say one thing)."""
    environ = os.environ if environ is None else environ
    key = api_key if api_key is not None else environ.get(API_KEY_ENV)
    where = "--api-key" if api_key is not None else f"${API_KEY_ENV}"
    if key and (not _printable(key) or " " in key.strip()):
        raise ValueError(f"{where}: an API key is printable ASCII without spaces (it is sent as "
                         "'Authorization: Bearer KEY')")
    key = key.strip() if key else None
    parsed = parse_headers(headers)
    if key and any(name.lower() == "authorization" for name, _ in parsed):
        raise ValueError(f"--header Authorization and {where} both set the Authorization header: give one")
    return Auth(key or None, parsed)


class EngineUnauthorized(EngineHTTPError):
    """HTTP 401 or 403: the endpoint wants credentials, or refused those sent. Permanent: waiting will not let
    the client in."""

    kind = "unauthorized"


def auth_failure(engine: str, status: int, url: str, *, sent_key: bool, detail: str = "",
                 request_id: str | None = None) -> EngineUnauthorized:
    """The error of a 401/403 from ``url``: the endpoint wants a key, or refused the one sent. Permanent, and
    free of any secret (``detail``, the server's own words, is redacted by the caller)."""
    if sent_key:
        why = ("refused the API key or headers sent (--api-key, --header, $OPENAI_API_KEY): check the key is the "
               "one this endpoint expects")
    else:
        why = "wants an API key: give --api-key KEY (or set $OPENAI_API_KEY), or the headers it needs (--header)"
    said = f" (it said: {detail})" if detail else ""
    return EngineUnauthorized(engine, f"HTTP {status} from {url}: the endpoint {why}{said}", status=status,
                              request_id=request_id, permanent=True)
