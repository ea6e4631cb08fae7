"""A logged evaluation's per-sample table, read back from its MLflow run (the parquet the track stage uploaded), for
`evaldag compare --verdicts`, tools and tests."""

from __future__ import annotations

import polars as pl


def load_samples(run_id: str) -> pl.DataFrame:
    """Download and read a run's per-sample parquet (for tools and tests)."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples/samples.parquet")
    return pl.read_parquet(local)


__all__ = ["load_samples"]
