"""Checkpoint events: what a trainer's event says and where its checkpoints are (checkpoint_event), and what
it starts under which identity (identity)."""
