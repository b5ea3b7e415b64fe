"""The core: one owner of a lease's life (service.py), its states and their moves, who
may take capacity, and every way a lease begins and ends."""

from openalice_scheduler.lifecycle.core import Clock, utcnow
from openalice_scheduler.lifecycle.service import LeaseService

__all__ = ["Clock", "LeaseService", "utcnow"]
