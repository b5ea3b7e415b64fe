from openalice_scheduler.store.store import (
    AtCapacity,
    LeaseRecord,
    LeaseStore,
    NewLease,
    format_us,
    from_us,
    to_us,
)

__all__ = ["AtCapacity", "LeaseRecord", "LeaseStore", "NewLease", "format_us", "from_us", "to_us"]
