"""transformers engine: batched `generate` with left padding and length-sorted batches (bf16 on CPU by default).

Static batching runs each batch until its longest sequence stops, so prompts are sorted by token length to keep
padding low; batch composition is deterministic (it is part of the eval_key through batch_size and the shard plan)
because greedy outputs shift slightly with padding and batch size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import inspect
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evaldag.request.config import SamplingConfig
from evaldag.engines.base import Completion, EngineBase, batches_by_length, chat_text
from evaldag.engines.context import PromptFit, config_window


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks instead of returning them to the kernel after every decode step.

    Generation allocates and frees tens of MB per step (KV cache, activations). By default glibc serves such blocks
    with mmap and trims the heap on free, so every step pays page faults: half the CPU time went to the kernel in a
    MATH-500 shard. Measured: 8-12 % more tokens/s (bench/bench_generation.py).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-1, 1 << 30)       # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
        libc.mallopt(-3, 32 << 20)      # M_MMAP_THRESHOLD: its maximum; smaller blocks come from the heap
    except (OSError, AttributeError):   # not glibc (e.g. musl): nothing to tune
        pass


def vocabulary_fingerprint(tokenizer) -> int:
    """Identity of a tokenizer's vocabulary (token -> id), shared by every engine so KL between models run by
    different engines is allowed exactly when their vocabularies match. sha256 rather than hash(): str hashes are
    salted per process, and the value should mean the same in every process."""
    digest = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items()):
        digest.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest()[:8], "big")


class HFEngine(EngineBase):
    """Hugging Face transformers generation on CPU or a single GPU.

    The KV cache is "static" (preallocated for prompt + max_new_tokens): the default dynamic cache grows by
    concatenation at every step, which on CPU costs more than the attention over the padded static cache
    (docs/performance.md). n samples of a prompt share one prefill (_prefilled_once).
    """

    def __init__(self, model_path: str, dtype: str = "bfloat16", batch_size: int = 32,
                 cache_implementation: str | None = "static") -> None:
        _keep_freed_memory()
        if threads := os.environ.get("EVALDAG_TORCH_THREADS"):   # set by the stack for CPU slots sharing cores
            torch.set_num_threads(max(1, int(threads)))
        self.batch_size = batch_size
        self.cache_implementation = cache_implementation
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # the transformers engine runs no checkpoint's own code: say so, or transformers asks on stdin (under a
        # SIGALRM) for a checkpoint that has some (the vllm engine takes engine_args.trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          trust_remote_code=False)
        self.model.to(self.device).eval()
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        # Sample what the evaluation's SamplingConfig says, nothing else: transformers fills every setting a
        # generate() call leaves unset from the checkpoint's generation_config.json (its top_k, repetition
        # penalty, n-gram bans, minimum length, ...). Only the stop and padding tokens are kept from it.
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(bos_token_id=gen_cfg.bos_token_id,
                                                        eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)

    def _format(self, prompt: str) -> str:
        return chat_text(self.tokenizer, prompt)

    def plan_batches(self, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """Deterministic batches (indexes into `prompts`): sorted by token length, batch_size sequences each."""
        texts = [self._format(p) for p in prompts]
        # The chat template already holds the special tokens; adding them again would double the BOS.
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return batches_by_length(lengths, self.batch_size, sampling.n)

    def prompt_fit(self, prompts: list[str]) -> PromptFit | None:
        """The model's window (max_position_embeddings: transformers does not stop there, but positions past it
        were never trained) and each chat-formatted prompt's length; None when the config states no window."""
        window = config_window(self.model.config)
        if window is None:
            return None
        texts = [self._format(p) for p in prompts]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
        return PromptFit(window=window, source="max_position_embeddings in the model's config.json",
                         prompt_tokens=lengths)

    def generate_batch(self, prompts: list[str], sampling: SamplingConfig,
                       batch_index: int) -> list[list[Completion]]:
        """One batch of a plan_batches() plan; the seed depends on the batch's index, so a batch generated again
        (after a crash) gives the same completions as the first time."""
        return self._generate_batch([self._format(p) for p in prompts], sampling, seed=sampling.seed + batch_index)

    def _generate_batch(self, texts: list[str], sampling: SamplingConfig, seed: int) -> list[list[Completion]]:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        kwargs = dict(max_new_tokens=sampling.max_new_tokens, eos_token_id=sorted(self.eos_ids),
                      pad_token_id=self.pad_id)
        if sampling.temperature > 0:
            # top_k=0: no top-k cut (left unset, transformers would apply its default of 50)
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = (self._prefilled_once(enc, sampling.n, sampling.max_new_tokens) if sampling.n > 1
                      else dict(enc, cache_implementation=self.cache_implementation))
            torch.manual_seed(seed)     # after the prefill, which draws nothing: the samples depend on the seed alone
            out = self.model.generate(**inputs, **kwargs)
        latency = time.perf_counter() - t0
        prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        per_prompt: list[list[Completion]] = []
        for p, plen in enumerate(prompt_lens):
            comps = []
            for row in new[p * sampling.n:(p + 1) * sampling.n]:
                stop_at = next((k for k, t in enumerate(row) if t in self.eos_ids), None)
                kept = row[:stop_at + 1] if stop_at is not None else row
                comps.append(Completion(
                    text=self.tokenizer.decode(kept, skip_special_tokens=True),
                    token_ids=[int(t) for t in kept],
                    prompt_tokens=int(plen),
                    completion_tokens=len(kept),
                    finish_reason="stop" if stop_at is not None else "length",
                    latency_s=latency,
                    batch_size=len(texts),
                ))
            per_prompt.append(comps)
        return per_prompt

    def _prefilled_once(self, enc, n: int, max_new_tokens: int) -> dict:
        """`generate` inputs for n samples of each prompt of `enc`, each prompt having gone through the model once.

        transformers' `num_return_sequences` copies every prompt n times before the prefill, which then costs n
        times over, and prefill is most of a short sampled generation on CPU (docs/performance.md). Here every
        prompt but its last token is prefilled once and the cache is repeated n times; `generate` feeds the last
        token itself (it needs one uncached token per row). Positions count from each row's first real token, as
        `generate` counts them under left padding. The repeated cache is of the engine's kind (static or dynamic).
        """
        from transformers import DynamicCache, StaticCache

        ids, mask = enc["input_ids"], enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        prefix = DynamicCache(config=self.model.config)
        # the prefill's logits are not used: where the model allows it, none are computed beyond the last position
        # (all of them would take prompt length x vocabulary floats)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                   past_key_values=prefix, use_cache=True, **keep)
        if self.cache_implementation == "static":
            cache = StaticCache(config=self.model.config, max_cache_len=ids.shape[1] + max_new_tokens)
            for i, layer in enumerate(prefix.layers):
                cache.update(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), i)
        else:
            cache = prefix
            cache.batch_repeat_interleave(n)
        return dict(input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0),
                    past_key_values=cache)

    def score(self, prompts: list[str], completion_ids: list[list[int]],
              batch_size: int = 4) -> list[list[float]]:
        """Teacher-forced log-probabilities of `completion_ids` after each chat-formatted prompt.

        Right padding (positions need no shift); the log-softmax is taken only over the completion positions, in
        float32, so memory stays at one batch of bf16 logits.
        """
        out: list[list[float]] = []
        for lo in range(0, len(prompts), batch_size):
            c_ids = completion_ids[lo:lo + batch_size]
            for c, logits in zip(c_ids, self._completion_logits(prompts[lo:lo + batch_size], c_ids)):
                if not len(c):
                    out.append([])
                    continue
                logp = torch.log_softmax(logits.float(), dim=-1)
                target = torch.tensor(list(c), device=logp.device).unsqueeze(1)
                out.append(logp.gather(1, target).squeeze(1).tolist())
        return out

    def score_with_reference(self, prompts: list[str], completion_ids: list[list[int]], reference: "HFEngine",
                             batch_size: int = 4) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
        """Per completion token: its log-probability under this model and under `reference`, and the exact
        KL(this || reference) of the two next-token distributions over the whole vocabulary at that position
        (temperature 1, float32): sum_v p(v) (log p(v) - log q(v)).

        The exact KL needs both models' full logits at once, so both are loaded together (two models' memory);
        it assumes nothing about how the completions were decoded (see evaldag.scoring.kl)."""
        logp: list[list[float]] = []
        ref_logp: list[list[float]] = []
        kl: list[list[float]] = []
        for lo in range(0, len(prompts), batch_size):
            c_ids = completion_ids[lo:lo + batch_size]
            mine = self._completion_logits(prompts[lo:lo + batch_size], c_ids)
            theirs = reference._completion_logits(prompts[lo:lo + batch_size], c_ids)
            for c, a, b in zip(c_ids, mine, theirs):
                if not len(c):
                    for out in (logp, ref_logp, kl):
                        out.append([])
                    continue
                if a.shape[-1] != b.shape[-1]:
                    from evaldag.errors import ConfigError

                    raise ConfigError(f"the reference model has {b.shape[-1]} logits per position, the evaluated "
                                      f"model {a.shape[-1]}: exact KL needs one vocabulary")
                # one completion at a time in float32: memory stays at one batch of bf16 logits per model
                lp = torch.log_softmax(a.float(), dim=-1)
                lq = torch.log_softmax(b.float().to(lp.device), dim=-1)
                target = torch.tensor(list(c), device=lp.device).unsqueeze(1)
                logp.append(lp.gather(1, target).squeeze(1).tolist())
                ref_logp.append(lq.gather(1, target).squeeze(1).tolist())
                # clamp: rounding can leave a last-ulp negative where the two distributions are equal
                kl.append((lp.exp() * (lp - lq)).sum(dim=-1).clamp(min=0.0).tolist())
        return logp, ref_logp, kl

    def _completion_logits(self, prompts: list[str], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """For each completion, the logits that predict each of its tokens (tokens x vocab, the model's dtype),
        teacher-forced after the chat-formatted prompt; right padding (positions need no shift)."""
        texts = [self._format(p) for p in prompts]
        p_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = [p + list(c) for p, c in zip(p_ids, completion_ids)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        # the token at position t is predicted by the logits at t - 1
        return [logits[i, len(p) - 1:len(p) - 1 + len(c)] for i, (p, c) in enumerate(zip(p_ids, completion_ids))]

    def vocabulary_fingerprint(self) -> int:
        """Cheap identity of the tokenizer, to refuse KL between models that do not share one."""
        return vocabulary_fingerprint(self.tokenizer)

    def close(self) -> None:
        """Free the model (a shard process exits anyway; this matters for in-process use)."""
        del self.model
