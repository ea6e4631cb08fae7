"""One line in a transformers `Trainer` (and TRL's trainers, which subclass it): every checkpoint it saves is announced
to evaldag and evaluated by itself.

    trainer.add_callback(EvaldagCallback(benchmarks=["gsm8k"], limit=50))

On `on_save`, on the world's main process only, the callback announces `<output_dir>/checkpoint-<global_step>` at
`state.global_step` through `CheckpointNotifier` (never blocking training for more than `max_block_s`, never
failing it: events the server cannot take are spooled and re-sent). No Trainer event raises: a setting refused once
training runs (a malformed PREFECT_API_URL) is warned about once and turns the callback off, since raised on the
main process alone it would leave the other ranks waiting in their next collective until the NCCL timeout.

The job is named after `args.run_name`, or the output folder; its planned last step (`state.max_steps`) travels with
every event, so the job's forecast needs no setting. When the trainer logs to MLflow (transformers'
`MLflowCallback`, or a run the script started), the event names that run as `mlflow_parent_run_id`: the evaluations'
accuracy curves land in the run that holds the loss.

transformers is imported when a callback is built, not when this module is: `evaldag.client` stays importable with
the standard library.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evaldag.client.delivery import check_api_url
from evaldag.client.notifier import CheckpointNotifier, EvalTrigger
from evaldag.client.trigger import positive
from evaldag.request.rules import (ENGINE_SETTING_KEYS, SAMPLING_KEYS, check_benchmark_names, check_decide,
                                   check_limit, check_run_id, check_settings, check_train_run, train_run_name)

log = logging.getLogger("evaldag.client.trainer_callback")


@functools.cache
def _trainer_class() -> type:
    """EvaldagCallback as a transformers TrainerCallback (built once, on the first callback)."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise ImportError("EvaldagCallback plugs into transformers' Trainer, which is not installed here; "
                          "`pip install transformers` (or use CheckpointNotifier from your own loop)") from None
    return type("EvaldagCallback", (EvaldagCallback, TrainerCallback), {"__module__": __name__,
                                                                        "__doc__": EvaldagCallback.__doc__})


def _never_raises(handler: Callable[..., None]) -> Callable[..., None]:
    """A Trainer event handler that never raises into training (see the module docstring). What raises past the
    notifier, which keeps network and disk faults to itself, is a setting it refuses and would raise again at every
    save: it is logged once, as a warning, and the callback is off from then on."""

    @functools.wraps(handler)
    def guarded(self: EvaldagCallback, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.off:
            return
        try:
            handler(self, args, state, control, **kwargs)
        except Exception as e:  # noqa: BLE001 - evaluation is a side job: training goes on whatever happens here
            self.off = True
            log.warning("evaldag: EvaldagCallback turned off, no checkpoint of this run is announced from here on "
                        "(training goes on): %s", e, exc_info=True)

    return guarded


class EvaldagCallback:
    """A transformers `TrainerCallback` that announces each saved checkpoint to evaldag (see the module docstring).

    - `benchmarks`: what to evaluate each checkpoint on (None: the on-checkpoint deployment's default).
    - `limit`: evaluate only the first N problems (a quick slice), sent in the event.
    - `decide`: stop each evaluation once its verdict against the job's best checkpoint is decided ("vs_best" or
      a dict, as CheckpointNotifier takes it).
    - `every_saves`: announce every k-th save only; or `trigger`, an `EvalTrigger` (steps, epochs or seconds)
      asked at each save: the first save at or after a due point is announced. One of the two.
    - `train_run`: the job's name (default: `args.run_name`, else the output folder's name).
    - `mlflow_parent_run_id`: the MLflow run the evaluations hang under (default: the run active in the trainer
      process, e.g. the one transformers' MLflowCallback started; none: evaldag makes the job's own).
    - `final_step`: the job's planned last step (default: the Trainer's `max_steps`).
    - `sampling`, `engine_settings`: this job's evaluations' sampling (n, temperature, top_p, max_new_tokens,
      seed) and engine settings (tensor_parallel_size, max_model_len, gpu_memory_utilization, dtype), sent in
      every event (a reasoning model: {"n": 8, "temperature": 0.6, "max_new_tokens": 32768}).
    - `api_url`, `spool_dir`, `max_block_s`: passed to CheckpointNotifier.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "EvaldagCallback":
        return super().__new__(_trainer_class() if cls is EvaldagCallback else cls)

    def __init__(self, benchmarks: list[str] | None = None, *, limit: int | None = None,
                 decide: str | dict | None = None, every_saves: int = 1, trigger: EvalTrigger | None = None,
                 train_run: str | None = None, mlflow_parent_run_id: str | None = None,
                 final_step: int | None = None, api_url: str | None = None, spool_dir: str | Path | None = None,
                 sampling: dict | None = None, engine_settings: dict | None = None,
                 max_block_s: float = 5.0) -> None:
        self.benchmarks = check_benchmark_names(benchmarks) if benchmarks is not None else None
        self.limit = check_limit(limit)
        self.decide = check_decide(decide)
        if isinstance(every_saves, bool) or not isinstance(every_saves, int) or every_saves < 1:
            raise ValueError(f"every_saves must be an int >= 1 (1: every save), got {every_saves!r}")
        if trigger is not None and not isinstance(trigger, EvalTrigger):
            raise ValueError(f"trigger must be an evaldag.client.EvalTrigger, got {type(trigger).__name__}")
        if trigger is not None and every_saves != 1:
            raise ValueError("give every_saves or trigger, not both: each decides which saves are evaluated")
        if train_run is not None:
            check_train_run(train_run)
        check_run_id(mlflow_parent_run_id)
        if final_step is not None and (isinstance(final_step, bool) or not isinstance(final_step, int)
                                       or final_step < 1):
            raise ValueError(f"final_step must be an int >= 1 or None, got {final_step!r}")
        # the notifier's own checks, made here too: on every rank, before training, not on the main process alone
        check_api_url(api_url)
        positive("max_block_s", max_block_s, float)
        self.every_saves, self.trigger, self.train_run = every_saves, trigger, train_run
        self.mlflow_parent_run_id, self.final_step = mlflow_parent_run_id, final_step
        self._notifier_options = {"api_url": api_url, "spool_dir": spool_dir, "max_block_s": max_block_s,
                                  "sampling": check_settings("sampling", sampling, SAMPLING_KEYS),
                                  "engine_settings": check_settings("engine_settings", engine_settings,
                                                                    ENGINE_SETTING_KEYS)}
        self.notifier: CheckpointNotifier | None = None
        self.saves = 0
        self.announced: list[str] = []      # event ids, in order
        self.off = False                    # a setting was refused: every later event is a no-op

    # -- Trainer events ----------------------------------------------------------------------------------------

    @_never_raises
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Build the notifier for this job: its name and final step are known now."""
        if state.is_world_process_zero:
            self._start(args, state)

    @_never_raises
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Announce the checkpoint the Trainer has just written, when this save is due."""
        if state.is_world_process_zero:
            self._announce(args, state)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _start(self, args: Any, state: Any) -> None:
        if getattr(args, "save_total_limit", None):
            log.warning("save_total_limit=%s deletes older checkpoints while their evaluations may still be queued; "
                        "those evaluations then fail as 'folder is gone'. Leave it unset, or keep evaluations "
                        "quick (limit=...)", args.save_total_limit)
        final = self.final_step or (state.max_steps if state.max_steps and state.max_steps > 0 else None)
        self.notifier = CheckpointNotifier(self.job_name(args), benchmarks=self.benchmarks, final_step=final,
                                           decide=self.decide, mlflow_parent_run_id=self.mlflow_parent_run_id,
                                           **self._notifier_options)

    def job_name(self, args: Any) -> str:
        """The job's name: `train_run`, else the Trainer's `run_name`, else its output folder's name (either made
        a valid name the way `evaldag run` names a folder: "my run" -> "my-run")."""
        if self.train_run:
            return self.train_run
        output = os.path.abspath(args.output_dir)
        run_name = getattr(args, "run_name", None)
        # older transformers default run_name to output_dir: a path, not a name
        use_run_name = run_name and os.path.abspath(run_name) != output
        return train_run_name(run_name if use_run_name else Path(output).name)

    def _due(self, state: Any) -> bool:
        self.saves += 1
        if self.trigger is not None:
            return self.trigger.check(int(state.epoch or 0), state.global_step)
        return self.saves % self.every_saves == 0

    def _announce(self, args: Any, state: Any) -> None:
        if not self._due(state):
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if self.notifier is None:      # a save before on_train_begin (a subclass calling on_save itself)
            self._start(args, state)
        self.notifier.mlflow_parent_run_id = self.mlflow_parent_run_id or active_mlflow_run_id()
        folder = os.path.join(os.path.abspath(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        extra = {"limit": self.limit} if self.limit is not None else {}
        self.announced.append(self.notifier.notify(folder, state.global_step, epoch=int(state.epoch or 0), **extra))


def active_mlflow_run_id() -> str | None:
    """The MLflow run active in this process (transformers' MLflowCallback starts one), or None. mlflow is not
    imported for this: a trainer that never imported it has no run."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.active_run()
        # an id the event schema refuses would get the whole event refused: the job's own parent run is better
        return None if run is None else check_run_id(run.info.run_id)
    except Exception as e:  # noqa: BLE001 - a broken tracking setup must not stop the announcement
        log.warning("evaldag: the active MLflow run is not usable as the evaluations' parent (%s); evaldag makes the "
                    "job's own", e)
        return None


__all__ = ["EvaldagCallback", "active_mlflow_run_id"]
