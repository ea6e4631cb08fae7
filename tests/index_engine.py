"""A stand-in for vLLM's per-request generation whose answers depend on the sample index (a named fake for stage
tests; the real engine runs the same paths in tests/engine_vllm): sample k of a request seeded
`request_seed(seed, sample id) + first` is sample index first + k, as vLLM seeds them. Subclasses say what sample
`index` of a prompt answers."""

from __future__ import annotations

from evaldag.engines.base import Completion, Finished, Running, request_seed


class ByIndexEngine:
    base: dict = {}       # prompt -> request_seed(seed, sample id)
    gold: dict = {}       # prompt -> gold
    generated: list = []  # (prompt, sample index) of every sample drawn

    @classmethod
    def learn(cls, plan) -> None:
        """The seeds and golds of the plan's problems; forgets what was generated before."""
        rows = plan.inputs()
        prompts, ids = rows["prompt"].to_list(), rows["sample_id"].to_list()
        cls.base = {p: request_seed(plan.sampling.seed, s) for p, s in zip(prompts, ids)}
        cls.gold = dict(zip(prompts, rows["gold"].to_list()))
        cls.generated = []

    def answer(self, prompt: str, index: int) -> str:
        raise NotImplementedError

    def generate_requests(self, requests, sampling, max_in_flight=None):
        for r in requests:
            yield Running(tokens=0, counts=())
            comps = []
            for k in range(r.n or sampling.n):
                index = r.seed + k - type(self).base[r.prompt]
                type(self).generated.append((r.prompt, index))
                comps.append(Completion(text=f"\\boxed{{{self.answer(r.prompt, index)}}}", token_ids=[1, 2],
                                        prompt_tokens=5, completion_tokens=2, finish_reason="stop", latency_s=0.01,
                                        batch_size=len(requests)))
            yield Finished(r.key, comps)

    def close(self) -> None:
        pass
