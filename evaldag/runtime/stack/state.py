"""The stack's state file, <home>/stack/state.json: what `up` started (pid + process create time, URLs, settings),
written atomically and readable by its owner only, and the lock that lets one `up`/`down` run at a time per home."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

from evaldag.errors import StackError
from evaldag.runtime.stack.settings import STATE_VERSION, StackSettings


class StateFile:
    """Reading and writing the state file (a part of `evaldag.runtime.stack.Stack`)."""

    settings: StackSettings
    home: Path
    state_dir: Path
    state_path: Path

    def _new_state(self) -> dict:
        return {"version": STATE_VERSION, "stack_id": uuid.uuid4().hex, "home": str(self.home),
                "created_at": time.time(), "urls": self._urls(), "components": {}}

    def _load_state(self) -> dict | None:
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StackError(f"cannot read {self.state_path} ({e}); stop any leftover processes by hand and "
                             f"delete the file") from None
        if state.get("version") != STATE_VERSION:
            raise StackError(f"{self.state_path} has version {state.get('version')}, expected {STATE_VERSION}; "
                             "stop the stack with the evaldag version that started it")
        return state

    def _make_private(self) -> None:
        """The stack's own folders (<home>/stack, logs, prefect, mlflow) readable by this user alone, created so or
        made so: they hold Prefect's database, with every flow run's parameters and logs and the key its blocks
        (the cluster's credentials) are encrypted with, MLflow's stores and the components' logs; a default umask
        left them world-readable. PostgreSQL's cluster keeps its own folder (evaldag.runtime.postgres)."""
        for folder in (self.state_dir, self.logs_dir, self.home / "prefect", self.home / "mlflow"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if folder.stat().st_uid == os.getuid():
                folder.chmod(0o700)

    def _save_state(self, state: dict) -> None:
        s = self.settings
        state["urls"] = self._urls()
        state["settings"] = s.model_dump(mode="json", exclude={"worker_env", "api_auth"})  # credentials
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        # created 0600, not chmod-ed after the write: the recorded environments may hold credentials (database,
        # result store)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2))
        tmp.chmod(0o600)       # a leftover .tmp from an older version kept its mode through O_TRUNC
        tmp.replace(self.state_path)

    def _remove_state(self) -> None:
        self.state_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """One `up`/`down` at a time per home."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
