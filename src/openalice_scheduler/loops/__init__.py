"""Background loops (base.py: LoopService). Each finds what is due or adrift and hands
it to the service: the sweeper (expiries, release retries), the reconciler (what the
providers' listings say), the watcher (deaths the providers stream), the heartbeat, the
warm pool's refill, the purges, the admission loop."""

from openalice_scheduler.loops.admission import AdmissionLoop
from openalice_scheduler.loops.base import LoopService
from openalice_scheduler.loops.heartbeat import Heartbeat
from openalice_scheduler.loops.purge import GuardForgetter, Purger
from openalice_scheduler.loops.reconciler import Reconciler
from openalice_scheduler.loops.sweeper import Alarm, Sweeper
from openalice_scheduler.loops.warm import WarmPool
from openalice_scheduler.loops.watcher import Watcher

__all__ = [
    "AdmissionLoop",
    "Alarm",
    "GuardForgetter",
    "Heartbeat",
    "LoopService",
    "Purger",
    "Reconciler",
    "Sweeper",
    "WarmPool",
    "Watcher",
]
