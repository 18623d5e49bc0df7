"""Secrets in URIs and addresses: which query, fragment or path parameter holds one (however many
times it is percent-encoded), and the URI fit to be printed or stored, masked. trial/storage.py
re-exports these, so every place that prints or stores a URI reads them from one module."""

from __future__ import annotations

import re
from urllib.parse import unquote


def is_uri(path: str) -> bool:
    return "://" in path


def redact(uri: str) -> str:
    """The URI (or Ray address) fit to be printed or stored: any user:password@ part replaced by ***@,
    and what follows the host masked: every query and fragment value and bare item of a URI with a
    host (`?sslmode=***`: one holding a secret under a name no rule knows is never shown), and every
    secret path parameter (`;token=***`); of a local one (`file:`, `sqlite:`) the values
    `secret_keys` names. The path stays: a bucket's is where the study lives. An address without a
    scheme (`host:6379?token=...`) is masked as a URI with a host."""
    if not is_uri(uri):  # a Ray address (`host:6379?token=...`) is masked as a URI; a folder's name is kept
        address = re.match(r"^([^/@?#]*@)?[\w.-]+:\d+([/?#]|$)", uri)
        return redact("ray://" + uri).removeprefix("ray://") if address else uri
    scheme, _, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    user, at, host = authority.rpartition("@")  # the last @ before the path: a password may hold @
    tail, hash_, fragment = (host + slash + path).partition("#")
    tail, ask, query = tail.partition("?")
    every = bool(host.partition("?")[0].partition("#")[0]) and scheme.lower() not in LOCAL_SCHEMES
    query, fragment, tail = _hide(query, every), _hide(fragment, every), _hide_path_params(tail)
    return f"{scheme}://{'***' if at else ''}{at}{tail}{ask}{query}{hash_}{fragment}"


LOCAL_SCHEMES = ("file", "sqlite")  # URIs of this machine's files: no host to hold a secret for
# query or fragment parameters that carry a credential: a database's password (password, passwd,
# pwd, sslpassword), a token (jwt, bearer, a session's or cookie's id), a key or secret, a presigned
# URL's signature and credential
SECRET_KEY = re.compile(r"pass|pwd|secret|token|credential|signature|^sig$|^auth$|authori[sz]ation|jwt|"
                        r"bearer|cookie|^sid$|session_?id|"
                        r"(^|[_.-])(api|access|account|private|session|sas)?[_.-]?key$", re.IGNORECASE)


def _pairs(text: str) -> list[tuple[str, str, str]]:
    """A query's or fragment's `key=value` parts (separated by & or ;) as (key, '=' or '', value)."""
    return [part.partition("=") for part in re.split(r"[&;]", text)] if text else []


def unquoted(text: str) -> str:
    """`text` percent-decoded until it no longer changes (`%253D` is `%3D` is `=`), as a reader that
    decodes it more than once (SQLAlchemy's odbc_connect) ends up reading it."""
    for _ in range(16):
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    return text


def _secret(key: str, value: str) -> str | None:
    """The name of the secret a `key=value` pair carries, or None: the key's own, or one inside the
    value (`odbc_connect=DRIVER%3D...%3BPWD%3Dsecret`: a connection string of its own pairs), however
    many times either is percent-encoded."""
    key = unquoted(key)
    if value and SECRET_KEY.search(key):
        return key
    inner = next((k.strip() for k, eq, v in _pairs(unquoted(value))
                  if eq and v and SECRET_KEY.search(k.strip())), None)
    return f"{key} ({inner})" if inner else None


def _hide(text: str, every: bool = False) -> str:
    hidden = re.sub(r"([^&;=]*)=([^&;]*)", lambda m: f"{m[1]}=***" if every or _secret(m[1], m[2]) else m[0], text)
    if not every:
        return hidden
    return "&".join("***" if part and "=" not in part else part for part in hidden.split("&"))  # a bare item too


def _path_params(path: str) -> list[tuple[str, str, str]]:
    """The `;key=value` parameters of a URI path's segments."""
    return [pair for segment in path.split("/") for pair in _pairs(segment.partition(";")[2])]


def _hide_path_params(path: str) -> str:
    def hide(segment: str) -> str:
        head, semi, params = segment.partition(";")
        return head + semi + re.sub(r"([^&;=]*)=([^&;]*)", lambda m: f"{m[1]}=***" if _secret(m[1], m[2]) else m[0],
                                    params)
    return "/".join(hide(segment) for segment in path.split("/"))


def secret_keys(uri: str) -> list[str]:
    """The query and fragment parameters of a URI whose value is a secret (`?password=...`), or holds
    one (`?odbc_connect=...PWD%3D...`)."""
    if not is_uri(uri):
        return []
    rest = uri.partition("://")[2]
    host = rest.partition("/")[0].rpartition("@")[2] + "/" + rest.partition("/")[2]
    tail, _, fragment = host.partition("#")
    path, _, query = tail.partition("?")
    found = [name for k, eq, v in _pairs(query) + _pairs(fragment) + _path_params(path) if eq and (name := _secret(k, v))]
    with_host = bool(host.partition("/")[0]) and uri.partition("://")[0].lower() not in LOCAL_SCHEMES
    bare = [part for part in query.split("&") if part and "=" not in part] if with_host else []
    return found + [f"a bare query item ({len(bare)})"] * bool(bare)


def userinfo(uri: str) -> str | None:
    """The `user[:password]` part of a URI's authority (`s3://KEY:SECRET@bucket`), else None."""
    if not is_uri(uri):
        return None
    authority = uri.partition("://")[2].partition("/")[0].partition("?")[0]
    return authority.rpartition("@")[0] if "@" in authority else None


def scrub(message: str, uri: str) -> str:
    """A store's error message without the credentials of `uri`, should it quote them."""
    info = userinfo(uri)
    hidden = [v for k, eq, v in _pairs(uri.partition("?")[2].replace("#", "&")) if eq and _secret(k, v)]
    for secret in sorted(filter(None, (info, *(info or "").split(":"), *hidden)), key=len, reverse=True):
        message = message.replace(secret, "***")
    return message
