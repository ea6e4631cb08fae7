"""Everything that needs Prefect or processes, around the core (the rest of evaldag, plain Python without a server):
the local stack (`stack`: servers, workers, their processes, PostgreSQL's cluster in `postgres`), how a flow run
starts (`flow_run_launcher`), the cluster join (`cluster`, `node_clock`), the names flows and deployments run
under (`deployments`), a flow run's liveness (`liveness`) and relaunch rules (`relaunch`),
Prefect's persisted results (`prefect_results`), and `evaldag run` (`runner`)."""
