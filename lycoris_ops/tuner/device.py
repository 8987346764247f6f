"""Device facts for the cost models: what the driver says, plus two measurements.

``facts(device)`` returns a ``DeviceFacts`` for a CUDA device:

* from ``torch.cuda.get_device_properties``: name, compute capability (→ the
  ``sm_XY`` arch string), SM count, L2 size, shared memory per block (opt-in)
  and per SM, registers per SM, max threads per SM; derived: cp.async
  availability (sm_80+), which sets the pipeline depths worth trying
  (1–4 with cp.async, 1–2 without), max resident blocks per SM, the shared
  memory allocation unit and the per-block reserved shared memory;
* measured once per device (``measure``): DRAM bandwidth (a device-to-device
  copy of a bounded buffer, at most 256 MiB, never more than 1/8 of the free
  memory) and matmul peak (a 4096³ bf16 GEMM, fp16 before sm_80), each the best
  of five CUDA-event timings. The scratch is filled without any RNG (the
  caller's generators are untouched) and freed after (no ``empty_cache``).
  Results are cached in memory and persisted in ``devices.json`` under
  ``LYCORIS_KERNEL_CACHE_DIR``, keyed by device name and arch, so a later process
  reads them and measures nothing.

Never measured while a CUDA graph is being captured or while
``torch.compile``/``torch.export`` traces: the facts then carry table values
(a few known cards by name) or a generic estimate from the SM count and arch
(``measured=False``), and are not cached, so the next safe call measures.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from lycoris_ops.tuner.store import JsonTable, cache_dir

__all__ = ["DeviceFacts", "facts", "measure", "synthetic", "device_table", "unsafe_to_measure", "clear"]

DEVICE_TABLE_VERSION = 1
#: largest buffer the bandwidth probe copies
BW_PROBE_MAX_BYTES = 256 << 20
#: matmul probe size (n x n x n)
MM_PROBE_N = 4096


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    capability: Tuple[int, int]
    sm_count: int
    l2_bytes: int
    smem_per_block: int  # opt-in maximum per block
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_unit: int  # shared-memory allocation granularity
    smem_reserved: int  # shared memory the driver reserves per block
    dram_bw: float  # bytes / s
    mma_peak: float  # flop / s (16-bit tensor-core GEMM)
    fma_rate: float  # flop / s (fp32 FMA units)
    measured: bool = False
    warp_size: int = 32

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def cp_async(self) -> bool:
        """cp.async (asynchronous global->shared copies) exists from sm_80."""
        return self.capability >= (8, 0)

    @property
    def stages(self) -> Tuple[int, ...]:
        """Software-pipeline depths worth trying: 1-4 with cp.async, 1-2 without."""
        return (1, 2, 3, 4) if self.cp_async else (1, 2)

    @property
    def tensor_cores_16bit(self) -> bool:
        return self.capability >= (7, 0)

    @property
    def key(self) -> str:
        """Row key in the device table (SM count included: MIG slices of one card differ)."""
        return f"{self.name}|{self.arch}|{self.sm_count}sm"


# --------------------------------------------------------------------------- table values

#: name substring -> (achievable DRAM bytes/s, achievable dense 16-bit tensor-core flop/s)
#: used only until the device is measured (or while measuring is unsafe).
KNOWN: Tuple[Tuple[str, float, float], ...] = (
    ("H200", 4.3e12, 750e12),
    ("H100", 2.9e12, 700e12),
    ("H800", 2.9e12, 700e12),
    ("GH200", 3.6e12, 750e12),
    ("A100", 1.7e12, 260e12),
    ("A800", 1.7e12, 260e12),
    ("L40S", 0.8e12, 300e12),
    ("L40", 0.8e12, 160e12),
    ("L4", 0.27e12, 100e12),
    ("A10", 0.55e12, 110e12),
    ("RTX 4090", 0.95e12, 160e12),
    ("RTX 3090", 0.85e12, 65e12),
    ("V100", 0.8e12, 100e12),
    ("T4", 0.28e12, 50e12),
)

#: per-SM 16-bit tensor-core flop/s by major arch, for unknown cards
_PER_SM_PEAK = {7: 0.8e12, 8: 1.5e12, 9: 5.5e12, 10: 9e12, 12: 3e12}


def _table_values(name: str, capability: Tuple[int, int], sm_count: int) -> Tuple[float, float]:
    for sub, bw, peak in KNOWN:
        if sub.lower() in name.lower():
            return bw, peak
    per_sm = _PER_SM_PEAK.get(capability[0], 1.0e12)
    # latency model for the bandwidth: ~1 KiB in flight per SM per 16 ns, capped at 1 TB/s
    bw = min(1.0e12, sm_count * 64e9)
    return bw, per_sm * max(1, sm_count)


def _fma_rate(peak: float, capability: Tuple[int, int]) -> float:
    # fp32 FMA throughput vs. dense 16-bit tensor cores: ~1/15 on sm_80/90, ~1/8 on sm_70
    return peak / (8.0 if capability < (8, 0) else 15.0)


def synthetic(name: str = "NVIDIA H200", *, capability=(9, 0), sm_count: int = 132, l2_bytes: int = 50 << 20,
              smem_per_block: int = 227 << 10, smem_per_sm: int = 228 << 10, regs_per_sm: int = 65536,
              max_threads_per_sm: int = 2048, dram_bw: Optional[float] = None,
              mma_peak: Optional[float] = None, measured: bool = False) -> DeviceFacts:
    """Facts of a card that need not exist here (tests, the CPU CLI, planning offline).
    Defaults describe an H200."""
    capability = tuple(capability)
    bw, peak = _table_values(name, capability, sm_count)
    bw = dram_bw or bw
    peak = mma_peak or peak
    return DeviceFacts(
        name=name, capability=capability, sm_count=sm_count, l2_bytes=l2_bytes, smem_per_block=smem_per_block,
        smem_per_sm=smem_per_sm, regs_per_sm=regs_per_sm, max_threads_per_sm=max_threads_per_sm,
        max_blocks_per_sm=32 if capability >= (8, 0) else 16 if capability >= (7, 5) else 32,
        smem_unit=128 if capability >= (8, 0) else 256, smem_reserved=1024 if capability >= (8, 0) else 0,
        dram_bw=bw, mma_peak=peak, fma_rate=_fma_rate(peak, capability), measured=measured)


def _from_props(props) -> DeviceFacts:
    cap = (int(props.major), int(props.minor))
    sm = int(props.multi_processor_count)
    smem_block = int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block",
                                                                                   48 << 10))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or smem_block)
    return synthetic(
        str(props.name), capability=cap, sm_count=sm, l2_bytes=int(getattr(props, "L2_cache_size", 0) or (4 << 20)),
        smem_per_block=smem_block, smem_per_sm=smem_sm,
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 0) or 65536),
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0) or 2048))


# --------------------------------------------------------------------------- guards

def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # CPU-only build, or CUDA not usable
        return False


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def unsafe_to_measure() -> bool:
    """True while tracing (``torch.compile`` / ``torch.export``) or capturing a CUDA graph:
    nothing may be timed or synchronized then."""
    return _compiling() or _capturing()


# --------------------------------------------------------------------------- measurement

_lock = threading.RLock()
_facts: Dict[int, DeviceFacts] = {}
_table: Dict[str, JsonTable] = {}


def device_table() -> JsonTable:
    """The persisted measurements (``devices.json`` in the cache dir)."""
    path = os.path.join(cache_dir(), "devices.json")
    t = _table.get(path)
    if t is None:
        t = _table[path] = JsonTable(path, DEVICE_TABLE_VERSION, "devices", what="device table")
    return t


def _events_best(fn, repeats: int = 5) -> float:
    """Best of ``repeats`` CUDA-event timings of ``fn()`` (seconds); one untimed warm call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def _free_bytes(index: int) -> int:
    try:
        free, _ = torch.cuda.mem_get_info(index)
        return int(free)
    except Exception:
        return 1 << 30


def _pattern(n: int, device, dtype) -> torch.Tensor:
    """Deterministic non-constant data without an RNG."""
    t = torch.arange(n, device=device, dtype=torch.float32)
    t.mul_(0.618034).frac_().sub_(0.5)
    return t.to(dtype)


def measure_bandwidth(index: int, l2_bytes: int) -> float:
    """DRAM bytes/s: best of 5 device copies of a buffer well above L2 (≤ 256 MiB)."""
    device = torch.device("cuda", index)
    nbytes = min(BW_PROBE_MAX_BYTES, max(64 << 20, 8 * l2_bytes), _free_bytes(index) // 8)
    n = max(1 << 20, nbytes // 4)
    with torch.cuda.device(index):
        src = torch.empty(n, device=device, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        t = _events_best(lambda: dst.copy_(src))
    return 2.0 * n * 4 / t


def measure_matmul(index: int, capability: Tuple[int, int]) -> float:
    """Dense 16-bit tensor-core flop/s: best of 5 ``n³`` GEMMs (bf16 from sm_80, else fp16)."""
    device = torch.device("cuda", index)
    dtype = torch.bfloat16 if capability >= (8, 0) else torch.float16
    n = MM_PROBE_N
    while n > 512 and 3 * n * n * 2 > _free_bytes(index) // 8:
        n //= 2
    with torch.cuda.device(index):
        a = _pattern(n * n, device, dtype).view(n, n)
        b = _pattern(n * n, device, dtype).view(n, n).t()
        c = torch.empty((n, n), device=device, dtype=dtype)
        t = _events_best(lambda: torch.mm(a, b, out=c))
    return 2.0 * n ** 3 / t


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"lycoris_ops.tuner.device: {device} is not a CUDA device")
    return device.index if device.index is not None else torch.cuda.current_device()


def measure(device=None, *, force: bool = False) -> DeviceFacts:
    """Measure DRAM bandwidth and matmul peak of ``device`` now (unless the device table
    already has them and not ``force``), cache and persist them. Raises RuntimeError
    while capturing/tracing."""
    if unsafe_to_measure():
        raise RuntimeError("lycoris_ops: cannot measure the device while capturing a CUDA graph or tracing")
    index = _index(device)
    with _lock:
        base = _from_props(torch.cuda.get_device_properties(index))
        table = device_table()
        row = None if force else table.get(base.key)
        if row is not None and _valid_row(row):
            f = replace(base, dram_bw=float(row["dram_bw"]), mma_peak=float(row["mma_peak"]),
                        fma_rate=float(row.get("fma_rate") or _fma_rate(float(row["mma_peak"]), base.capability)),
                        measured=True)
        else:
            t0 = time.perf_counter()
            bw = measure_bandwidth(index, base.l2_bytes)
            peak = measure_matmul(index, base.capability)
            f = replace(base, dram_bw=bw, mma_peak=peak, fma_rate=_fma_rate(peak, base.capability), measured=True)
            table.put(base.key, {"dram_bw": bw, "mma_peak": peak, "fma_rate": f.fma_rate,
                                 "probe_s": round(time.perf_counter() - t0, 4), "torch": torch.__version__})
        _facts[index] = f
        return f


def _valid_row(row: dict) -> bool:
    try:
        return float(row["dram_bw"]) > 0 and float(row["mma_peak"]) > 0
    except (KeyError, TypeError, ValueError):
        return False


def facts(device=None) -> DeviceFacts:
    """The facts of a CUDA device (``None``: the current one), measured on first use.

    While capturing or tracing before the first measurement: the unmeasured table
    values (not cached). A non-CUDA device raises ValueError."""
    index = _index(device)
    f = _facts.get(index)
    if f is not None:
        return f
    if unsafe_to_measure():
        return _from_props(torch.cuda.get_device_properties(index))
    return measure(index)


def clear() -> None:
    """Forget the in-memory facts and tables (tests)."""
    with _lock:
        _facts.clear()
        _table.clear()
