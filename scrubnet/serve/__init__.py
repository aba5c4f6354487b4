"""``scrubnet serve``: deletion requests over HTTP with signed receipts (optional extra ``scrubnet[serve]``).

:mod:`~scrubnet.serve.receipts` builds, signs and verifies receipts (Ed25519, ``cryptography``);
:mod:`~scrubnet.serve.app` is the HTTP application and its worker (Starlette on uvicorn). The request store
(:mod:`scrubnet.mlforget.store`) is the queue and the source of truth; the service adds no other state.
"""
