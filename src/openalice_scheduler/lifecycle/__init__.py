"""The core: one owner of a lease's life (service.py), its states and their moves, who
may take capacity, and every way a lease begins and ends."""

from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock, SystemClock
from openalice_scheduler.lifecycle.service import LeaseService

__all__ = ["SYSTEM_CLOCK", "Clock", "LeaseService", "SystemClock"]
