"""Plug-ins: a team's own rewards and per-evaluation statistics, without editing evaldag.

A plug-in is a function of an installed package, registered as an entry point of group `evaldag.rewards` or
`evaldag.metrics` (the convention pytest and Prefect use for plug-ins) in that package's pyproject.toml:

    [project.entry-points."evaldag.metrics"]
    boxed_share = "my_team_evals.stats:boxed_share"

and a benchmark config names it by the entry point's name (`boxed_share`). Only installed entry points are looked
up, never a module a config names: a config travels inside every plan.json of the result store, which every node
can write, so a name that could import any module would let whoever writes the store run code where plans are read.

A reward plug-in is a factory like evaldag.scoring.rewards' own: called with the component's params, it returns a
`pl.Expr` giving one float per row of the graded table (`evaldag.storage.schema.GRADED_SCHEMA`). A metric plug-in
takes the graded table (a polars DataFrame, the first round's rows, as accuracy is over) and returns
{metric name: number}; its names go into the evaluation's metrics (MLflow) as they are and must not be the name of
a metric evaldag computes.

Entry points are looked up when a config names one, never at import (no import-time registration). Validating a
config loads a named plug-in and reads its signature, and never calls it; a reward plug-in is tried on a one-row
table by `evaldag.scoring.rewards.check_rewards`, which the config's loading runs before anything is generated.
Any failure says which plug-in it was.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from evaldag.errors import ConfigError

REWARDS_GROUP = "evaldag.rewards"
METRICS_GROUP = "evaldag.metrics"
_KINDS = {REWARDS_GROUP: "reward", METRICS_GROUP: "metric"}


class PluginError(ConfigError, ValueError):
    """A plug-in cannot be loaded, has the wrong signature or failed; the message names it. A ValueError too, so
    that a pydantic validator reports it as a validation error of the config field that names the plug-in."""


def installed(group: str) -> list[str]:
    """The names of the entry points installed in `group`, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)})


def how_to_register(group: str) -> str:
    """How a package registers a plug-in in `group`: the sentence every unknown plug-in's error ends with."""
    return (f"a plug-in is a function of an installed package, registered in its pyproject.toml as "
            f'[project.entry-points."{group}"] my_name = "my_package.module:function", then named my_name '
            "once that package is installed where evaluations run (every worker)")


def load(name: str, group: str, builtin: list[str] | tuple[str, ...] = ()) -> Callable[..., Any]:
    """The function the entry point `name` of `group` stands for (it imports the installed package that registers
    it, and calls nothing). Raises PluginError naming the plug-in when no installed package registers it, several
    register it differently, or it cannot be imported or is not callable. `builtin`: the built-in names of the
    kind, for the message."""
    kind = _KINDS[group]
    found = sorted(entry_points(group=group, name=name), key=lambda ep: ep.value)
    if not found:
        builtins = f"not a built-in {kind} ({', '.join(builtin)}) nor" if builtin else "not"
        raise PluginError(f"unknown {kind} {name!r}: {builtins} an entry point of group {group!r} (installed: "
                          f"{installed(group)}); {how_to_register(group)}")
    if len({ep.value for ep in found}) > 1:
        raise PluginError(f"{kind} plug-in {name!r}: several packages register it in {group!r} "
                          f"({[ep.value for ep in found]}); uninstall all but one")
    what = f"{kind} plug-in {name!r} (entry point {found[0].value!r})"
    try:
        fn = found[0].load()
    except Exception as error:   # an import error, a missing attribute, an exception while importing its module
        raise PluginError(f"{what} cannot be loaded: {type(error).__name__}: {error}; install its package where "
                          "evaluations run (every worker) or fix its entry point") from error
    if not callable(fn):
        raise PluginError(f"{what} is a {type(fn).__name__}, not a function")
    return fn


def check_metric(name: str) -> None:
    """Load a metric plug-in and check that it takes the graded table as its one argument."""
    fn = load(name, METRICS_GROUP)
    try:
        inspect.signature(fn).bind(object())
    except TypeError as error:
        raise PluginError(f"metric plug-in {name!r} must take one argument, the graded table (a polars DataFrame): "
                          f"{name}{inspect.signature(fn)} does not ({error})") from None
    except ValueError:      # no signature to read (a builtin): it is called and judged at the reduce
        pass


def plugin_metrics(graded: Any, names: list[str], taken: set[str]) -> dict[str, float]:
    """The metrics of every metric plug-in in `names` on the graded table; their names must not be in `taken` (the
    metrics evaldag computed) nor another plug-in's. Raises PluginError naming the plug-in that fails."""
    out: dict[str, float] = {}
    for name in names:
        fn = load(name, METRICS_GROUP)
        try:
            got = fn(graded)
        except Exception as error:
            raise PluginError(f"metric plug-in {name!r} failed on the graded table ({graded.height} rows): "
                              f"{type(error).__name__}: {error}") from error
        out.update(_checked(name, got, taken | set(out)))
    return out


def _checked(name: str, got: Any, taken: set[str]) -> dict[str, float]:
    if not isinstance(got, Mapping):
        raise PluginError(f"metric plug-in {name!r} returned a {type(got).__name__}; it must return "
                          "{metric name: number}")
    out = {}
    for key, value in got.items():
        if not isinstance(key, str) or not key:
            raise PluginError(f"metric plug-in {name!r} returned the metric name {key!r}; names are non-empty text")
        if key in taken:
            raise PluginError(f"metric plug-in {name!r} returned {key!r}, a metric evaldag or another plug-in "
                              "already logs; give it a name of its own (e.g. prefixed with the plug-in's)")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise PluginError(f"metric plug-in {name!r} returned {key!r} = {value!r}, not a number") from None
        if not math.isfinite(number):
            raise PluginError(f"metric plug-in {name!r} returned {key!r} = {number}; leave an undefined figure out "
                              "rather than logging it")
        out[key] = number
    return out
