"""What is read back from Prefect's result store is data (issue 51): every node can write the store, and Prefect's
own reader decodes a record with whatever serializer the record file names (pickle; or JSON whose object hook
imports and calls what `__class__`/`__exc_type__` name). No task persists or looks up a result there, and the one
result read back (the eval flow's summary, by `evaldag run`) is parsed as plain JSON."""

from __future__ import annotations

import base64
import importlib
import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import Flow, Task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from evaldag.runtime import prefect_results, runner

ROOT = Path(__file__).resolve().parents[1]
KEY = "0123456789abcdef" * 2


class _Planted:
    """Unpickling it creates the file `marker` (what a node writing the store could make the head run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _record(serializer: dict, result: str) -> str:
    return json.dumps({"metadata": {"storage_key": KEY, "expiration": None, "serializer": serializer,
                                    "prefect_version": "3.9.1", "storage_block_id": None}, "result": result})


def _state(storage_key: str, serializer: str = "pickle"):
    return Completed(data={"storage_key": storage_key, "serializer": {"type": serializer},
                           "storage_block_id": None, "expiration": None, "prefect_version": "3.9.1"})


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EVALDAG_RESULTS_DIR", str(tmp_path / "store"))
    monkeypatch.delenv("EVALDAG_RESULTS_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    folder = Path(prefect_results.storage_location())
    folder.mkdir(parents=True)
    return folder


@pytest.mark.parametrize("whole_record", [True, False], ids=["record", "bare"])
def test_a_planted_pickle_is_not_unpickled_by_evaldag_run(results, tmp_path, whole_record):
    marker = tmp_path / "unpickled.txt"
    planted = results / KEY
    payload = base64.b64encode(pickle.dumps(_Planted(str(marker)))).decode()
    planted.write_text(_record({"type": "pickle"}, payload) if whole_record else payload)
    for key in (KEY, str(planted)):      # the state names the record by its key, or (an unsaved block) its path
        assert prefect_results.read_result(_state(key)) is None
        assert runner._flow_summary(SimpleNamespace(state=_state(key)), "math500") is None
    assert not marker.exists()


def test_a_planted_class_name_is_not_imported(results, tmp_path, monkeypatch):
    (tmp_path / "planted_module.py").write_text("open('imported.txt', 'w').write('x')\nclass Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = {"metrics": {"accuracy": 0.5, "obj": {"__class__": "planted_module.Thing", "data": {}}},
               "err": {"__exc_type__": "planted_module.Thing", "message": "m"}}
    for content in (_record({"type": "json", "object_decoder": "planted_module.Thing"}, json.dumps(summary)),
                    json.dumps(summary)):     # a whole record; a result alone, as a flow writes it
        (results / KEY).write_text(content)
        for key in (str(results / KEY), KEY):
            runner._flow_summary(SimpleNamespace(state=_state(key, "json")), "math500")
        assert not (tmp_path / "imported.txt").exists() and "planted_module" not in sys.modules
        assert prefect_results.read_result(_state(KEY, "json")) == summary      # the same dicts: data, not objects
        assert runner._flow_summary(SimpleNamespace(state=_state(KEY, "json")), "math500") == summary


def test_the_eval_flows_summary_is_read_back(results):
    """What the eval flow writes (its summary with the json serializer: a flow's file holds the result alone, its
    metadata is in the API's state) is what read_result reads, as a task's whole record would be."""
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.serializers import JSONSerializer

    summary = {"eval_key": "k", "new_mlflow_run": True, "metrics": {"accuracy": 0.25, "cache_hit_rate": 0.0}}
    record = ResultRecord(metadata=ResultRecordMetadata(storage_key=KEY, serializer=JSONSerializer()),
                          result=summary)
    for content in (record.serialize_result(), record.serialize()):
        (results / KEY).write_bytes(content)
        assert prefect_results.read_result(_state(KEY, "json")) == summary


def _prefect_objects() -> list[tuple[str, object]]:
    found = []
    for folder in ("flows", "tasks"):
        for path in sorted((ROOT / folder).glob("*.py")):
            module = importlib.import_module(f"{folder}.{path.stem}")
            found += [(f"{folder}/{path.name}:{name}", obj) for name, obj in vars(module).items()
                      if isinstance(obj, (Task, Flow)) and obj.__module__ == module.__name__]
    return found


def test_no_task_persists_or_looks_up_a_result_in_the_store():
    """A task with a cache policy reads the record at its cache key before it runs, through Prefect's reader; so no
    task has one, and no flow but the eval and select flows (their summaries, as JSON, which the CLI reads back with
    prefect_results.read_result as plain data) persists a result."""
    objects = _prefect_objects()
    assert {"tasks/resolve.py:resolve_task", "flows/eval_flow.py:eval_flow"} <= {name for name, _ in objects}
    for name, obj in objects:
        if isinstance(obj, Task):
            assert obj.persist_result is False and obj.cache_policy in (None, NO_CACHE), name
        elif name in ("flows/eval_flow.py:eval_flow", "flows/select_flow.py:select_flow"):
            assert obj.persist_result is True and obj.result_serializer == "json", name
        else:
            assert not obj.persist_result, name
