"""Curvature and linear algebra, matrix-free: flat parameter views, solvers, Fisher/GGN/NTK products."""
