"""What the stack commands print: the services `evaldag up` (or a node's `evaldag worker`) started, kept and
stopped, where the UIs are, and how to point a shell or a GPU node at the stack."""

from __future__ import annotations

from evaldag.errors import redact_url


def print_changes(console, report, markup: bool | None = None) -> None:
    """The services a stack's `up` started, kept and stopped (`markup`: as rich's console.print takes it)."""
    for what, names in (("started", report.started), ("already running", report.kept),
                        ("stopped (no longer configured)", report.stopped)):
        if names:
            console.print(f"{what}: {', '.join(names)}", markup=markup)


def print_up(console, stack, report) -> None:
    """What `evaldag up` did, where the UIs are, and the environment that points clients at the stack."""
    print_changes(console, report)
    if report.deployed:
        console.print(f"deployed {stack.deployments_file.relative_to(stack.deployments_file.parents[1])}")
    console.print(f"[green]stack is up[/] ({report.elapsed_s:.1f} s, state in {stack.home})")
    console.print(f"  Prefect UI: {stack.prefect_url}")
    console.print(f"  MLflow UI:  {redact_url(stack.mlflow_url)}")
    st = stack.settings
    pins = " | ".join(",".join(ids) if ids is not None else "unpinned" for ids in st.gpu_assignment)
    console.print(f"  gpu pool:   {st.num_gpu_workers} worker(s) x {st.tp} GPU(s) [{pins or 'none'}], concurrency "
                  f"limit evaldag-gpus = {st.num_gpus}", markup=False)
    if st.postgres or st.database_url:
        db = f"private PostgreSQL in {stack.postgres_dir}" if st.postgres else "as given by --database-url"
        console.print(f"  database:   {db}", markup=False)
    if st.for_nodes:
        auth = ' --auth "$EVALDAG_API_AUTH"' if stack.client_auth_env() else ""
        console.print(f"  join a GPU node: evaldag worker --server http://{st.public_host}:{st.prefect_port}{auth} "
                      "--gpus N", markup=False)
    console.print("To use it from this shell:")
    for line in stack.env_lines(secrets=False):   # a password printed here would stay in logs and scrollback
        console.print(f"  {line}", markup=False)
    if stack.client_auth_env():
        console.print('  (the servers require the API auth: eval "$(evaldag env)" exports it too)', markup=False)


def print_joined(console, stack, report) -> None:
    """What `evaldag worker` did: the node's workers and GPUs, and the head's services it uses."""
    print_changes(console, report, markup=False)
    st = stack.settings
    pins = " | ".join(",".join(ids) if ids is not None else "unpinned" for ids in st.gpu_assignment)
    console.print(f"[green]node {st.node_name} joined {st.server}[/] ({report.elapsed_s:.1f} s, state in "
                  f"{stack.home})")
    console.print(f"  gpu workers: {st.num_gpu_workers} x {st.tp} GPU(s) [{pins}]", markup=False)
    console.print(f"  MLflow:      {redact_url(stack.mlflow_url)}", markup=False)
