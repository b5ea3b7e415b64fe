"""Imported last by the fork server of `tests/forked.py`, once every module it preloads is
imported: one garbage collection there, then every object that exists is frozen
(`gc.freeze`). A child forked from it then does what the service does at start
(`server.tune_gc`: collect, then freeze) over only what it made itself since the fork —
the app, not the ~120,000 objects of the imported modules — about 0.1 s of CPU less for
each of the suite's few hundred schedulers and guards."""

import gc

gc.collect()
gc.freeze()
