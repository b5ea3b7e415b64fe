"""The SQLite writer's sync helper: a small child process that makes committed writes
durable (database._Syncer starts it as `python -I -S syncer.py DB_PATH`).

Why a process: the scheduler commits on its event loop's thread with SQLite's
`synchronous=NORMAL` (no fsync) and answers no write before this helper has fsynced the
WAL. A thread of the scheduler could do the fsync, but it needs the GIL before and after,
and the event loop holds it: at 32 clients such a thread waited ~3 ms per commit for a
fsync of ~0.2 ms, and the event loop sat idle for ~12 % of the time meanwhile
(bench/README.md). This process has an interpreter of its own.

Protocol, on stdin and stdout: each request is one byte. For what one read brings, the
helper fsyncs the WAL file once (the database file when there is no WAL) and answers
one byte per request, `k` when the fsync succeeded, `e` when it failed. It exits at the
end of its input, that is when the scheduler closes the pipe or is gone; SIGINT and
SIGTERM sent to the whole process group are left to the scheduler, which may still have
writes to make durable while it shuts down.

Every CHECKPOINT_EVERY syncs a thread of the helper checkpoints the WAL into the database
(PASSIVE: it never waits for the writer), which the writer then never does on the event
loop; meanwhile syncs go on. A WAL checkpointed in full is written from its start again
by the next commit: its file stops growing, and a sync of a file that did not grow costs
about half as much (0.15 against 0.30 ms measured here).

Only the standard library, and no site packages (-S): it starts in ~10 ms.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading

CHECKPOINT_EVERY = 64


def fsync_path(*paths: str) -> bool:
    """fsync the first of `paths` that exists; False when that fails or none exists. By
    path, not a kept descriptor: a WAL file that SQLite removed and made again is the new
    one."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            # As SQLite syncs its files on Linux: the data, and the size when it grew, not
            # the modification time (which would cost a journal commit each time).
            os.fdatasync(fd)
            return True
        except OSError as exc:
            print(f"sqlite sync helper: fsync {path}: {exc}", file=sys.stderr, flush=True)
            return False
        finally:
            os.close(fd)
    return False


def main(db_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wal = db_path + "-wal"
    due = threading.Event()
    threading.Thread(target=checkpoints, args=(db_path, due), daemon=True).start()
    syncs = 0
    while True:
        requests = os.read(0, 4096)
        if not requests:
            return
        answer = b"k" if fsync_path(wal, db_path) else b"e"
        os.write(1, answer * len(requests))
        syncs += 1
        if syncs % CHECKPOINT_EVERY == 0:
            due.set()


def checkpoints(db_path: str, due: threading.Event) -> None:
    """Checkpoint the WAL each time `due` is set (sqlite3 lets go of the GIL meanwhile)."""
    conn: sqlite3.Connection | None = None
    while True:
        due.wait()
        due.clear()
        try:
            if conn is None:
                conn = sqlite3.connect(db_path, isolation_level=None)
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            print(f"sqlite sync helper: checkpoint: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
