"""What each accelerator chip holds and moves: the one table of HBM sizes, bandwidths, peak flops and clocks that the
memory check, the default mesh and `jaxllama compile`'s estimates read.

A device says how much memory it has when it can (`memory_stats()`, on a real chip); a compile-only device (a TPU
topology described on a host without one) or a chip whose runtime does not say is looked up here by its
`device_kind`. Figures are per chip as its vendor states them (a v5p chip's two TensorCores count as one device).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os

import jax

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: HBM bytes, HBM bandwidth (bytes/s), peak bfloat16 flop/s and the clock (Hz) its
    compiler's cycle estimates count in."""

    name: str
    hbm_bytes: int
    hbm_bandwidth: float
    bf16_flops: float
    clock_hz: float


# By `jax.Device.device_kind`.
CHIPS: dict[str, Chip] = {
    "TPU v4": Chip("TPU v4", 32 * GiB, 1.2e12, 275e12, 1.05e9),
    "TPU v5 lite": Chip("TPU v5e", 16 * GiB, 819e9, 197e12, 1.5e9),
    "TPU v5": Chip("TPU v5p", 95 * GiB, 2765e9, 459e12, 1.75e9),
    "TPU v6 lite": Chip("TPU v6e", 32 * GiB, 1640e9, 918e12, 1.75e9),
    "NVIDIA A100-SXM4-40GB": Chip("A100 40GB", 40 * GiB, 1555e9, 312e12, 1.41e9),
    "NVIDIA A100-SXM4-80GB": Chip("A100 80GB", 80 * GiB, 2039e9, 312e12, 1.41e9),
    "NVIDIA H100 80GB HBM3": Chip("H100 SXM", 80 * GiB, 3350e9, 989e12, 1.98e9),
    "NVIDIA H200": Chip("H200", 141 * 10**9, 4800e9, 989e12, 1.98e9),
}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler needs to know of a GPU it compiles for without one (a `GpuTargetConfigProto`'s device
    description), as NVIDIA's specifications state it; its `device_kind` names its `Chip`."""

    device_kind: str
    compute_capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    l2_cache: int
    clock_ghz: float

    def target_config(self) -> str:
        """The text form of XLA's `GpuTargetConfigProto` for this GPU."""
        chip = CHIPS[self.device_kind]
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": self.shared_memory_per_core,
            "threads_per_core_limit": 2048,
            "core_count": self.cores,
            "fpus_per_core": 128 if major >= 9 else 64,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(chip.hbm_bandwidth),
            "l2_cache_size": self.l2_cache,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": chip.hbm_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items())]
        lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}", 'platform_name: "CUDA"']
        return "\n".join([*lines, f'device_description_str: "{self.device_kind}"', ""])


# GPUs `jaxllama compile --topology NAME:N` compiles for on a host without one (jax's CUDA plugin).
GPUS: dict[str, Gpu] = {
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 164 * 1024, 163 * 1024, 40 * 2**20, 1.41),
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 228 * 1024, 227 * 1024, 50 * 2**20, 1.98),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 228 * 1024, 227 * 1024, 50 * 2**20, 1.98),
}


def chip_of(device) -> Chip | None:
    """The table's entry for a device, or None for a kind it does not list (a CPU, say)."""
    return CHIPS.get(device.device_kind)


def memory_of(device) -> int | None:
    """The bytes one device can hold: what the runtime says it may allocate, else the chip's HBM from the table, else
    None (a CPU device: the host's memory, which its devices share, is checked as such)."""
    if device.platform == "cpu":
        return None
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a compile-only device has no runtime to ask
        limit = None
    if limit:
        return int(limit)
    chip = chip_of(device)
    return chip.hbm_bytes if chip else None


GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")


def skip_absent_tpu() -> None:
    """Keep jax from starting an accelerator's backend on a machine without one. With libtpu installed (to compile
    for TPU slices: `jaxllama compile`), jax's first device query otherwise starts it anyway, and libtpu prints a page
    of warnings before it fails; with a GPU plugin installed (to compile for GPUs), the plugin fails its CUDA checks
    with a traceback and is not registered, so that no GPU target could be described either. Nothing changes where
    JAX_PLATFORMS (or jax's config) names the platforms, or where the machine has TPU chips (/dev/accel*, /dev/vfio)
    or GPUs (/dev/nvidia*, /dev/kfd)."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    tpu = importlib.util.find_spec("libtpu") is not None
    gpu = any(importlib.util.find_spec(p) for p in GPU_PLUGINS)
    if not (tpu or gpu):
        return
    devices = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    if any(glob.glob(pattern) for pattern in devices):
        return
    jax.config.update("jax_platforms", "cpu")
