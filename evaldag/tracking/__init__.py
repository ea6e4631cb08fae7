"""evaldag's MLflow tracking, one module per job (import a name from its module; this package re-exports nothing):

names    what MLflow objects are called: experiment names, metric keys, tags, links into the MLflow UI
client   the MLflow client, made (and its 2-3 s of imports paid) only where it is used; preload
write    the track stage: one evaluation's MLflow run, claimed and written by one writer, and the job's parent run
history  a training job's history read back: evaluated checkpoints, the per-step table, its diagnostics and plot
sync     `evaldag sync`: log the finished evaluations of the result store that MLflow lacks
samples  a logged run's per-sample table, downloaded back
"""
