"""The work of one evaluation over files: the per-shard stages (generate, grade) and the reduce (stages), a shard's
live progress and time left, and fault injection for drills (faults)."""
