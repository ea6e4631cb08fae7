"""The trainers' client: `EvalTrigger` (when to evaluate) and `CheckpointNotifier` (tell Prefect a checkpoint is
ready), with `flush_spool` for events that could not be sent. Standard library only: training scripts import it."""

from evaldag.client.notifier import CheckpointNotifier, EvalTrigger, flush_spool

__all__ = ["CheckpointNotifier", "EvalTrigger", "flush_spool"]
