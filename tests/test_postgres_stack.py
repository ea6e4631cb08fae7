"""`evaldag up --postgres`: the Prefect server on a private PostgreSQL cluster that the stack starts, keeps and
stops (Debian's postgresql package; skipped with the reason when its programs are missing)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from conftest import TEST_WORKER_QUERY_S, free_ports
from evaldag.runtime import postgres as pg
from evaldag.errors import StackError
from evaldag.runtime.stack import POSTGRES, PREFECT_SERVER, Stack, StackSettings

pytestmark = pytest.mark.stack


@pytest.fixture
def pg_stack(tmp_path):
    try:
        pg.bin_dir()
    except StackError as e:
        pytest.skip(str(e))
    root = Path(tempfile.mkdtemp(prefix="evaldag-pg-test-"))
    root.chmod(0o755)  # under root the cluster runs as `postgres`, which must reach its folder
    prefect_port, mlflow_port, pg_port = free_ports(3)
    stack = Stack(StackSettings(home=tmp_path / "home", prefect_port=prefect_port, mlflow_port=mlflow_port,
                                num_gpus=0, postgres=True, postgres_port=pg_port, postgres_dir=root / "cluster",
                                worker_query_seconds=TEST_WORKER_QUERY_S))
    try:
        yield stack
    finally:
        stack.down()
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _sql(stack: Stack, query: str) -> str:
    creds = pg.ensure_cluster(stack.postgres_dir)
    out = subprocess.run([str(pg.bin_dir() / "psql"), "-h", "127.0.0.1", "-p", str(stack.settings.postgres_port),
                          "-U", creds["user"], "-d", pg.DATABASE, "-tAc", query], capture_output=True, text=True,
                         env={"PGPASSWORD": creds["password"], "PATH": "/usr/bin:/bin"}, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_prefect_server_on_a_private_postgres_cluster(pg_stack):
    report = pg_stack.up(deploy=False)
    assert report.started[:2] == [POSTGRES, PREFECT_SERVER]
    rows = {r.component: r for r in pg_stack.status()}
    assert rows[POSTGRES].healthy and rows[PREFECT_SERVER].healthy
    state = pg_stack._load_state()
    db_url = state["components"][PREFECT_SERVER]["key"]["env"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert db_url.startswith("postgresql+asyncpg://evaldag:") and f":{pg_stack.settings.postgres_port}/" in db_url
    assert not (pg_stack.home / "prefect" / "prefect.db").exists()
    # what the server knows lives in PostgreSQL: the pools `up` made, and a pool made through the API now
    assert _sql(pg_stack, "SELECT string_agg(name, ',' ORDER BY name) FROM work_pool") == "cpu,gpu"
    r = httpx.post(f"{pg_stack.settings.prefect_api_url}/work_pools/", json={"name": "pg-probe", "type": "process"},
                   timeout=30)
    assert r.status_code == 201, r.text
    assert _sql(pg_stack, "SELECT count(*) FROM work_pool WHERE name = 'pg-probe'") == "1"

    again = pg_stack.up(deploy=False)                          # idempotent: the cluster is kept like the rest
    assert again.started == [] and POSTGRES in again.kept

    log = Path(state["components"][POSTGRES]["log"])
    assert pg_stack.down()[-1] == POSTGRES                     # stopped last, after the server that uses it
    assert "database system is shut down" in log.read_text()   # a clean (fast) shutdown, not a kill
    report = pg_stack.up(deploy=False)                         # and it comes back with its data
    assert POSTGRES in report.started
    assert _sql(pg_stack, "SELECT count(*) FROM work_pool WHERE name = 'pg-probe'") == "1"
