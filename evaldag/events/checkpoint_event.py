"""Checkpoints announced by trainers: parse their step from the folder name, validate events, find them on disk.

An `evaldag.checkpoint.saved` event (sent by `evaldag.client.notifier.CheckpointNotifier`) is untrusted input: anyone who can
POST to the Prefect API can send one. `validate_checkpoint_event` therefore checks the payload's types strictly and
only accepts a checkpoint folder that lies, after resolving symlinks, under a root the operator allowed
(`EVALDAG_CHECKPOINT_ROOTS`), and that is complete on disk. A hub model id instead of a folder is refused unless
its namespace is listed in `EVALDAG_CHECKPOINT_HUB_ORGS` (default: none), and then only pinned to a commit
(`_hub_model` says why). The job's sampling and engine settings are validated as a request's are.

The trainer side (evaldag/client/notifier.py) does not import this module: it must run without pydantic. Both take their
rules (train run, benchmark name, step, run id, checkpoint completeness) from evaldag.request.rules.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from evaldag.errors import CheckpointError
from evaldag.request.layouts import hf_folder, step_folder
from evaldag.request.rules import (MIN_STEP, RUN_ID_PATTERN, TRAIN_RUN_PATTERN, check_benchmark_ref, check_checkpoint,
                           check_decide, describe_errors)

log = logging.getLogger("evaldag.events.checkpoint_event")

ROOTS_ENV = "EVALDAG_CHECKPOINT_ROOTS"
# Hub namespaces (comma-separated, e.g. "my-org,open-r1") whose models an event may name as org/name@<commit>
# instead of a folder; unset: none (see _hub_model for why)
HUB_ORGS_ENV = "EVALDAG_CHECKPOINT_HUB_ORGS"
# The free-form `extra` of an event ends up in flow-run parameters and the Prefect database: a few settings
# (limit, notes), not a payload. Measured as compact JSON.
MAX_EXTRA_BYTES = 16384

# Folder-name layouts whose training step parse_step recognizes (whole name, case-insensitive), with examples:
STEP_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p, re.IGNORECASE), ex) for p, ex in (
    (r"checkpoint[-_](\d+)", "checkpoint-1200 (Hugging Face Trainer), checkpoint_1200"),
    (r"global[-_]?step[-_]?(\d+)", "global_step_1200 (verl), global_step1200 (DeepSpeed), globalstep1200"),
    (r"global[-_]?step[-_]?(\d+)[-_]hf", "global_step1200_hf (OpenRLHF --save_hf_ckpt)"),
    (r"step[-_]?(\d+)", "step_1200, step-1200, step1200"),
    (r"ckpt[-_](\d+)", "ckpt_1200, ckpt-1200"),
    (r"iter[-_](\d+)", "iter_0001200 (Megatron)"),
    (r"epoch[-_=]?\d+[-_]?epochstep[-_=]?\d+[-_]?globalstep[-_=]?(\d+)",
     "epoch1epochstep5globalstep1200 (the global step, 1200)"),
    (r"epoch=\d+-step=(\d+)", "epoch=1-step=1200 (Lightning; its step is the global step)"),
))


def parse_step(name: str) -> int | None:
    """The training step in a checkpoint folder name, or None when the name follows none of STEP_PATTERNS.

    The whole name must match, so `tmp-checkpoint-1200` (the Trainer's folder while it is still writing),
    `checkpoint-best` or `step_1200_old` give None.
    """
    for pattern, _ in STEP_PATTERNS:
        if m := pattern.fullmatch(name):
            return int(m.group(1))
    return None


class CheckpointEvent(BaseModel):
    """The payload of an `evaldag.checkpoint.saved` event.

    Types are strict (a step of "12" or True is refused, not coerced); unknown keys are ignored, so payloads from a
    newer trainer with more fields still validate.
    """

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    path: str = Field(min_length=1, description="absolute checkpoint folder")
    step: int = Field(ge=MIN_STEP, description="training step: the x axis of the MLflow metrics")
    epoch: int | None = Field(None, ge=MIN_STEP, description="training epoch of the checkpoint, when the trainer "
                                                             "counts epochs")
    train_run: str = Field(pattern=TRAIN_RUN_PATTERN, description="name of the training run")
    benchmarks: list[Annotated[str, AfterValidator(check_benchmark_ref)]] | None = Field(
        None, min_length=1, description="benchmark config names or config files' absolute paths; None = the default")
    sampling: dict | None = Field(None, description="this job's sampling over the benchmark's (n, temperature, "
                                                    "top_p, max_new_tokens, seed; evaldag.request.config."
                                                    "SamplingOverrides)")
    engine_settings: dict | None = Field(None, description="this job's engine settings over the model's "
                                                           "(evaldag.request.config.EngineSettings)")
    mlflow_parent_run_id: str | None = Field(None, pattern=RUN_ID_PATTERN,
                                             description="the training job's MLflow run, when the trainer made one")
    final_step: int | None = Field(None, ge=1, description="the job's planned last step, for its forecast")
    decide: str | dict | None = Field(None, description="stop the evaluation early once its verdict against the "
                                                        "job's best is decided (evaldag.request.rules.check_decide)")
    extra: dict[str, Any] = Field(default_factory=dict,
                                  description="the trainer's own small settings, such as limit (evaluate only the "
                                              "first problems); at most 16 KiB of JSON")


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def allowed_roots_from_env() -> list[Path]:
    """The folders checkpoints may live under, from `EVALDAG_CHECKPOINT_ROOTS` (os.pathsep-separated).

    Unset or empty gives [], with which validate_checkpoint_event refuses every path. Entries must be absolute.
    """
    roots = []
    for entry in os.environ.get(ROOTS_ENV, "").split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        path = Path(entry).expanduser()
        if not path.is_absolute():
            raise CheckpointError(f"{ROOTS_ENV} entry {entry!r} is not an absolute path; list absolute folders "
                                  f"separated by {os.pathsep!r}, e.g. /ckpts{os.pathsep}/scratch/ckpts")
        roots.append(path)
    return roots


def _check_marker(marker: str | None) -> None:
    if marker is not None and (not marker or os.path.isabs(marker) or ".." in PurePath(marker).parts):
        raise CheckpointError(f"marker must be a file name relative to the checkpoint folder (e.g. 'COMPLETE'), "
                              f"got {marker!r}")


def validate_checkpoint_event(payload: object, allowed_roots: list[str | Path],
                              marker: str | None = None) -> CheckpointEvent:
    """Validate an event payload and its checkpoint folder; returns the event with `path` resolved (realpath).

    Raises CheckpointError naming the problem: not a mapping, missing or mistyped fields, a relative path or one
    with `..` components, a folder that (after resolving symlinks) is not under one of `allowed_roots`, a missing
    or incomplete folder (evaldag.request.rules.check_checkpoint), a folder whose name holds another step than the event's
    (`checkpoint-1200` sent with step 1100; parse_step), or, when `marker` is given, a folder without that
    marker file (the trainer writes it last, once the checkpoint is complete). The returned path is the resolved
    one, so the evaluation reads exactly the folder that was checked.
    """
    if not isinstance(payload, Mapping):
        raise CheckpointError(f"checkpoint event payload must be a mapping with path, step and train_run, got "
                              f"{type(payload).__name__}; is the trigger passing '{{{{ event.payload }}}}'?")
    try:
        event = CheckpointEvent.model_validate(dict(payload))
    except ValidationError as e:
        raise CheckpointError(f"invalid checkpoint event payload: {describe_errors(e.errors(), top='(payload)')}") from None
    raw = event.path
    where = f"checkpoint event (train_run={event.train_run}, step={event.step})"
    if event.decide is not None:
        event = event.model_copy(update={"decide": check_decide(event.decide, CheckpointError)})
    event = event.model_copy(update=_job_settings(event, where))
    extra_size = len(json.dumps(event.extra, separators=(",", ":"), default=str).encode())
    if extra_size > MAX_EXTRA_BYTES:
        raise CheckpointError(f"{where}: extra is {extra_size} bytes of JSON; at most {MAX_EXTRA_BYTES} are accepted "
                              "(it carries a few settings such as limit; keep large data out of the event)")
    if (hub := _hub_model(raw, where)) is not None:
        return event.model_copy(update={"path": hub})
    _check_raw_path(raw, where)
    _check_marker(marker)
    if not allowed_roots:
        raise CheckpointError(f"{where}: no checkpoint roots are allowed, so {raw} is refused; set {ROOTS_ENV} "
                              f"to the folder(s) trainers write checkpoints under ({os.pathsep!r}-separated)")
    # symlinks resolved: a link inside a root cannot point outside it; verl's global_step_N stands for its
    # actor/huggingface model (evaldag.request.layouts)
    real = _real(hf_folder(_real(raw)))
    roots = [_real(r) for r in allowed_roots]
    if not any(real.is_relative_to(r) for r in roots):
        via = f" (it resolves to {real})" if str(real) != raw else ""
        raise CheckpointError(f"{where}: {raw}{via} is not under an allowed checkpoint root "
                              f"({', '.join(str(r) for r in roots)}); add its root to {ROOTS_ENV}")
    if not real.exists():
        raise CheckpointError(f"{where}: checkpoint folder {raw} does not exist")
    _check_named_step(raw, real, event.step, where)
    _check_links_stay_inside(real, roots, where)
    if marker is not None and not (real / marker).is_file():
        raise CheckpointError(f"{where}: {raw} has no {marker} marker; the trainer writes it once the checkpoint "
                              "is complete, so it is still being written (or the trainer does not write markers)")
    try:
        check_checkpoint(real, CheckpointError)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return event.model_copy(update={"path": str(real)})


def _job_settings(event: CheckpointEvent, where: str) -> dict:
    """The event's sampling and engine settings, validated as a request's are (bounds, known keys, types), as plain
    dicts of the settings given; whether sampling fits the benchmark's (n > 1 needs temperature > 0) is checked
    by the evaluation, which knows the benchmark."""
    from evaldag.request.config import EngineSettings, SamplingOverrides

    out = {}
    for name, model in (("sampling", SamplingOverrides), ("engine_settings", EngineSettings)):
        value = getattr(event, name)
        if value is None:
            continue
        try:
            out[name] = model.model_validate(value).model_dump(exclude_none=True) or None
        except ValidationError as e:
            raise CheckpointError(f"{where}: invalid {name}: {describe_errors(e.errors(), top=f'({name})')}") from None
    return out


def job_overrides(event: CheckpointEvent, overrides: Mapping[str, Any] | None = None) -> dict:
    """The evaluation parameters `sampling` and `engine_settings` of a validated event: the job's own settings over
    the deployment's (`overrides`, its eval_overrides), setting by setting."""
    out = {}
    for name in ("sampling", "engine_settings"):
        if getattr(event, name):
            out[name] = {**((overrides or {}).get(name) or {}), **getattr(event, name)}
    return out


def allowed_hub_orgs_from_env() -> list[str]:
    """The hub namespaces whose models events may name (HUB_ORGS_ENV, comma-separated); [] when unset."""
    return [o.strip() for o in os.environ.get(HUB_ORGS_ENV, "").split(",") if o.strip()]


def _hub_model(raw: str, where: str) -> str | None:
    """A hub model id (org/name@revision) the event names, when its org is allowed (HUB_ORGS_ENV), else None: the
    path rules then refuse it (a relative path; _check_raw_path names the hub rule too). Events are untrusted: a hub id reads no local file, but it makes the
    workers download and run whatever repository it names (any size, any code its config asks for), so only the
    operator's own namespaces are accepted, and only pinned to a commit, so that the event names one set of
    weights (the step it announces) and not whatever a branch holds when the evaluation starts."""
    from evaldag.request.hub_models import parse_hub_id

    if os.path.isabs(raw) or (hub := parse_hub_id(raw)) is None:
        return None
    if hub.repo_id.split("/", 1)[0] not in allowed_hub_orgs_from_env():
        return None
    if not hub.pinned:
        raise CheckpointError(f"{where}: hub model {raw!r} names no commit; send org/name@<40-hex commit sha> "
                              "(the revision the trainer pushed for this step), so that the evaluation reads "
                              "exactly those weights")
    return str(hub)


def _check_raw_path(raw: str, where: str) -> None:
    """Refuse an event path with a NUL, a relative one, or one with `..` components."""
    if "\0" in raw:
        raise CheckpointError(f"{where}: path contains a NUL character")
    if not os.path.isabs(raw):
        from evaldag.request.hub_models import parse_hub_id

        hub = parse_hub_id(raw)
        orgs = ", ".join(allowed_hub_orgs_from_env()) or "none is"
        as_hub = (f"; as a hub model id it is refused too: events may name hub models only of the namespaces "
                  f"listed in {HUB_ORGS_ENV} ({orgs}), add {hub.repo_id.split('/')[0]!r} there to allow it"
                  if hub is not None else "")
        raise CheckpointError(f"{where}: path {raw!r} is not absolute; send the absolute checkpoint folder "
                              f"(CheckpointNotifier.notify does this){as_hub}")
    # Checked on the raw string: after normalisation `..` would be gone and the intent to escape hidden.
    if ".." in PurePath(raw).parts:
        raise CheckpointError(f"{where}: path {raw!r} contains '..' components; send the plain absolute folder")


def _check_named_step(raw: str, real: Path, step: int, where: str) -> None:
    """Refuse a checkpoint folder whose name says another step than the event's."""
    # the folder name is what the sweeper reads the step from: an event that says otherwise (checkpoint-1200 sent
    # as step 1100) would file one checkpoint's results under two steps, or another's under this one. verl's
    # model is named after the global_step_N folder above it.
    for name in dict.fromkeys((step_folder(Path(raw)).name, step_folder(real).name)):
        named = parse_step(name)
        if named is not None and named != step:
            raise CheckpointError(f"{where}: the folder name {name!r} says step {named}, the event says step "
                                  f"{step}; send the step the checkpoint was saved at (or a folder named "
                                  "after it)")


def _check_links_stay_inside(folder: Path, roots: list[Path], where: str) -> None:
    """Refuse a checkpoint whose files link out of the allowed roots: the folder being inside is not enough when its
    weights, config or tokenizer are symlinks to any file the worker can read (another team's model)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            entry = Path(dirpath) / name
            if entry.is_symlink() and not any(_real(entry).is_relative_to(r) for r in roots):
                raise CheckpointError(f"{where}: {entry} links to {_real(entry)}, outside the allowed checkpoint "
                                      f"roots ({', '.join(str(r) for r in roots)}); copy the file into the "
                                      "checkpoint or add its root to " + ROOTS_ENV)


def _complete(folder: Path, marker: str | None) -> str | None:
    """None when `folder` is a complete checkpoint, else why not."""
    if marker is not None and not (folder / marker).is_file():
        return f"no {marker} marker"
    try:
        check_checkpoint(folder, CheckpointError)
    except CheckpointError as e:
        return str(e)
    return None


def discover_checkpoints(root: Path, marker: str | None = None) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` as (step, folder), sorted by step (then path).

    Looks at the folders directly under `root` (`<root>/checkpoint-1200`) and, for those whose name is not a
    checkpoint name, one level deeper (`<root>/<run>/checkpoint-1200`). A framework's step folder gives the model
    it holds (verl's `global_step_N` gives `global_step_N/actor/huggingface`: evaldag.request.layouts). A folder counts when parse_step reads a
    step from its name and it is complete (evaldag.request.rules.check_checkpoint, plus `marker` when given).
    Incomplete ones are skipped and logged at INFO with the reason; hidden folders (`.name`) and entries whose
    real path lies outside `root` (symlinks) are ignored.
    """
    _check_marker(marker)
    root = Path(root).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} does not exist or is not a folder")
    real_root = _real(root)
    found: list[tuple[int, Path]] = []

    def visit(folder: Path, depth: int) -> None:
        for child in sorted(folder.iterdir()):
            if child.name.startswith(".") or not child.is_dir():
                continue
            if not _real(child).is_relative_to(real_root):
                log.info("skipping %s: it resolves outside %s", child, root)
                continue
            step = parse_step(child.name)
            target = parse_step(step_folder(_real(child)).name) if child.is_symlink() else None
            if step is not None and target is not None and target != step:
                log.info("skipping %s: its name says step %d, the folder it links to (%s) step %d", child, step,
                         _real(child), target)
                continue
            if step is None:
                if depth == 0:
                    visit(child, 1)
                else:
                    log.debug("skipping %s: no step in its name", child)
                continue
            model = hf_folder(child)      # verl: global_step_N/actor/huggingface
            why = _complete(model, marker)
            if why is None:
                found.append((step, model))
            else:
                log.info("skipping incomplete checkpoint %s: %s", child, why)

    visit(root, 0)
    # one folder reached both by its own name and through a link is one checkpoint: the link is dropped (it would
    # file the same evaluation under a second train run)
    kept: dict[Path, tuple[int, Path]] = {}
    for step, folder in sorted(found, key=lambda sp: (sp[1].is_symlink(), str(sp[1]))):
        kept.setdefault(_real(folder), (step, folder))
    return sorted(kept.values(), key=lambda sp: (sp[0], str(sp[1])))


__all__ = ["CheckpointEvent", "STEP_PATTERNS", "ROOTS_ENV", "HUB_ORGS_ENV", "allowed_hub_orgs_from_env",
           "job_overrides", "TRAIN_RUN_PATTERN", "parse_step", "validate_checkpoint_event", "discover_checkpoints",
           "allowed_roots_from_env"]
