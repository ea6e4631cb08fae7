"""The trainers' client: `EvalTrigger` (when to evaluate), `CheckpointNotifier` (tell Prefect a checkpoint is
ready), with `flush_spool` for events that could not be sent, and `EvaldagCallback` (the same for transformers'
Trainer and TRL's trainers, in one line). Standard library only: training scripts import it (transformers is
imported when an EvaldagCallback is built)."""

from evaldag.client.delivery import flush_spool
from evaldag.client.notifier import CheckpointNotifier
from evaldag.client.trigger import EvalTrigger
from evaldag.client.trainer_callback import EvaldagCallback

__all__ = ["CheckpointNotifier", "EvalTrigger", "EvaldagCallback", "flush_spool"]
