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


def skip_absent_tpu() -> None:
    """Keep jax from starting its TPU backend on a machine with no TPU. With libtpu installed (to compile for TPU
    slices: `jaxllama compile`), jax's first device query otherwise starts it anyway, and libtpu prints a page of
    warnings before it fails. Nothing changes where JAX_PLATFORMS (or jax's config) names the platforms, where the
    machine has TPU chips (/dev/accel*, /dev/vfio), or where a GPU plugin is installed."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if importlib.util.find_spec("libtpu") is None or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    if any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")):
        return
    jax.config.update("jax_platforms", "cpu")
