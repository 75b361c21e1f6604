"""Reproducible experiments built from the public pieces (zoo, warm start, cohort loop, evaluation)."""
