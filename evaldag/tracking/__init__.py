"""evaldag's MLflow tracking, one module per job (import a name from its module; this package re-exports nothing):

names    what MLflow objects are called: experiment names, metric keys, tags, links into the MLflow UI
client   the MLflow client, made (and its 2-3 s of imports paid) only where it is used; preload
write    the track stage: one evaluation's MLflow run, claimed and written by one writer, and the job's parent run
history  a training job's history read back: evaluated checkpoints, the per-step table, its diagnostics and plot
sync     `evaldag sync`: log the finished evaluations of the result store that MLflow lacks
samples  a logged run's per-sample table, downloaded back
incumbent  the job's best evaluation so far, what `decide` compares with
run_claims atomic get-or-create of an evaluation's run and its writer lease, across processes and hosts
compare  `evaldag compare`: checkpoints side by side across benchmarks, with forecasts and flags
report   human-readable summaries (Prefect artifacts, CLI output)
"""
