"""Workers on Kubernetes: a lease is a Pod (provider.py), made of objects.py's Pod and
Secret."""

from openalice_scheduler.providers.kubernetes.provider import (
    KubernetesProvider,
    config_given,
    load_config,
)

__all__ = ["KubernetesProvider", "config_given", "load_config"]
