"""Secrets never printed: the one place a storage URL (or a message that may hold one) is masked.

``mask_url`` is for a URL: SQLAlchemy parses it (``make_url(...).render_as_string(
hide_password=True)``) and password-like query parameters (``?password=``, ``?sslpassword=``,
``?token=``...) become ``***`` too. ``mask_text`` is for free text (a driver's error message):
every URL-shaped word in it is masked, and so is every secret of a URL this process opened
(``remember``), wherever it appears, raw or percent-decoded.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

MASK = "***"
MIN_SECRET = 3
#: query parameters whose value is a secret (libpq's ``password``/``sslpassword``, tokens, keys)
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key|auth|credential", re.IGNORECASE)
#: ``scheme://[user]:password@``: the password runs to the *last* ``@`` of the word, so a
#: password holding an unencoded ``@`` is masked whole (over-masking never leaks)
_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://[^\s:/@]*:)(\S*)@")
_QUERY_SECRET = re.compile(r"([?&;][^=&\s]*(?:" + _SECRET_KEY.pattern + r")[^=&\s]*=)([^&\s]*)",
                           re.IGNORECASE)  # fmt: skip

_secrets: set[str] = set()


def url_secrets(url: str) -> set[str]:
    """The secrets a URL holds: its password and password-like query values, raw and decoded."""
    found: set[str] = set()
    match = _USERINFO.search(url)
    if match and match.group(2):
        found.add(match.group(2))
    for m in _QUERY_SECRET.finditer(url):
        if m.group(2):
            found.add(m.group(2))
    # shorter ones would mask ordinary letters all over a message (a 1-2 character password
    # is no protection anyway)
    return {s for raw in found for s in (raw, unquote(raw)) if len(s) >= MIN_SECRET}


def remember(url: str) -> None:
    """Mask this URL's secrets in every later message of this process (``mask_text``)."""
    _secrets.update(url_secrets(url))


def has_unencoded_at(url: str) -> bool:
    """Whether the URL's user:password part holds an ``@`` that is not percent-encoded:
    drivers (and SQLAlchemy) split at the first ``@`` and would take the rest of the password
    for the host."""
    match = _USERINFO.match(url)
    return bool(match and "@" in match.group(2).split("/", 1)[0])


def mask_url(url: str) -> str:
    """The URL with its password and password-like query parameters replaced by ``***``."""
    if has_unencoded_at(url):
        return mask_text(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return mask_text(url)  # not a URL SQLAlchemy reads: mask by shape
    query = parsed.query
    head = parsed.set(query={}).render_as_string(hide_password=True)
    if not query:
        return head
    pairs = []
    for key, values in query.items():
        for value in (values,) if isinstance(values, str) else values:
            pairs.append(f"{key}={MASK if _SECRET_KEY.search(key) else value}")
    return f"{head}?{'&'.join(pairs)}"


def mask_text(text: str) -> str:
    """Free text with every URL's password, secret query values and remembered secret masked."""
    text = _USERINFO.sub(rf"\1{MASK}@", text)
    text = _QUERY_SECRET.sub(rf"\1{MASK}", text)
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: no partial leftovers
        text = text.replace(secret, MASK)
    return text


def mask_secret(text: str, url: str) -> str:
    """``text`` with ``url``'s secrets (and any URL's password in it) replaced by ``***``."""
    text = mask_text(text)
    for secret in sorted(url_secrets(url), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
