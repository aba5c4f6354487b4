"""Tuning the forgetting methods on the user's own model against the user's own retraining.

:func:`scrubnet.tuning.tune.tune` draws validation forget sets like D_f, retrains once without them with the
user's training function, tunes every candidate method's rate, length and own knob to come closest to that
retraining, and returns a :class:`~scrubnet.tuning.profile.TunedProfile` (a JSON file the CLI and the service
read); ``scrubnet.forget(..., method="auto", profile=P)`` runs the method it chose.
"""
