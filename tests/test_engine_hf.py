"""The transformers engine on the real default model: token counts, finish reasons, order, seeded sampling; and its
argument checks, which refuse bad input before any model loads (no `model` mark)."""

from __future__ import annotations

import pytest

from evaldag.request.config import SamplingConfig
from evaldag.engines import load_engine
from evaldag.errors import ConfigError
from evaldag.request.checkpoint import resolve_model


@pytest.fixture(scope="module")
def engine():
    model = resolve_model("smollm2-135m-instruct")
    eng = load_engine("hf", model.path, "bfloat16", batch_size=2)
    yield eng
    eng.close()


PROMPTS = ["What is 2+3? Put the final answer in \\boxed{}.",
           "Write a very long essay about the history of mathematics, with many details.",
           "Say OK."]


@pytest.mark.model
def test_greedy_shapes_order_and_finish_reasons(engine):
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12))
    assert [len(c) for c in out] == [1, 1, 1]
    comps = [c[0] for c in out]
    assert all(0 < c.completion_tokens <= 12 for c in comps)
    assert comps[1].finish_reason == "length" and comps[1].completion_tokens == 12     # the essay cannot fit
    assert all(c.finish_reason in ("stop", "length") for c in comps)
    assert all(c.text.strip() for c in comps)
    assert comps[0].prompt_tokens > 10
    # batch of 2 over 3 prompts: batches are formed by length, results come back in input order
    again = engine.generate(list(reversed(PROMPTS)), SamplingConfig(max_new_tokens=12))
    assert [c[0].text for c in reversed(again)] == [c.text for c in comps]


@pytest.mark.model
def test_sampling_n_is_seeded(engine):
    s = SamplingConfig(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=7)
    a = engine.generate(PROMPTS[:1], s)
    b = engine.generate(PROMPTS[:1], s)
    assert len(a[0]) == 3
    assert [c.text for c in a[0]] == [c.text for c in b[0]]
    other = engine.generate(PROMPTS[:1], s.model_copy(update={"seed": 8}))
    assert [c.text for c in other[0]] != [c.text for c in a[0]]


@pytest.mark.model
def test_n_samples_share_one_prefill(engine, monkeypatch):
    """n > 1: each prompt goes through the model once, not n times as `num_return_sequences` does."""
    s = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    shapes = []
    real_forward = engine.model.forward

    def recording(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", recording)
    out = engine.generate_batch(PROMPTS[:2], s, batch_index=0)
    assert shapes[0][0] == 2 and shapes[0][1] > 10, shapes                 # the prefill: 2 prompts, once each
    assert all(rows == 6 and width == 1 for rows, width in shapes[1:]), shapes   # then 2 x n rows, a token a step
    assert [len(c) for c in out] == [3, 3]
    assert len({tuple(c.token_ids) for c in out[0]}) > 1                  # n samples, not one copied


@pytest.mark.model
def test_a_shared_prefill_gives_the_distributions_of_n_copies():
    """The next-token distributions after a prefill shared by n samples are those of n copies of the prompt
    (transformers' own path), step after step while the sampled tokens agree; a left-padded prompt included
    (its positions must count from its first real token). float32, so that the comparison can be tight."""
    import torch

    eng = load_engine("hf", resolve_model("smollm2-135m-instruct").path, "float32", batch_size=2)
    try:
        enc = eng.tokenizer([eng._format(p) for p in PROMPTS[:2]], return_tensors="pt", padding=True,
                            add_special_tokens=False)
        assert (enc["attention_mask"] == 0).any()                         # one row is padded
        kwargs = dict(max_new_tokens=6, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                      eos_token_id=sorted(eng.eos_ids), pad_token_id=eng.pad_id, return_dict_in_generate=True,
                      output_logits=True)
        with torch.inference_mode():
            torch.manual_seed(5)
            copies = eng.model.generate(**enc, num_return_sequences=3, cache_implementation="static", **kwargs)
            shared_inputs = eng._prefilled_once(enc, 3, 6)
            torch.manual_seed(5)
            shared = eng.model.generate(**shared_inputs, **kwargs)
    finally:
        eng.close()
    width = enc["input_ids"].shape[1]
    compared = 0
    for row in range(6):
        for step, (a, b) in enumerate(zip(copies.logits, shared.logits)):
            assert torch.allclose(a[row], b[row], atol=1e-3, rtol=1e-4), (row, step, (a[row] - b[row]).abs().max())
            compared += 1
            if copies.sequences[row, width + step] != shared.sequences[row, width + step]:
                break                                                     # the rows' histories part here
    assert compared >= 6 * 3


def test_unknown_engine_is_named():
    with pytest.raises(ConfigError, match="unknown engine 'vllm2'"):
        load_engine("vllm2", "/x", "bfloat16", 1)


def test_unknown_engine_arg_is_named():
    # checked against the engine's constructor before the model loads
    with pytest.raises(ConfigError, match=r"engine 'hf' does not take engine_args \['tensor_parallel_size'\]; "
                                          r"allowed: cache_implementation"):
        load_engine("hf", "/x", "bfloat16", 1, {"tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="engine_args must be a mapping"):
        load_engine("hf", "/x", "bfloat16", 1, ["tensor_parallel_size"])


@pytest.fixture(scope="module")
def perturbed_reference(tmp_path_factory):
    """The default model with its final norm scaled by 1.3: same tokenizer, sharper next-token distributions."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    src = resolve_model("smollm2-135m-instruct").path
    out = tmp_path_factory.mktemp("perturbed")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.3)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{src}/{name}", out / name)
    return out


@pytest.mark.model
def test_exact_kl_along_the_generated_path(perturbed_reference):
    """score_with_reference gives, per generated position, the exact KL over the whole vocabulary between the two
    models' next-token distributions: checked against a direct computation from both models' full logits, one
    sequence at a time (float32, so that batching and padding change nothing beyond rounding)."""
    import torch

    engine = load_engine("hf", resolve_model("smollm2-135m-instruct").path, "float32", batch_size=2)
    perturbed_reference = load_engine("hf", str(perturbed_reference), "float32", batch_size=2)
    comps = engine.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=8))       # greedy
    ids = [c[0].token_ids for c in comps]
    logp, ref_logp, kl = engine.score_with_reference(PROMPTS[:2], ids, perturbed_reference)
    assert [len(x) for x in kl] == [len(i) for i in ids] == [len(x) for x in logp] == [len(x) for x in ref_logp]
    assert logp == engine.score(PROMPTS[:2], ids) and ref_logp == perturbed_reference.score(PROMPTS[:2], ids)
    for k, (prompt, c) in enumerate(zip(PROMPTS[:2], ids)):
        text = engine._format(prompt)
        p_ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        full = torch.tensor([p_ids + c])
        with torch.inference_mode():
            lp = torch.log_softmax(engine.model(input_ids=full).logits[0, len(p_ids) - 1:-1].float(), -1)
            lq = torch.log_softmax(perturbed_reference.model(input_ids=full).logits[0, len(p_ids) - 1:-1].float(), -1)
        expected = (lp.exp() * (lp - lq)).sum(-1)
        assert kl[k] == pytest.approx(expected.tolist(), rel=1e-3, abs=1e-6)
    flat = [v for x in kl for v in x]
    assert min(flat) >= 0.0 and max(flat) > 1e-3                       # a different model: KL > 0
    _, _, self_kl = engine.score_with_reference(PROMPTS[:2], ids, engine)
    assert all(v == 0.0 for x in self_kl for v in x)                    # a model against itself: exactly 0
    engine.close()
    perturbed_reference.close()


@pytest.fixture(scope="module")
def opinionated_checkpoint(tmp_path_factory):
    """The default model whose generation_config.json asks for its own sampling: top-k 1, a repetition penalty, no
    repeated bigrams, a minimum length, its own temperature and top-p (real checkpoints ship such files)."""
    import json
    import os
    import shutil
    from pathlib import Path

    src = Path(resolve_model("smollm2-135m-instruct").path)
    out = tmp_path_factory.mktemp("opinionated")
    for f in src.iterdir():
        if f.name != "generation_config.json":
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copy(f, out / f.name)
    cfg = json.loads((src / "generation_config.json").read_text())
    cfg.update(do_sample=True, top_k=1, repetition_penalty=5.0, no_repeat_ngram_size=2, min_new_tokens=6,
               temperature=0.1, top_p=0.5)
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.model
def test_greedy_ignores_the_checkpoints_sampling_settings(engine, opinionated_checkpoint):
    """Greedy means the argmax of the model's own logits: a checkpoint's repetition penalty or n-gram ban must not
    change it."""
    other = load_engine("hf", str(opinionated_checkpoint), "bfloat16", batch_size=2)
    try:
        cfg = SamplingConfig(max_new_tokens=24)
        assert [c[0].text for c in other.generate(PROMPTS, cfg)] == [c[0].text for c in engine.generate(PROMPTS, cfg)]
    finally:
        other.close()


@pytest.mark.model
def test_sampling_draws_from_exactly_the_configured_distribution(opinionated_checkpoint, monkeypatch):
    """At every step the sampler draws from softmax(logits / temperature) of the model's raw logits (top_p 1): no
    top-k (neither the checkpoint's 1 nor transformers' default 50), no penalty, no minimum length."""
    import torch

    eng = load_engine("hf", str(opinionated_checkpoint), "float32", batch_size=2)
    logits, drawn = [], []
    hook = eng.model.register_forward_hook(lambda mod, args, out: logits.append(out.logits[:, -1].float().clone()))
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: drawn.append(probs.clone()) or real(probs, *a, **k))
    try:
        eng.generate(PROMPTS[:1], SamplingConfig(n=2, temperature=0.7, max_new_tokens=6, seed=3))
    finally:
        hook.remove()
        eng.close()
    # the first forward is the prefill the n samples share (HFEngine._prefilled_once): it draws nothing
    assert len(drawn) == len(logits) - 1 >= 2
    for raw, probs in zip(logits[1:], drawn):
        assert torch.allclose(probs, torch.softmax(raw / 0.7, dim=-1), atol=1e-6)
        assert int((probs > 0).sum(dim=-1).min()) > 1000                 # the whole vocabulary, not a top-k
