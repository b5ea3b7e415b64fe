"""Nodes as the clusters people run make them, for `--nodes` / `set_nodes`.

- GKE: every GPU node is labelled `cloud.google.com/gke-accelerator=<type>` (nvidia-l4,
  nvidia-tesla-a100, nvidia-h100-80gb, ...) and tainted `nvidia.com/gpu=present:NoSchedule`
  (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus).
- EKS (its GPU AMIs' node groups, with the taint the docs advise) and GPU Operator
  clusters: `nvidia.com/gpu.product` from GPU feature discovery, taint `nvidia.com/gpu`
  NoSchedule (https://docs.aws.amazon.com/eks/latest/userguide/ml-eks-optimized-ami.html).
- AKS GPU node pools: taint `sku=gpu:NoSchedule`
  (https://learn.microsoft.com/en-us/azure/aks/gpu-cluster).
"""

from __future__ import annotations

from typing import Any

_MACHINE = {"cpu": "8", "memory": "32Gi", "pods": "110"}


def gke_gpu_node(name: str, accelerator: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"cloud.google.com/gke-accelerator": accelerator},
        "allocatable": {**_MACHINE, "nvidia.com/gpu": str(gpus)},
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    }


def operator_gpu_node(name: str, product: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"nvidia.com/gpu.product": product},
        "allocatable": {**_MACHINE, "nvidia.com/gpu": str(gpus)},
        "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
    }


def aks_gpu_node(name: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"kubernetes.azure.com/accelerator": "nvidia"},
        "allocatable": {**_MACHINE, "nvidia.com/gpu": str(gpus)},
        "taints": [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}],
    }


def cpu_node(name: str) -> dict[str, Any]:
    return {"name": name, "allocatable": dict(_MACHINE)}
