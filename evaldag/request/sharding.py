"""How an evaluation's problems are cut into shards: how many shards (shard_count), which problems each holds
(whole problems dealt longest prompt first, or every problem's samples split over the shards where the engine seeds
samples one by one), and the pieces in which a shard hands a problem's samples to the engine (sample_pieces)."""

from __future__ import annotations

import polars as pl

from evaldag.errors import ConfigError


# A shard pays a fixed cost before its first token (process start, imports, engine init; docs/performance.md), so a
# shard smaller than this costs more than it saves.
MIN_SEQUENCES_PER_SHARD = 32


def shard_count(n_problems: int, slots: int, requested: int | None = None, configured: int | None = None,
                samples_per_problem: int = 1, split_samples: bool = False) -> int:
    """How many shards an evaluation of `n_problems` (each sampled `samples_per_problem` times) gets.

    An explicit count (the request's, else the benchmark config's) is honoured, capped by the problems (by the
    sequences with `split_samples`). Otherwise:
    no more shards than `slots` (gpu slots that can run shards at once: more shards would only queue behind each
    other, each paying its own start-up) or problems, and none with fewer than MIN_SEQUENCES_PER_SHARD sequences
    (problems x samples: a 4-problem greedy slice is one shard, while AIME24's 30 problems x 32 samples spread over 8
    slots instead of queueing on one). With `split_samples` (plan_split_shards) a shard need not hold a whole
    problem, so the problems do not cap the count. Resume stays sample-level whatever the count.
    """
    if n_problems < 1:
        raise ConfigError("no problems to evaluate")
    if slots < 1:
        raise ConfigError(f"slots must be >= 1, got {slots}")
    sequences = n_problems * max(1, samples_per_problem)
    units = sequences if split_samples else n_problems      # the most shards that each hold something
    if requested or configured:
        return min(requested or configured, units)
    return max(1, min(slots, units, sequences // MIN_SEQUENCES_PER_SHARD))


def ranked_ids(inputs: pl.DataFrame) -> list[str]:
    """Sample ids longest prompt first (ties in input order): a fixed order to deal from."""
    return (inputs.with_row_index("_pos")
            .with_columns(_len=pl.col("prompt").str.len_chars())
            .sort(["_len", "_pos"], descending=[True, False]))["sample_id"].to_list()


def plan_shards(inputs: pl.DataFrame, num_shards: int) -> list[list[str]]:
    """Deterministic shards balanced by prompt length: longest first, dealt round-robin."""
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    for i, sid in enumerate(ranked_ids(inputs)):
        shards[i % num_shards].append(sid)
    return [s for s in shards if s]


def splits_samples(engine: str, n: int) -> bool:
    """Whether a plan splits problems' samples over its shards (when it has several): only with n > 1 samples and an
    engine whose samples are seeded one by one, so that samples a..b generated alone equal samples a..b of the
    whole request (vLLM seeds sample j of a request `seed + j`; the transformers engine samples a prompt's n rows
    from one generator, and a served model is asked one batch at a time)."""
    return engine == "vllm" and n > 1


# A shard hands its problems' samples to the engine in up to this many rounds (sample_pieces): every problem's
# first piece, then every problem's second, and so on. The finished samples are then a fair sample of all the
# shard's problems from the first minutes on, which is what its forecast of the end reads
# (evaldag.pipeline.time_left); whole problems one after another leave the problems not started yet unseen until
# late, the forecast's largest error at scale (docs/performance.md). Each sample of a piece goes in as a request of
# its own (so its length is heard as it ends, not when its siblings do), next to the piece's others (so the prompt's
# cached prefill is reused).
SAMPLE_ROUNDS = 8


def sample_pieces(runs: list[tuple[int, int]], rounds: int = SAMPLE_ROUNDS) -> list[tuple[int, int, int, int]]:
    """Cut each problem's run of samples (first sample index, count; EvalPlan.shard_runs) into at most `rounds`
    near-equal pieces of consecutive samples: (problem's position in `runs`, first sample index, count, round),
    problem by problem. Hand them to the engine round by round. Only for an engine that seeds each sample alone
    (splits_samples), where samples a..b generated as one request equal those samples of the whole request."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    pieces = []
    for i, (first, count) in enumerate(runs):
        size = max(1, -(-count // rounds))
        pieces.extend((i, lo, min(size, first + count - lo), r)
                      for r, lo in enumerate(range(first, first + count, size)))
    return pieces


def plan_split_shards(inputs: pl.DataFrame, num_shards: int,
                      n: int) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """Shards that share every problem: its n samples cut into min(n, num_shards) near-equal runs, run j of the i-th
    problem (longest prompt first) to shard (i + j) mod num_shards, so each shard holds about n / num_shards samples
    of every problem. A hard problem's long samples then land on every shard instead of one, which is what leaves
    whole-problem shards unbalanced at scale (bench/bench_schedule.py: AIME24 x 32 on 8 slots, 1.32x the lower
    bound against 1.64x). Returns the sample ids per shard and, beside each, its run (first sample index, count)."""
    runs_per_problem = min(n, num_shards)
    size, extra = divmod(n, runs_per_problem)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    runs: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    for i, sid in enumerate(ranked_ids(inputs)):
        first = 0
        for j in range(runs_per_problem):
            count = size + (j < extra)
            shards[(i + j) % num_shards].append(sid)
            runs[(i + j) % num_shards].append((first, count))
            first += count
    kept = [s for s in range(num_shards) if shards[s]]
    return [shards[s] for s in kept], [runs[s] for s in kept]
