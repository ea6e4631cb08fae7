"""evaldag: math-benchmark evaluation of training checkpoints as Prefect DAGs, tracked in MLflow.

The core (this package) is plain Python and needs no running server; `flows/` and `tasks/` compose it with Prefect.
"""

__version__ = "0.1.0"
