"""Files: the result store (one fsspec URL for every evaluation's files) and the versioned per-sample table that
every stage reads and writes."""
