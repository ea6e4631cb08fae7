"""A retry of an evaluation that an earlier attempt decided (evaldag.decisions.decide): the earlier attempt saved its
decision and died before it wrote the stop file, so its shards, on other hosts, went on generating to the end. The
retry, which finds the decision and starts no shard of its own, asks them to stop."""

from __future__ import annotations

from conftest import complete_checkpoint
from evaldag.decisions.decide import Decision, stop_path, stop_requested
from evaldag.request.plan import EvalRequest, resolve
from tasks.decide import deciders_for


def test_a_retry_that_finds_a_saved_decision_writes_the_stop_file(configs, tmp_path):
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=2, decide="vs_best"),
                   tmp_path / "results")
    order = plan.sample_ids()
    saved = Decision("stopped", "better", "job@10", problems=4, n_problems=8, pairs=4, prefix=order[:4])
    saved.save(plan)                      # the first attempt's last act before it died
    assert not stop_requested(plan)       # its shards still generate
    path = str(plan.path("plan.json"))

    deciders, known = deciders_for([path], [plan])
    assert deciders == {} and known[path].stopped and known[path].problems == 4
    assert stop_requested(plan)           # the first attempt's shards stop at their next look
    assert '"problems": 4' in stop_path(plan).read_text()
