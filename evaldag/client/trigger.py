"""When a trainer should evaluate: `EvalTrigger` answers "is an evaluation due at (epoch, step)?" for step, epoch
and wall-clock frequencies, and saves its state with the trainer's so a resumed run neither evaluates twice nor
skips one. Standard library only, like all of evaldag.client (training scripts import it)."""

from __future__ import annotations

from __future__ import annotations

import time
from typing import Callable

from evaldag.request.rules import check_count, check_step


def positive(name: str, value: float | None, kind: type) -> None:
    """Refuse a setting that is set (not None) but not a number (`kind` float) or an int (`kind` int) above 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{name} must be {'a number' if kind is float else 'an int'} > 0 or None, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (or None to disable it), got {value!r}")


class EvalTrigger:
    """Decides when an evaluation is due, from step, epoch and wall-clock frequencies (any combination).

    Call `check(epoch, step)` after every optimizer step (or as often as you like); it returns True when at least
    one configured condition is due, and then records the trigger (its step, epoch and time):

    - steps: due when `step` has crossed a multiple of `freq_steps` since the last trigger, i.e.
      `step // freq_steps > last_step // freq_steps`. "Every 100 steps" fires at steps 100, 200, 300, ... and
      never at step 0. Called every step, this is exactly `step - last_step >= freq_steps`; it also keeps that grid
      when calls are irregular (fires at 120, then at 205) or when a seconds/epoch trigger fired in between (a
      trigger at step 150 does not move the next one to 250).
    - epochs: the same with `epoch // freq_epochs`. The first trigger is when `epoch` reaches `freq_epochs`, so pass
      either the 0-based index of the current epoch (fires at the first step of epoch 1, 2, ...: the previous epoch
      just ended) or the number of completed epochs; both mean "every N epochs".
    - seconds: due when `freq_secs` have passed since the last trigger (of any kind) or, before the first one,
      since the trigger was created. Any trigger restarts this clock: the goal is "never more than N seconds
      without an evaluation".

    `last_reasons` holds which conditions made the last True answer ("steps", "epochs", "secs").
    `state_dict()` / `load_state_dict()` carry the state across a restart; see load_state_dict.
    """

    def __init__(self, freq_steps: int | None = None, freq_epochs: int | None = None, freq_secs: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        positive("freq_steps", freq_steps, int)
        positive("freq_epochs", freq_epochs, int)
        positive("freq_secs", freq_secs, float)
        if freq_steps is None and freq_epochs is None and freq_secs is None:
            raise ValueError("EvalTrigger needs at least one of freq_steps, freq_epochs, freq_secs "
                             "(e.g. EvalTrigger(freq_steps=500))")
        self.freq_steps = freq_steps
        self.freq_epochs = freq_epochs
        self.freq_secs = float(freq_secs) if freq_secs is not None else None
        self._clock = clock
        self.last_step = 0
        self.last_epoch = 0
        self.last_time = clock()
        self.num_triggers = 0
        self.last_reasons: tuple[str, ...] = ()

    def due(self, epoch: int, step: int) -> tuple[str, ...]:
        """Which conditions are due at (epoch, step), without recording anything."""
        epoch = check_count("epoch", epoch)
        step = check_step(step)
        reasons = []
        if self.freq_steps is not None and step // self.freq_steps > self.last_step // self.freq_steps:
            reasons.append("steps")
        if self.freq_epochs is not None and epoch // self.freq_epochs > self.last_epoch // self.freq_epochs:
            reasons.append("epochs")
        if self.freq_secs is not None and self._clock() - self.last_time >= self.freq_secs:
            reasons.append("secs")
        return tuple(reasons)

    def check(self, epoch: int, step: int) -> bool:
        """True when an evaluation is due at (epoch, step); a True answer records this point as the last trigger."""
        reasons = self.due(epoch, step)
        if not reasons:
            return False
        # max(): a step or epoch that went backwards (e.g. a trainer that rewound) never re-opens passed grid points.
        self.last_step = max(self.last_step, step)
        self.last_epoch = max(self.last_epoch, epoch)
        self.last_time = self._clock()
        self.num_triggers += 1
        self.last_reasons = reasons
        return True

    def state_dict(self) -> dict:
        """JSON-serialisable state to save with the trainer's checkpoint.

        Time is stored as seconds elapsed since the last trigger, not as a clock reading: a monotonic timestamp
        means nothing in another process.
        """
        return {"version": 1, "freq_steps": self.freq_steps, "freq_epochs": self.freq_epochs,
                "freq_secs": self.freq_secs, "last_step": self.last_step, "last_epoch": self.last_epoch,
                "secs_since_last": max(0.0, self._clock() - self.last_time), "num_triggers": self.num_triggers}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output: the resumed trainer neither re-triggers passed points nor skips due ones.

        The frequencies of this object (from its constructor) are kept, so a resumed run may change them; only the
        record of the last trigger is restored. Seconds resume from the saved elapsed time: the time the job was
        down does not count.
        """
        if not isinstance(state, dict):
            raise ValueError(f"EvalTrigger state must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("last_step", "last_epoch", "secs_since_last") if k not in state]
        if missing:
            raise ValueError(f"EvalTrigger state lacks {missing}; pass the dict returned by EvalTrigger.state_dict()")
        last_step = check_count("state['last_step']", state["last_step"])
        last_epoch = check_count("state['last_epoch']", state["last_epoch"])
        secs = state["secs_since_last"]
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0:
            raise ValueError(f"state['secs_since_last'] must be a number >= 0, got {secs!r}")
        self.last_step, self.last_epoch = last_step, last_epoch
        self.last_time = self._clock() - float(secs)
        self.num_triggers = check_count("state['num_triggers']", state.get("num_triggers", 0))
