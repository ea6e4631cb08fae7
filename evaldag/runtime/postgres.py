"""A private PostgreSQL cluster for the Prefect server of the local stack (`evaldag up --postgres`).

Debian's `postgresql` package (server 15 on bookworm) provides the binaries; nothing of the system's own clusters is
used. The cluster lives in one folder (data, socket, a generated password), listens on 127.0.0.1 only (the Prefect
server is its one client) and is run by the stack as one more component. PostgreSQL refuses to run as root, so
under root it runs as the `postgres` user, and its folder must be one that user can reach: by default
`/var/lib/evaldag/postgres-<hash of the home>` then (a home under /root or a 0700 temp folder is not), else
`<home>/postgres`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from evaldag.errors import StackError

USER = "evaldag"
DATABASE = "prefect"
SYSTEM_USER = "postgres"


def bin_dir() -> Path:
    """The folder with `initdb` and `postgres`: $EVALDAG_PG_BIN, else the one `initdb` on PATH lives in, else the
    newest /usr/lib/postgresql/*/bin."""
    candidates: list[Path] = []
    if env := os.environ.get("EVALDAG_PG_BIN"):
        candidates.append(Path(env))
    if found := shutil.which("initdb"):
        candidates.append(Path(found).resolve().parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    raise StackError("PostgreSQL's server programs (initdb, postgres) were not found; install them "
                     "(`apt-get install -y postgresql`) or point EVALDAG_PG_BIN at their folder, or give the "
                     "Prefect server a database of your own with --database-url")


def default_dir(home: Path) -> Path:
    """Where the cluster of the stack in `home` lives (see the module doc)."""
    if os.geteuid() == 0:
        return Path("/var/lib/evaldag") / f"postgres-{hashlib.sha256(str(home).encode()).hexdigest()[:12]}"
    return home / "postgres"


def run_as() -> dict[str, Any]:
    """subprocess keyword arguments that drop root to the `postgres` user (nothing when not root)."""
    if os.geteuid() != 0:
        return {}
    try:
        pw = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise StackError(f"PostgreSQL cannot run as root and there is no {SYSTEM_USER!r} user to run it as; "
                         "install the postgresql package (it creates one) or run evaldag as another user") from None
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _chown(path: Path) -> None:
    kw = run_as()
    if kw:
        os.chown(path, kw["user"], kw["group"])


def ensure_cluster(root: Path) -> dict[str, str]:
    """Create the cluster under `root` once (initdb, password authentication on TCP); returns its credentials
    {"user", "password"}, kept in `root/credentials.json` (readable by the owner only)."""
    root = Path(root)
    creds_path = root / "credentials.json"
    data = root / "data"
    if (data / "PG_VERSION").is_file() and creds_path.is_file():
        return json.loads(creds_path.read_text())
    if data.exists() and any(data.iterdir()):
        raise StackError(f"{data} holds a PostgreSQL data folder evaldag did not finish creating (no "
                         f"{creds_path.name}); delete {root} and run `evaldag up --postgres` again")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    _chown(root)
    creds = {"user": USER, "password": secrets.token_urlsafe(24)}
    pwfile = root / "pwfile"
    pwfile.write_text(creds["password"] + "\n")
    pwfile.chmod(0o600)
    _chown(pwfile)
    try:
        proc = subprocess.run(
            [str(bin_dir() / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth-local=trust",
             "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"],
            cwd=root, capture_output=True, text=True, timeout=300, **run_as())
    finally:
        pwfile.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise StackError(f"initdb of {data} failed (exit code {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-2000:]}")
    creds_path.write_text(json.dumps(creds))
    creds_path.chmod(0o600)
    return creds


def server_argv(root: Path, port: int) -> list[str]:
    """The `postgres` command line of the cluster under `root`: TCP on 127.0.0.1:`port`, its socket in `root`."""
    return [str(bin_dir() / "postgres"), "-D", str(Path(root) / "data"), "-p", str(port), "-k", str(root),
            "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200", "-c", "fsync=on"]


def url(creds: dict[str, str], port: int, database: str = DATABASE) -> str:
    """SQLAlchemy URL for the Prefect server (asyncpg driver, which ships with prefect)."""
    return f"postgresql+asyncpg://{creds['user']}:{creds['password']}@127.0.0.1:{port}/{database}"


def is_ready(port: int) -> bool:
    """True when the server on 127.0.0.1:`port` accepts connections (pg_isready)."""
    try:
        proc = subprocess.run([str(bin_dir() / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def ensure_database(creds: dict[str, str], port: int, database: str = DATABASE) -> None:
    """Create `database` if the cluster lacks it (the Prefect server creates its tables, not the database)."""
    env = {**os.environ, "PGPASSWORD": creds["password"]}
    psql = [str(bin_dir() / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", creds["user"], "-d", "postgres",
            "-v", "ON_ERROR_STOP=1", "-tAc"]
    found = subprocess.run([*psql, f"SELECT 1 FROM pg_database WHERE datname = '{database}'"], env=env,
                           capture_output=True, text=True, timeout=60)
    if found.returncode == 0 and found.stdout.strip() == "1":
        return
    made = subprocess.run([*psql, f'CREATE DATABASE "{database}"'], env=env, capture_output=True, text=True,
                          timeout=60)
    if made.returncode != 0 and "already exists" not in made.stderr:
        raise StackError(f"could not create the database {database!r} on 127.0.0.1:{port}: "
                         f"{(found.stderr + made.stderr).strip()[-1000:]}")


__all__ = ["DATABASE", "USER", "bin_dir", "default_dir", "ensure_cluster", "ensure_database", "is_ready",
           "run_as", "server_argv", "url"]
