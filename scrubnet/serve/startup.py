"""What ``scrubnet serve`` checks before it binds: the file modes of its secrets, its record and its witness,
that the checkpoint can be written, and the port; and the HTTP protocol's limits on each connection.

File modes (POSIX; nothing is checked elsewhere). ``ValueError`` (the CLI's ``error:`` line, exit 2) for what
lets another local user act as the service; a warning line for what lets them read:

* signing key (``--key``): refused with any group/other permission (≠ 0600);
* tokens file (``--tokens``): refused when writable by group/others (they could add a token), warned when
  readable by them;
* every file and directory of the checkpoint (``store.sqlite`` and its side files, ``record-head.json``,
  ``weights/`` and each weights file, the factors): refused when writable by group/others (they could edit
  the record, swap the head or the weights); ``store.sqlite`` warned when readable by group/others (every
  submitter's ids and salt);
* witness file (``--witness``): refused inside the checkpoint (a restore of the checkpoint would restore the
  witness with it), and when it or its directory is writable by group/others (they could empty it).

A checkpoint the service cannot write (a read-only mount, a read-only file) is refused at start
(:func:`check_writable`): the worker writes every request, receipt and head there.
"""
from __future__ import annotations

import collections
import os
import socket
import stat
from pathlib import Path

from scrubnet.mlforget import store


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


def check_modes(checkpoint: str | Path | None = None, tokens: str | Path | None = None,
                key: str | Path | None = None) -> list[str]:
    """Refuse or warn about the modes of the files given (the table of the module docstring).

    Parameters
    ----------
    checkpoint, tokens, key : str or Path or None
        The checkpoint directory, the tokens file, the private signing key; None: not checked.

    Returns
    -------
    list of str
        Warnings, one line each (the caller prints them).

    Raises
    ------
    ValueError
        A file another local user could use to act as the service or to edit its record; the message names
        the file, its mode and the ``chmod`` that fixes it.
    """
    if os.name != "posix":
        return []
    warnings: list[str] = []
    if key is not None:
        m = _mode(Path(key))
        if m is not None and m & 0o077:
            raise ValueError(f"--key {key} has mode {m:04o}: a signing key must be private to its owner "
                             f"(chmod 600 {key})")
    if tokens is not None:
        m = _mode(Path(tokens))
        if m is not None and m & 0o022:
            raise ValueError(f"--tokens {tokens} has mode {m:04o}: others may add a token (chmod 600 {tokens})")
        if m is not None and m & 0o044:
            warnings.append(f"--tokens {tokens} has mode {m:04o}: other local users can read the tokens "
                            f"(chmod 600 {tokens})")
    if checkpoint is not None:
        ck = Path(checkpoint)
        for f in [ck, *sorted(ck.rglob("*"))]:
            m = _mode(f)
            if m is not None and m & 0o022:
                raise ValueError(f"{f} has mode {m:04o}: others may edit the record (chmod go-w {f})")
        m = _mode(ck / store.DB)
        if m is not None and m & 0o044:
            warnings.append(f"{ck / store.DB} has mode {m:04o}: other local users can read every submitter's ids "
                            f"and salt (chmod 600 {ck / store.DB})")
    return warnings


def check_witness(checkpoint: str | Path, witness: str | Path) -> None:
    """Refuse a witness file inside the checkpoint, or one that group/others may write (the file, or the
    directory it is replaced in): ``ValueError`` naming it and the fix (POSIX modes only)."""
    ck, w = Path(checkpoint).resolve(), Path(witness).resolve()
    if ck == w or ck in w.parents:
        raise ValueError(f"--witness {witness} lies inside the checkpoint: a restore of the checkpoint would "
                         "restore its witness with it (keep it on another disk or machine)")
    if os.name != "posix":
        return
    m = _mode(w)
    if m is not None and m & 0o022:
        raise ValueError(f"--witness {witness} has mode {m:04o}: others may empty or rewrite the witness "
                         f"(chmod go-w {witness})")
    m = _mode(w.parent)  # a sticky directory (/tmp) lets nobody else replace or remove the file
    if m is not None and m & 0o022 and not m & stat.S_ISVTX:
        raise ValueError(f"--witness {witness}: its directory {w.parent} has mode {m:04o}: others may replace the "
                         f"witness (chmod go-w {w.parent})")


def check_writable(checkpoint: str | Path) -> None:
    """``ValueError`` (one line) when the service could not write the checkpoint: its directory, ``store.sqlite``
    or ``weights/`` (a read-only mount, or read-only files). ``os.access`` answers for the effective user and
    for a read-only file system (EROFS), root included."""
    ck = Path(checkpoint)
    for f in (ck, ck / store.DB, ck / store.WEIGHTS):
        if f.exists() and not os.access(f, os.W_OK):
            raise ValueError(f"{ck} cannot be written ({f} is read-only, or on a read-only mount): the service "
                             "writes every request, receipt and signed head there; serve a writable copy")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (the server listens on it); ``ValueError`` naming the address when it
    cannot be bound (in use, not local, no permission), so nothing claims to be serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def guarded_http(header_timeout_s: float = 5.0, max_per_client: int = 32):
    """uvicorn's h11 protocol with a deadline on the request line and headers and a cap on each client's
    connections.

    * A connection that has not sent a whole request head ``header_timeout_s`` seconds after it opened (or
      after its previous response) is closed. uvicorn bounds only idle keep-alive connections; a client
      sending half a request held its connection for good (300 of 300 after 45 s). The body has its own
      deadline in the route (408).
    * A client address holding ``max_per_client`` connections has its next ones closed at once, before they
      count against the server's total (uvicorn's ``limit_concurrency``): one client holding 300 idle
      connections got 503 for 19 of 20 other clients' requests. Behind a reverse proxy every client has the
      proxy's address: the proxy then enforces the per-client limit (the service guide's set-up).

    Parameters
    ----------
    header_timeout_s : float
        Seconds a client may take to send a request's line and headers (idle time included).
    max_per_client : int
        Connections one client address may hold open at once.

    Returns
    -------
    type
        The protocol class, for ``uvicorn.Config(http=...)``.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_per_client: collections.Counter = collections.Counter()  # one event loop: no lock needed

    class GuardedH11(H11Protocol):
        def connection_made(self, transport):
            peer = transport.get_extra_info("peername")
            self._client = peer[0] if isinstance(peer, (tuple, list)) and peer else None
            self._refused = open_per_client[self._client] >= max_per_client
            self._guard = None
            if self._refused:
                transport.close()  # this client holds its share already: nothing is read from it
                return
            open_per_client[self._client] += 1
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._guard is not None:
                self._guard.cancel()
            self._guard_cycle = self.cycle
            self._guard = self.loop.call_later(header_timeout_s, self._expire)

        def _expire(self) -> None:
            cycle = self.cycle
            if cycle is self._guard_cycle and (cycle is None or cycle.response_complete) \
                    and not self.transport.is_closing():
                self.transport.close()  # no whole request head arrived in time

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def eof_received(self) -> None:
            if not self._refused:
                super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            open_per_client[self._client] -= 1
            if open_per_client[self._client] <= 0:
                del open_per_client[self._client]
            if self._guard is not None:
                self._guard.cancel()
            super().connection_lost(exc)

    return GuardedH11
