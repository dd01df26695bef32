"""Credentials in storage URLs never reach the screen, a log line or a stored attribute.

A database URL can carry a secret wherever SQLAlchemy takes one: the password of the user part (also
with an empty user name, ``postgresql://:pw@host/db``, and percent-encoded), and query parameters that
it hands to the database driver (``?password=``, ``sslpassword``, ``passwd``, tokens, and whole driver
connection strings such as pyodbc's ``odbc_connect=...;PWD=...``). ``redact`` masks each of these forms
in a URL or in any text that quotes one (a driver's error message, say), and also every secret of a URL
given to ``register``, wherever it appears. ``register`` also masks the secrets in Optuna's log lines and
in warnings, so that a library's message cannot show them either.
"""

from __future__ import annotations

import logging
import re
import warnings
from urllib.parse import quote, quote_plus, unquote

MASK = "***"

# Parameter names that hold a credential, in a URL's query or a driver's key=value connection string.
_SECRET_NAME = r"(?:[a-z]+_)?(?:ssl)?(?:pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|credentials?)"
_SECRET_PARAM = re.compile(rf"(?i)(?:(?<![a-z0-9_])|(?<=%3B)|(?<=%26))({_SECRET_NAME})(\s*=\s*|%3D)('[^']*'|\"[^\"]*\"|[^&;\s'\"%]*(?:%(?!3B|26)[0-9a-f]{{2}}[^&;\s'\"%]*)*)")
# name=value; segments of a driver connection string whose name is a credential
_SECRET_SEGMENT = re.compile(rf"(?i)(?:^|(?<=;))\s*{_SECRET_NAME}\s*=[^;]*;?")
# scheme://user:password@ ; the user may be empty, and the password is masked up to the last @ of the
# word (an unencoded @ in a password would otherwise leave its tail visible).
_USERINFO = re.compile(r"(?i)([a-z][a-z0-9+.\-]*://)([^:/@\s?#]*):([^\s]*)@")

_registered: set[str] = set()
_installed = False


def secrets_of(url: str) -> set[str]:
    """Every secret value in ``url`` as SQLAlchemy reads it, with its percent-encoded spellings."""
    found: set[str] = set()
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # not a URL SQLAlchemy can read: only the patterns below apply
        parsed = None
    if parsed is not None:
        if parsed.password:
            found.add(str(parsed.password))
        for name, value in parsed.query.items():
            for v in value if isinstance(value, tuple) else (value,):
                if re.fullmatch(f"(?i){_SECRET_NAME}", name):
                    found.add(v)
                else:  # a driver connection string inside one parameter
                    found.update(m.group(3).strip("'\"") for m in _SECRET_PARAM.finditer(v))
    m = _USERINFO.search(url)
    if m and m.group(3):
        found.add(m.group(3))
    found.update(m.group(3).strip("'\"") for m in _SECRET_PARAM.finditer(url))
    out: set[str] = set()
    for s in found:
        if s:
            out.update({s, unquote(s), quote(s, safe=""), quote_plus(s), quote(s)})
    return {s for s in out if s and s != MASK}


def without_secret_params(query: dict) -> dict:
    """A URL's query without the parameters that carry a credential, and with the credentials taken
    out of driver connection strings (for a URL that is stored, where a mask would be a wrong value)."""
    out = {}
    for name, value in query.items():
        if re.fullmatch(f"(?i){_SECRET_NAME}", name):
            continue
        values = value if isinstance(value, tuple) else (value,)
        cleaned = tuple(_SECRET_SEGMENT.sub("", v).strip(";") for v in values)
        out[name] = cleaned if isinstance(value, tuple) else cleaned[0]
    return out


def redact(text: str) -> str:
    """``text`` with every credential masked: URL user parts, secret parameters, registered secrets."""
    if not text:
        return text
    # Longest first, so that a secret which contains another is masked whole. Secrets of one or two
    # characters would mask ordinary letters everywhere: the patterns still mask them in URL forms.
    for s in sorted(_registered, key=len, reverse=True):
        if len(s) >= 3:
            text = text.replace(s, MASK)
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{m.group(2)}:{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def _redacting_factory(make):
    def factory(*args, **kwargs):
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    return factory


def register(url: str | None) -> None:
    """Mask the secrets of ``url`` from now on, also in every log record (Optuna's and SQLAlchemy's
    included) and in warnings; the hooks are installed once, on the first URL that has a secret."""
    global _installed
    if not url:
        return
    secrets = secrets_of(url)
    if not secrets:
        return
    _registered.update(secrets)
    if not _installed:
        _installed = True
        logging.setLogRecordFactory(_redacting_factory(logging.getLogRecordFactory()))
    # Installed again if something (a warnings.catch_warnings block) put the original back.
    if not getattr(warnings.showwarning, "_redacts", False):
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            show(redact(str(message)), category, filename, lineno, file, line)

        showwarning._redacts = True  # type: ignore[attr-defined]
        warnings.showwarning = showwarning
