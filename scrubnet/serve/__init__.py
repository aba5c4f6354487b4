"""``scrubnet serve``: deletion requests over HTTP with signed receipts (optional extra ``scrubnet[serve]``).

:mod:`~scrubnet.serve.receipts` builds, signs and verifies receipts (Ed25519, ``cryptography``);
:mod:`~scrubnet.serve.app` assembles the HTTP application (Starlette on uvicorn) from the routes of
:mod:`~scrubnet.serve.routes` (one module per resource), the authorisation of :mod:`~scrubnet.serve.auth`
and the worker of :mod:`~scrubnet.serve.worker`. The request store (:mod:`scrubnet.mlforget.store`) is the
queue and the source of truth; the service adds the signed head beside it and, outside the checkpoint, the
witness of its transparency log (:mod:`~scrubnet.serve.tlog`, RFC 9162 Merkle tree of
:mod:`~scrubnet.serve.merkle`); everything signed is RFC 8785 JSON (:mod:`~scrubnet.serve.canonical`).
"""
