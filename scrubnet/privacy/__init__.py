"""Mixed differential privacy: NoisyGD and AdaMix on a linear classifier over frozen features, with
Gaussian-DP accounting and per-instance privacy."""
