"""Training diagnostics of the critical-periods study: the Fisher-trace monitor, weight norm and effective
learning rate, trajectory PCA and the linearisation-readiness readout."""
