"""Sizing to the work and the kept engine: an engine is loaded for a Workload (the longest sequence, the most
sequences, greedy or not), vLLM turns it into its window, KV cache and speculation, a kept engine serves every later
workload it covers, and a keep_loaded block sized for all its evaluations loads once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from evaldag import engines
from evaldag.request.config import SamplingConfig
from evaldag.engines import Workload
from evaldag.engines.vllm_args import ModelShape, fit_to_workload, fitted_kv_bytes, fitted_max_model_len, model_shape
from evaldag.errors import ConfigError
from evaldag.request.checkpoint import resolve_model

MiB, GiB = 2**20, 2**30


def _model(engine: str):
    return replace(resolve_model("smollm2-135m-instruct"), engine=engine)


@pytest.mark.parametrize("need, window, fit", [
    (1, 8192, 256), (256, 8192, 256), (257, 8192, 512), (1190, 8192, 1280),
    (8000, 8192, None),         # rounded up it would not be smaller than the window: vLLM's default
    (9000, 8192, None),         # longer than the window: cut at the window, as without sizing
    (1000, None, None),         # window unknown: vLLM decides
])
def test_fitted_max_model_len(need, window, fit):
    assert fitted_max_model_len(need, window) == fit


def test_fitted_max_model_len_refuses_nonsense():
    with pytest.raises(ValueError, match="context_tokens"):
        fitted_max_model_len(0, 8192)


def test_the_workload_is_the_longest_formatted_prompt_plus_the_completion_and_every_sample():
    from transformers import AutoTokenizer

    from evaldag.engines.base import chat_text

    model = _model("vllm")
    tok = AutoTokenizer.from_pretrained(model.path)
    prompts = ["Say OK.", "What is 2+3? " * 40]
    longest = len(tok(chat_text(tok, prompts[1]), add_special_tokens=False)["input_ids"])
    assert longest > 100
    greedy = SamplingConfig(max_new_tokens=512)
    assert engines.workload(model, prompts, greedy) == Workload(longest + 512, 2, True)
    sampled = SamplingConfig(max_new_tokens=100, temperature=0.7, n=4)
    assert engines.workload(model, prompts, sampled) == Workload(longest + 100, 8, False)
    assert engines.workload(model, [], greedy) is None
    # the transformers engine pads per batch: nothing to size
    assert engines.workload(_model("hf"), prompts, greedy) is None


def test_engine_args_may_not_set_what_evaldag_sets():
    with pytest.raises(ConfigError, match="workload"):
        engines.load_engine("vllm", "/nowhere", "float32", 4, {"workload": 10})


def test_a_workload_covers_both_and_is_served_only_by_what_serves_it_as_well():
    small, long_ = Workload(800, 4, True), Workload(1200, 2, True)
    both = small.covering(long_)
    assert both == Workload(1200, 4, True) and small.covering(None) == small
    assert small.served_by(both) and long_.served_by(both) and small.served_by(None)
    assert not both.served_by(small)                               # too short
    assert not Workload(800, 64, True).served_by(small)            # room for 4 sequences, not 64
    sampled = Workload(800, 4, False)
    assert not sampled.served_by(small)     # a greedy load may speculate: it would change the samples
    assert small.served_by(sampled) and small.covering(sampled).greedy is False
    with pytest.raises(ValueError, match="sequences"):
        Workload(800, 0, True)


def test_the_model_shape_is_read_from_its_config():
    path = resolve_model("smollm2-135m-instruct").path
    # SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x 64 dims
    assert model_shape(path, "float32") == ModelShape(8192, 30 * 2 * 3 * 64 * 4)
    assert model_shape(path, "bfloat16").kv_bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert model_shape("/nowhere", "float32") == ModelShape(None, None)


SHAPE = ModelShape(8192, 46080)


def test_the_cpu_kv_cache_holds_every_sequence_at_full_length_and_at_most_the_default():
    # a 4-problem slice: 4 x 1024 tokens x 45 KiB x 1.1 = 198 MiB -> 256 MiB
    assert fitted_kv_bytes(Workload(1000, 4, True), 1024, 46080) == 256 * MiB
    assert fitted_kv_bytes(Workload(1000, 500, True), 1024, 46080) == 2 * GiB


def test_a_greedy_cpu_workload_gets_a_fitted_window_and_cache_and_speculation(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = fit_to_workload({"enforce_eager": True}, Workload(1000, 4, True), SHAPE, on_cpu=True)
    assert args == {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": 256 * MiB,
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 4}}


@pytest.mark.parametrize("workload, args, on_cpu, speculates", [
    (Workload(1000, 4, False), {}, True, False),          # sampled: speculation would change the samples
    (Workload(1000, 128, True), {}, True, True),
    (Workload(1000, 500, True), {}, True, False),         # a full batch on CPU: 0.89x
    (Workload(1000, 500, True), {"speculative_ngram": True}, True, True),
    (Workload(1000, 4, True), {}, False, False),          # GPU: not measured, off unless asked
    (Workload(1000, 500, True), {"speculative_ngram": True}, False, True),
    (Workload(1000, 4, True), {"speculative_ngram": False}, True, False),
    (Workload(1000, 4, False), {"speculative_ngram": True}, True, False),   # never under sampling
    (None, {"speculative_ngram": True}, True, False),     # loaded for anything (scoring)
])
def test_speculation_only_where_it_is_lossless_and_wins(monkeypatch, workload, args, on_cpu, speculates):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    out = fit_to_workload(args, workload, SHAPE, on_cpu)
    assert ("speculative_config" in out) is speculates and "speculative_ngram" not in out


def test_what_the_user_set_wins_over_the_fitted_sizes(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    small = Workload(1000, 4, True)
    out = fit_to_workload({"max_model_len": 4096, "kv_cache_space_gb": 1.5}, small, SHAPE, on_cpu=True)
    assert out["max_model_len"] == 4096 and out["kv_cache_memory_bytes"] == int(1.5 * GiB)
    # no workload: the default cache; unknown shape: the default cache and vLLM's own window
    assert fit_to_workload({}, None, SHAPE, on_cpu=True) == {"kv_cache_memory_bytes": 2 * GiB,
                                                             "enable_chunked_prefill": False}
    assert fit_to_workload({"speculative_ngram": False}, small, ModelShape(None, None), on_cpu=True) == {
        "kv_cache_memory_bytes": 2 * GiB}
    # the CPU build's own variable is the user's setting too; a GPU's cache is gpu_memory_utilization's
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert "kv_cache_memory_bytes" not in fit_to_workload({}, small, SHAPE, on_cpu=True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert "kv_cache_memory_bytes" not in fit_to_workload({}, small, SHAPE, on_cpu=False)


@pytest.mark.parametrize("workload, on_cpu, whole", [
    (Workload(1000, 4, False), True, True),       # sampled on CPU: a split prefill would kill the engine
    (None, True, True),                           # loaded for anything: it may get sampled requests
    (Workload(1000, 4, True), True, False),       # greedy: no generator to rewind, chunked prefill stays
    (Workload(1000, 4, False), False, False),     # GPU: CUDA generators rewind
])
def test_sampled_prompts_on_cpu_are_prefilled_whole(monkeypatch, workload, on_cpu, whole):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    out = fit_to_workload({}, workload, SHAPE, on_cpu)
    assert (out.get("enable_chunked_prefill") is False) is whole


def test_a_step_budget_below_the_window_is_refused_for_whole_prefills():
    with pytest.raises(ConfigError, match="max_num_batched_tokens=1024 is below max_model_len=2048"):
        fit_to_workload({"max_model_len": 2048, "max_num_batched_tokens": 1024}, Workload(1000, 4, False), SHAPE,
                        on_cpu=True)
    # enough, or greedy (chunked prefill kept): accepted
    fit_to_workload({"max_model_len": 2048, "max_num_batched_tokens": 2048}, Workload(1000, 4, False), SHAPE, True)
    fit_to_workload({"max_model_len": 2048, "max_num_batched_tokens": 1024}, Workload(1000, 4, True), SHAPE, True)


@dataclass
class _Recorder:
    """Stands in for load_engine: records each load's context (the real loads are counted in
    tests/engine_vllm/test_vllm_e2e.py)."""

    loads: list = field(default_factory=list)
    workloads: list = field(default_factory=list)
    closed: int = 0

    def __call__(self, name, path, dtype, batch_size, engine_args, workload=None):
        self.loads.append(workload.context_tokens if workload else None)
        self.workloads.append(workload)
        recorder = self

        class _Engine:
            def close(self):
                recorder.closed += 1
        return _Engine()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(engines, "load_engine", rec)
    return rec


def _greedy(context: int, sequences: int = 4) -> Workload:
    return Workload(context, sequences, True)


def test_a_kept_engine_serves_what_fits_and_reloads_for_what_does_not(recorder):
    model = _model("vllm")
    with engines.keep_loaded():
        with engines.engine_for(model, _greedy(1000)) as a:
            assert a.loaded
        with engines.engine_for(model, _greedy(800)) as b:
            assert not b.loaded and b.engine is a.engine
        with engines.engine_for(model, _greedy(1500)) as c:        # longer than it was loaded for: a new load
            assert c.loaded
        with engines.engine_for(model, Workload(900, 4, False)) as d:     # sampled after greedy: a new load
            assert d.loaded
        assert recorder.closed == 2
    assert recorder.loads == [1000, 1500, 900] and recorder.closed == 3


def test_a_block_sized_for_all_its_evaluations_loads_once(recorder):
    model = _model("vllm")
    together = Workload(1500, 64, False)
    with engines.keep_loaded(together):
        for need in (_greedy(1000), Workload(1500, 64, False), _greedy(700, 8)):
            with engines.engine_for(model, need):
                pass
    assert recorder.workloads == [together] and recorder.closed == 1


def test_outside_a_block_each_engine_is_closed_after_use(recorder):
    model = _model("vllm")
    for need in (1000, 1000):
        with engines.engine_for(model, _greedy(need)) as got:
            assert got.loaded
    assert recorder.loads == [1000, 1000] and recorder.closed == 2
