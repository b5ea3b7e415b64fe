"""A Kubernetes API emulator with a test kubelet, for the Kubernetes provider's tests:
a local HTTPS server the official client (lightkube) talks to, whose pods are real Docker
containers.

    with KubeEmulator(network="oa-k8s") as kube:
        config = lightkube.KubeConfig.from_file(kube.kubeconfig_path)
        ...  # lightkube.AsyncClient(config), the scheduler with K8S_KUBECONFIG, ...

See README.md beside this file for what is emulated, what is recorded and the switches.
"""

from .handle import KubeEmulator
from .runtime import LABEL_INSTANCE, LABEL_NAMESPACE, LABEL_POD, LABEL_UID

__all__ = ["LABEL_INSTANCE", "LABEL_NAMESPACE", "LABEL_POD", "LABEL_UID", "KubeEmulator"]
