"""The work of one evaluation over files, stage by stage: generate (generate; a shard's runs on an engine in
shard_runs, its chunks in chunks), score against a reference (score), grade (grade) and reduce (reduce), with what
the stages record (records), a shard's live progress and time left, and fault injection for drills (faults)."""
