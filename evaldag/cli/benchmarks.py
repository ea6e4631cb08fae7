"""`evaldag benchmarks`: list the configured benchmarks, or check one config and every row of its data."""

from __future__ import annotations

from typing import Annotated

import typer

from evaldag.errors import EvalDagError

benchmarks_app = typer.Typer(help="The configured benchmarks: list them, or check a config and its data.",
                              invoke_without_command=True, no_args_is_help=False)


@benchmarks_app.callback()
def benchmarks_list(ctx: typer.Context) -> None:
    """List the configured benchmarks (built-in, and those in $EVALDAG_CONFIGS_DIR/benchmarks) and where each is
    from; `evaldag benchmarks check FILE` checks one."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console
    from rich.table import Table

    from evaldag.request.config import config_origins, load_benchmark

    from evaldag import paths

    table = Table(title="benchmarks (evaldag run NAME, or evaldag run ./file.yaml)")
    for col in ("name", "from", "data", "gold format"):
        table.add_column(col, overflow="fold")
    for name, path in config_origins("benchmarks").items():
        origin = "built-in" if path.parent == paths.REPO_ROOT / "configs" / "benchmarks" else str(path)
        try:
            cfg = load_benchmark(name)
            src = cfg.dataset
            data = src.path or f"{src.hub_id}@{src.revision} ({src.split})"
            if src.path is None and src.mirror and paths.data_dir() is not None:   # what it reads instead
                data += f", from the mirror {paths.data_dir() / src.mirror}"
            table.add_row(name, origin, data, cfg.gold_format)
        except EvalDagError as e:   # one broken config must not hide the others
            table.add_row(name, origin, f"[red]{e}[/]", "")
    Console(highlight=False, soft_wrap=True).print(table)


@benchmarks_app.command("check")
def benchmarks_check(
    config: Annotated[str, typer.Argument(help="a benchmark config file (mybench.yaml) or a config name")],
    rows: Annotated[int, typer.Option(min=1, help="rows to show")] = 3,
) -> None:
    """Validate a benchmark config and every row of its data (columns, ids, problems, golds), and show the first
    rows with their gold answers as the grader will read them. Nothing is evaluated."""
    from rich.console import Console
    from rich.table import Table

    from evaldag.request.config import benchmark_file, load_benchmark
    from evaldag.request.datasets import load_benchmark_rows

    path = benchmark_file(config)
    try:
        cfg = load_benchmark(config)
        data = load_benchmark_rows(cfg)
    except EvalDagError as e:
        raise type(e)(f"{path}: {e}") from None
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"{path}: benchmark [bold]{cfg.name}[/], {data.total_rows} problems from {data.source} "
                  f"(data sha256 {data.dataset_hash[:16]}), gold format {cfg.gold_format}: every row reads")
    console.print(f"prompt: {cfg.instruction!r}")
    before, _, after = cfg.instruction.partition("{problem}")
    table = Table(title=f"the first {min(rows, data.total_rows)} rows as the grader reads them")
    for col in ("id", "problem", "gold in the data", "gold the grader reads"):
        table.add_column(col, overflow="fold")
    for r in data.inputs.head(rows).iter_rows(named=True):
        problem = r["prompt"][len(before):len(r["prompt"]) - len(after)]
        problem = problem if len(problem) <= 120 else problem[:117] + "..."
        table.add_row(r["sample_id"], problem, r["gold_raw"][-80:], r["gold"])
    console.print(table)
    console.print(f"run it: evaldag run {config} --limit 20")
