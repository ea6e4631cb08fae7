"""The work over files: the per-shard stages and the reduce (stages), the result store (store), the per-sample
table (schema), live progress and time left, fault injection for drills."""
