"""Scoring: canonical gold answers, grading with math-verify, rewards, KL, metrics (avg@n, pass@k, maj@k) and
diagnostics."""
