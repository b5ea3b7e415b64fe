"""Static catalog the emulator starts from: GPU types, CPU flavors, data centers.

Ids are RunPod's real ids (the ones the scheduler's defaults name), so a driver configured
with production GPU lists runs unchanged against the emulator. Prices and memory sizes are
plausible list figures, not a copy of today's price sheet: tests should set the price they
assert on with `set_price` rather than rely on these.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ordered from worst to best so availability levels compare by index.
AVAILABILITY_LEVELS: tuple[str, ...] = ("NONE", "LOW", "MEDIUM", "HIGH")
CLOUDS: tuple[str, ...] = ("SECURE", "COMMUNITY")
CUDA_VERSIONS: tuple[str, ...] = ("12.8", "12.6", "12.4")


@dataclass(frozen=True)
class GpuType:
    id: str
    name: str
    memory_gb: int
    price_secure: float
    price_community: float
    pool: str | None
    max_count_secure: int = 8
    max_count_community: int = 4

    def max_count(self, cloud: str) -> int:
        return self.max_count_secure if cloud == "SECURE" else self.max_count_community


@dataclass(frozen=True)
class CpuFlavor:
    id: str
    memory_per_vcpu_gb: int
    price_per_vcpu: float


GPU_TYPES: tuple[GpuType, ...] = (
    GpuType("NVIDIA GeForce RTX 4090", "RTX 4090", 24, 0.69, 0.34, "ADA_24"),
    GpuType("NVIDIA RTX A5000", "RTX A5000", 24, 0.27, 0.16, "AMPERE_24"),
    GpuType("NVIDIA GeForce RTX 3090", "RTX 3090", 24, 0.46, 0.22, "AMPERE_24"),
    GpuType("NVIDIA GeForce RTX 5090", "RTX 5090", 32, 0.94, 0.69, "BLACKWELL_32"),
    GpuType("NVIDIA L40S", "L40S", 48, 0.86, 0.79, "ADA_48_PRO"),
    GpuType("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 48, 0.77, 0.74, "ADA_48_PRO"),
    GpuType("NVIDIA RTX A6000", "RTX A6000", 48, 0.49, 0.33, "AMPERE_48"),
    GpuType("NVIDIA H100 80GB HBM3", "H100 SXM", 80, 2.69, 2.39, "HOPPER_141"),
    GpuType("NVIDIA H100 PCIe", "H100 PCIe", 80, 2.39, 1.99, "ADA_80_PRO"),
    GpuType("NVIDIA A100-SXM4-80GB", "A100 SXM", 80, 1.49, 1.39, "AMPERE_80"),
    GpuType("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, 1.64, 1.19, "AMPERE_80"),
)

CPU_FLAVORS: tuple[CpuFlavor, ...] = (
    CpuFlavor("cpu3c", 2, 0.03),
    CpuFlavor("cpu3g", 4, 0.04),
    CpuFlavor("cpu3m", 8, 0.05),
    CpuFlavor("cpu5c", 2, 0.04),
    CpuFlavor("cpu5g", 4, 0.05),
    CpuFlavor("cpu5m", 8, 0.06),
)

# Insertion order is the placement order when a create names no data center.
DATA_CENTERS: dict[str, str] = {
    "US-TX-3": "US Texas 3",
    "US-KS-2": "US Kansas 2",
    "US-CA-2": "US California 2",
    "EU-RO-1": "EU Romania 1",
    "EU-SE-1": "EU Sweden 1",
}

GPU_TYPES_BY_ID: dict[str, GpuType] = {gpu.id: gpu for gpu in GPU_TYPES}
CPU_FLAVORS_BY_ID: dict[str, CpuFlavor] = {cpu.id: cpu for cpu in CPU_FLAVORS}


def data_center_name(dc_id: str) -> str:
    """Name for a data center a test invented; RunPod-style ids read well enough as names."""
    return DATA_CENTERS.get(dc_id, dc_id)
