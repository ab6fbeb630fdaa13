"""A throw-away PostgreSQL server with pgvector, for the `pg` tests and the pg benchmarks.

Debian's own binaries (``/usr/lib/postgresql/<major>/bin``: ``initdb``, ``pg_ctl``) run a fresh
cluster in a temporary directory, listening on loopback only, on a port of its own, with trust
authentication, and remove it afterwards. Nothing of the machine's own clusters is touched.

PostgreSQL refuses to run as root; as root (CI runs as root), the cluster is run by the
unprivileged ``nobody`` user, whose temporary directory is made in ``/tmp`` (a pytest directory
under ``/tmp/pytest-of-root`` is private to root).

    with PgCluster.start() as cluster:
        cluster.uri   # postgresql+psycopg2://postgres@127.0.0.1:PORT/policybert
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.errors import InputError

DATABASE = "policybert"
SUPERUSER = "postgres"
UNPRIVILEGED_USER = "nobody"


def postgres_bindir() -> Path:
    """Where initdb/pg_ctl are: $PG_BINDIR, else the newest /usr/lib/postgresql/*/bin, else PATH."""
    configured = os.environ.get("PG_BINDIR")
    candidates = (
        [Path(configured)]
        if configured
        else sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
            reverse=True,
        )
    )
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).parent)
    for candidate in candidates:
        if (candidate / "initdb").is_file() and (candidate / "pg_ctl").is_file():
            return candidate
    raise InputError(
        "no PostgreSQL server binaries (initdb, pg_ctl) found: install Debian's postgresql "
        "(`.ci/pgvector.sh`) or set PG_BINDIR"
    )


def pgvector_installed(bindir: Path) -> bool:
    """Whether the server of ``bindir`` has the pgvector extension files (``vector.control``)."""
    sharedir = (
        subprocess.run([str(bindir / "pg_config"), "--sharedir"], capture_output=True, text=True)
        if (bindir / "pg_config").is_file()
        else None
    )
    share = (
        Path(sharedir.stdout.strip())
        if sharedir and sharedir.returncode == 0
        else Path("/usr/share/postgresql") / bindir.parent.name
    )
    return (share / "extension" / "vector.control").is_file()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PgCluster:
    """A running throw-away cluster; :meth:`stop` ends it and removes its directory."""

    bindir: Path
    directory: Path
    port: int
    user: str | None
    """The unprivileged user running the server when we are root, None otherwise."""

    @property
    def uri(self) -> str:
        """SQLAlchemy URI of the cluster's database, as Chatchat's ``kbs_config.pg.connection_uri`` takes it."""
        return f"postgresql+psycopg2://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log(self) -> Path:
        return self.directory / "server.log"

    @classmethod
    def start(cls) -> PgCluster:
        """initdb, start on a free loopback port, create the database and the vector extension."""
        bindir = postgres_bindir()
        if not pgvector_installed(bindir):
            raise InputError(f"PostgreSQL in {bindir} has no pgvector extension: run `.ci/pgvector.sh` as root")
        user = UNPRIVILEGED_USER if os.geteuid() == 0 else None
        directory = Path(tempfile.mkdtemp(prefix="policybert-pg-", dir="/tmp" if user else None))
        if user:
            entry = pwd.getpwnam(user)
            os.chown(directory, entry.pw_uid, entry.pw_gid)
        cluster = cls(bindir, directory, _free_port(), user)
        try:
            cluster._pg(
                "initdb", "-D", str(cluster.data), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8", "--no-locale"
            )
            options = f"-c listen_addresses=127.0.0.1 -p {cluster.port} -c unix_socket_directories='' -c fsync=off"
            cluster._pg("pg_ctl", "-D", str(cluster.data), "-o", options, "-l", str(cluster.log), "-w", "start")
            cluster.execute("postgres", f"CREATE DATABASE {DATABASE}")
            cluster.execute(DATABASE, "CREATE EXTENSION vector")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _pg(self, program: str, *args: str) -> None:
        as_user = {"user": self.user, "group": pwd.getpwnam(self.user).pw_gid, "extra_groups": []} if self.user else {}
        result = subprocess.run(
            [str(self.bindir / program), *args], capture_output=True, text=True, cwd=self.directory, **as_user
        )
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
            raise RuntimeError(f"{program} failed (exit {result.returncode}): {result.stdout}{result.stderr}{log}")

    def execute(self, database: str, statement: str) -> None:
        """Run one statement outside a transaction (CREATE DATABASE needs that)."""
        import psycopg2

        connection = psycopg2.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname=database)
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(statement)
        finally:
            connection.close()

    def stop(self) -> None:
        """Stop the server (immediately: its data is thrown away) and remove its directory."""
        if (self.data / "postmaster.pid").is_file():
            try:
                self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass  # already gone: nothing left to stop
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
