"""The service's routes, one module per resource: :mod:`.requests` (deletion requests), :mod:`.model` (the
current weights), :mod:`.log` (the request log), :mod:`.key` (the receipts' public key), :mod:`.pages` (the
operator page). Each authorised route is wrapped by :func:`scrubnet.serve.auth.authorised`."""
