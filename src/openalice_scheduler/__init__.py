"""openalice-scheduler: a GPU/compute lease service."""
