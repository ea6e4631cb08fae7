"""Deciding from results: paired verdicts, sequential stopping (decide over sequential), which evaluations are
comparable (series), forecasts of a job's curve, adaptive samples (adaptive over twostage)."""
