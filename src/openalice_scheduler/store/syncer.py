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
one byte per request, `k` when the fsync succeeded, `e` when it failed. Every
CHECKPOINT_EVERY syncs it also checkpoints the WAL into the database (PASSIVE: it never
waits for the writer), which the writer then never does on the event loop. It exits at
the end of its input, that is when the scheduler closes the pipe or is gone; SIGINT and
SIGTERM sent to the whole process group are left to the scheduler, which may still have
writes to make durable while it shuts down.

Only the standard library, and no site packages (-S): it starts in ~10 ms.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys

CHECKPOINT_EVERY = 256


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
            os.fsync(fd)
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
    checkpointer: sqlite3.Connection | None = None
    since_checkpoint = 0
    while True:
        requests = os.read(0, 4096)
        if not requests:
            return
        answer = b"k" if fsync_path(wal, db_path) else b"e"
        os.write(1, answer * len(requests))
        since_checkpoint += 1
        if since_checkpoint >= CHECKPOINT_EVERY:
            since_checkpoint = 0
            try:
                if checkpointer is None:
                    checkpointer = sqlite3.connect(db_path, isolation_level=None)
                checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:
                print(f"sqlite sync helper: checkpoint: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
