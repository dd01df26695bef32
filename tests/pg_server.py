"""A throwaway PostgreSQL server for the tests: Debian's initdb and pg_ctl in a temporary folder,
listening on a free loopback port only, run as an unprivileged user when the tests run as root (CI
does; PostgreSQL refuses to run as root), stopped and removed at the end of the session.

Where no server binaries are installed the PostgreSQL tests are skipped, except under CI (``CI=true``),
where ``.ci/run`` installs them and a missing server is a failure, not a silent skip.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def find_bin() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="mhar-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "nobody"
            nobody = pwd.getpwnam(self.user)
            os.chmod(self.root, 0o755)
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)

    def _run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [str(self.bindir / cmd[0]), *cmd[1:]]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout, check=True,
                              env={**os.environ, "LC_ALL": "C"})

    def start(self) -> "Server":
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "-t", "60", "start",
                  timeout=90)
        return self

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        except (subprocess.SubprocessError, OSError):
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    def new_database(self) -> str:
        """A fresh, empty database; its postgresql:// URL (no password: the test server trusts loopback)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                                     autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"
