from openalice_scheduler.store.store import (
    AtCapacity,
    DuplicateRequest,
    LeaseRecord,
    LeaseStore,
    NewLease,
    OverQuota,
    format_us,
    from_us,
    to_us,
)

__all__ = [
    "AtCapacity", "DuplicateRequest", "LeaseRecord", "LeaseStore", "NewLease", "OverQuota",
    "format_us", "from_us", "to_us",
]
