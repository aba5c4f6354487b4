"""Bearer tokens and their roles, and authorisation as one dependency applied to each route.

:func:`authorised` wraps a route: it resolves the ``Authorization: Bearer`` token to its :class:`Token`
(401 when missing or unknown), refuses a token lacking the route's role (403), and answers any
:class:`~scrubnet.serve.http.HTTPError` the route raises as JSON. Roles: ``submit``, ``read``, ``admin``
(``admin`` may do everything).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from scrubnet.serve.http import HTTPError

ROLES = ("submit", "read", "admin")


@dataclass(frozen=True)
class Token:
    """A token's identity: ``name`` (recorded as the submitting client) and its ``roles``."""
    name: str
    roles: frozenset

    def may(self, role: str) -> bool:
        """Whether this token holds ``role`` (``admin`` holds every role)."""
        return "admin" in self.roles or role in self.roles


def read_tokens(path: str | Path) -> dict[str, Token]:
    """Tokens from a file of lines ``TOKEN ROLES [NAME]`` (ROLES: comma-separated submit, read, admin;
    ``#`` starts a comment).

    Parameters
    ----------
    path : str or Path
        The tokens file.

    Returns
    -------
    dict
        ``{token: Token}``. A token's name is its identity (the owner of its submissions): names are unique
        (a second token with the same name is refused), and an unnamed token is named by a hash of the token
        itself (``token-<12 hex>``), so editing other lines of the file never changes who owns what.

    Raises
    ------
    ValueError
        Naming the line: a token under 16 characters, listed twice, unknown roles, a duplicate name.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--tokens {path}: {e.strerror or e}") from None
    out: dict[str, Token] = {}
    names: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"--tokens {path} line {n}: expected 'TOKEN ROLES [NAME]'")
        tok, roles = parts[0], frozenset(r for r in parts[1].split(",") if r)
        if len(tok) < 16:
            raise ValueError(f"--tokens {path} line {n}: a token must have at least 16 characters")
        if not roles or not roles <= set(ROLES):
            raise ValueError(f"--tokens {path} line {n}: roles must be among {', '.join(ROLES)}, got {parts[1]!r}")
        if tok in out:
            raise ValueError(f"--tokens {path} line {n}: this token is listed twice")
        name = parts[2] if len(parts) == 3 else token_name(tok)
        if name in names:
            raise ValueError(f"--tokens {path} line {n}: the name {name!r} is already used on line {names[name]} "
                             "(a name is an identity: give each token its own)")
        names[name] = n
        out[tok] = Token(name, roles)
    if not out:
        raise ValueError(f"--tokens {path}: no tokens listed")
    return out


def token_name(token: str) -> str:
    """The identity of an unnamed token: ``token-`` and the first 12 hex digits of its sha256 (stable whatever
    the token's line in the file; reveals nothing usable about the token)."""
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:12]


def resolve_token(headers, tokens: dict[str, Token], role: str | None) -> Token:
    """The identity behind a request's bearer token.

    Parameters
    ----------
    headers : Mapping
        The request's headers (``authorization`` read, case-insensitively).
    tokens : dict
        ``{token: Token}`` of the service; compared in constant time, every entry visited.
    role : str or None
        The role the route needs; None: any known token.

    Returns
    -------
    Token
        The token's identity.

    Raises
    ------
    HTTPError
        401 when the token is missing or unknown (with ``WWW-Authenticate: Bearer``); 403 when it lacks ``role``.
    """
    auth = headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise HTTPError(401, "missing bearer token (header 'Authorization: Bearer TOKEN')",
                        {"WWW-Authenticate": "Bearer"})
    given = auth[7:].strip()
    found = None
    for tok, entry in tokens.items():
        if hmac.compare_digest(tok.encode(), given.encode()):
            found = entry
    if found is None:
        raise HTTPError(401, "unknown bearer token", {"WWW-Authenticate": "Bearer"})
    if role is not None and not found.may(role):
        raise HTTPError(403, f"token {found.name!r} lacks the {role} role")
    return found


def authorised(role: str | None):
    """Decorator making ``handler(request, service, token)`` a Starlette endpoint ``endpoint(request)``
    that first resolves the token (:func:`resolve_token` with ``role``; None: any known token), takes a GET
    from the tenant's read bucket (429 with ``Retry-After`` when empty) and answers any :class:`HTTPError` of
    the token or of the handler as JSON."""
    def wrap(handler):
        @functools.wraps(handler)
        async def endpoint(request):
            service = request.app.state.service
            try:
                token = resolve_token(request.headers, service.tokens, role)
                if request.method == "GET" and service.limits is not None:
                    wait = service.limits.admit_read(token.name)
                    if wait is not None:
                        raise HTTPError(429, "too many reads from this token; retry later",
                                        service.limits.retry_after(wait))
                return await handler(request, service, token)
            except HTTPError as e:
                return e.response()
        return endpoint
    return wrap
