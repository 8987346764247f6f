"""Recording one CUDA call of an op as a launch plan that ``csrc/launch.cpp`` replays.

The C++ CUDA kernel calls :func:`recorder`'s function at the third call of a call
signature (tuning and Triton's JIT are done by then). It runs the op's Python CUDA
kernel once while it watches two things: every aten op the call dispatches (a
``TorchDispatchMode``: only allocations, zero fills of them and views are allowed)
and every Triton launch (``CompiledKernel.run``, through which both Triton's JIT
path and ``FastJIT`` launch). The plan it returns says what a later call with the
same signature must do: the allocations, the outputs as views of them, and per
launch the CUfunction, grid, block, shared memory and parameters, each a pointer
into an input or an allocation at a byte offset, or constant bytes. The plan makes
as few allocations as it can: one per output, with the call's workspaces packed
past the largest output's end (or into one allocation of their own), and none for
what neither an output nor a launch uses. Anything it
cannot express (a torch op that computes, a launch it cannot pack, a pointer to
memory the call did not get or make, another backend than Triton) gives no plan:
that signature keeps calling Python.
"""
from __future__ import annotations

import struct
import threading
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["recorder", "plan_of"]

_ALLOC_OPS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
              "aten::new_empty_strided"}
_ZERO_ALLOC_OPS = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}
_ZERO_FILL_OPS = {"aten::zero_"}
_HARMLESS = {"aten::detach", "aten::alias", "aten::lift_fresh",
             "aten::promote_types", "aten::result_type"}  # dtype arithmetic: no tensor is touched

#: parameters a replayed launch may have (csrc/launch.cpp's per-launch arrays), Triton's two
#: scratch pointers included; a launch with more is not planned (the call stays in Python)
MAX_LAUNCH_PARAMS = 64

#: a plan parameter's kind (csrc/launch.cpp's ParamKind): a pointer into an input argument or
#: an allocation at a byte offset, constant bytes, a null pointer
_INPUT, _ALLOC, _CONST, _NULL = 0, 1, 2, 3

#: (size in bytes, struct format) of each Triton scalar parameter type
_SCALARS = {"i1": (1, "b"), "i8": (1, "b"), "u1": (1, "B"), "u8": (1, "B"), "i16": (2, "h"), "u16": (2, "H"),
            "i32": (4, "i"), "u32": (4, "I"), "i64": (8, "q"), "u64": (8, "Q"), "fp32": (4, "f"), "f32": (4, "f"),
            "fp64": (8, "d"), "f64": (8, "d")}


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class _Watch(TorchDispatchMode):
    """The aten ops of the recorded call: allocations kept, anything that computes noted."""

    def __init__(self):
        super().__init__()
        self.allocs = []  # (tensor, zero-filled)
        self.refusal: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _ALLOC_OPS or name in _ZERO_ALLOC_OPS:
            self.allocs.append([out, name in _ZERO_ALLOC_OPS])
        elif name in _ZERO_FILL_OPS:
            for a in self.allocs:  # zeroing a whole fresh allocation: part of the plan
                t = a[0]
                if t.data_ptr() == out.data_ptr() and out.is_contiguous() \
                        and out.numel() * out.element_size() == t.untyped_storage().nbytes():
                    a[1] = True
                    break
            else:
                self.refusal = self.refusal or f"{name} of a part of a tensor"
        elif not (_is_view(func) or name in _HARMLESS):
            self.refusal = self.refusal or name
        return out


_local = threading.local()


def _install_launch_watch():
    """Make ``CompiledKernel.run`` report launches made in a recording thread (once per process)."""
    from triton.compiler.compiler import CompiledKernel

    prop = CompiledKernel.__dict__.get("run")
    if not isinstance(prop, property):
        raise RuntimeError("triton's CompiledKernel.run is not a property")
    if getattr(prop.fget, "_lycoris_watch", False):
        return
    fget = prop.fget

    def run(self):
        launcher = fget(self)
        launches = getattr(_local, "launches", None)
        if launches is None:
            return launcher

        def watched(gx, gy, gz, stream, function, *rest):
            launches.append((self, launcher, gx, gy, gz, stream, function, rest))
            return launcher(gx, gy, gz, stream, function, *rest)
        return watched

    run._lycoris_watch = True
    CompiledKernel.run = property(run)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to one past its last element."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _pointer(ptr: int, inputs, allocs):
    """(kind, index, byte offset) of a device address: inside an input argument or an allocation."""
    for i, t in inputs:
        start = t.data_ptr()
        if start <= ptr < start + max(_extent(t), 1):
            return _INPUT, i, ptr - start
    for j, (t, _) in enumerate(allocs):
        start = t.untyped_storage().data_ptr()
        if start <= ptr < start + max(t.untyped_storage().nbytes(), 1):
            return _ALLOC, j, ptr - start
    return None


#: byte alignment of a workspace packed into another allocation (the caching allocator's own)
PACK_ALIGN = 512
#: workspaces (allocations of the call that no output views: partial sums, intermediates)
#: ride past the end of the call's largest output when they take at most this many bytes
#: or no more than that output itself; else they share one allocation of their own. Each
#: allocation a replayed call makes costs a few microseconds of host time (allocate, free,
#: the tensor), the same order as a launch.
PACK_TAIL_BYTES = 1 << 16


def _align(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


def _layout(allocs, out_idx, used):
    """The replay's allocations: ``(kept, where)``. ``kept``: the allocation indices that
    stay allocations, each with its total bytes; ``where[j] = (kept position, byte offset)``
    for every used allocation j. Unused allocations (neither an output nor a launch
    parameter: the empty side outputs a launcher discards, say) are dropped; workspaces
    are packed, 512-byte aligned, past the end of the largest output, or into one
    allocation of their own."""
    nbytes = {j: allocs[j][0].untyped_storage().nbytes() for j in used}
    outs = [j for j in sorted(used) if j in out_idx]
    works = [j for j in sorted(used) if j not in out_idx]
    kept = [[j, nbytes[j]] for j in outs]
    where = {j: (i, 0) for i, j in enumerate(outs)}
    if works:
        need = sum(_align(nbytes[j]) for j in works)
        host = max(range(len(kept)), key=lambda i: kept[i][1], default=None)
        if host is None or not (need <= PACK_TAIL_BYTES or need <= kept[host][1]):
            host = len(kept)
            # the largest workspace carries the pack, first, at offset 0 (an empty one never
            # does: the allocation is a tensor of its carrier's geometry, and an empty side
            # output sorts first, and a replay through its null data_ptr() faults)
            carrier = max(works, key=lambda j: nbytes[j])
            works = [carrier] + [j for j in works if j != carrier]
            kept.append([carrier, 0])
        off = end = _align(kept[host][1]) if kept[host][1] else 0
        for j in works:
            where[j] = (host, off)
            end = off + nbytes[j]
            off = _align(end)
        kept[host][1] = max(end, nbytes[kept[host][0]])
    return kept, where


def plan_of(args, outputs, watch: _Watch, launches, device: torch.device):
    """The plan tuple csrc/launch.cpp parses, or (None, why).

    ``(device, allocations, outputs, launches)``: an allocation is ``(sizes, strides,
    dtype, total bytes, zero ranges)`` (a tensor of that geometry over a storage of the
    total bytes, which may hold packed workspaces past its own elements; each zero range
    ``(byte offset, bytes)`` is cleared before the launches), an output ``(allocation,
    element offset, sizes, strides)``, a launch ``(CUfunction, gx, gy, gz, threads, shared
    bytes, parameters)`` with each parameter ``(kind, index, value, bytes)``."""
    if watch.refusal:
        return None, f"the call ran {watch.refusal}"
    inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    allocs = watch.allocs
    for t, _ in allocs:
        if t.storage_offset() != 0 or t.device != device:
            return None, "an allocation off the device or with an offset"
    outs = []
    for o in (outputs if isinstance(outputs, tuple) else (outputs,)):
        for j, (t, _) in enumerate(allocs):
            if o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                outs.append((j, o.storage_offset(), list(o.shape), list(o.stride())))
                break
        else:
            return None, "an output that is not an allocation of the call"
    raw_launches = []
    for kernel, launcher, gx, gy, gz, stream, function, rest in launches:
        if stream != torch.cuda.current_stream(device).cuda_stream:
            return None, "a launch on another stream"
        if getattr(launcher, "num_ctas", 1) != 1 or getattr(launcher, "launch_cooperative_grid", False) \
                or getattr(launcher, "launch_pdl", False):
            return None, "a cluster, cooperative or PDL launch"
        if getattr(launcher, "global_scratch_size", 0) or getattr(launcher, "profile_scratch_size", 0):
            return None, "a launch with global or profile scratch"
        kargs = rest[4:]  # after packed_metadata, launch_metadata, enter and exit hooks
        types = list(kernel.src.signature.values())
        if len(types) != len(kargs):
            return None, f"{kernel.name}: {len(kargs)} arguments for {len(types)} parameters"
        params = []
        for ty, a in zip(types, kargs):
            if ty == "constexpr":
                continue
            if isinstance(ty, str) and ty.startswith("*"):
                if a is None:
                    params.append((_NULL, 0, 0, 8))
                    continue
                ptr = a.data_ptr() if isinstance(a, torch.Tensor) else None
                where = None if ptr is None else _pointer(ptr, inputs, allocs)
                if where is None:
                    return None, f"{kernel.name}: a pointer the call did not get or make"
                params.append((where[0], where[1], where[2], 8))
            elif ty in _SCALARS:
                size, fmt = _SCALARS[ty]
                raw = struct.pack("<" + fmt, a)
                params.append((_CONST, 0, int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True), size))
            else:
                return None, f"{kernel.name}: a parameter of type {ty}"
        params.append((_NULL, 0, 0, 8))  # global scratch: none
        params.append((_NULL, 0, 0, 8))  # profile scratch: none
        if len(params) > MAX_LAUNCH_PARAMS:
            return None, f"{kernel.name}: {len(params)} parameters (a replayed launch takes {MAX_LAUNCH_PARAMS})"
        meta = kernel.metadata
        raw_launches.append((int(function), gx, gy, gz, 32 * meta.num_warps, meta.shared, params))
    out_idx = {o[0] for o in outs}
    used = out_idx | {p[1] for launch in raw_launches for p in launch[6] if p[0] == _ALLOC}
    kept, where = _layout(allocs, out_idx, used)
    alloc_plan = []
    for i, (j, total) in enumerate(kept):
        t = allocs[j][0]
        zero = [(where[k][1], allocs[k][0].untyped_storage().nbytes()) for k in sorted(used)
                if where[k][0] == i and allocs[k][1] and allocs[k][0].numel()]
        alloc_plan.append((list(t.shape), list(t.stride()), t.dtype, int(total), zero))
    out_plan = [(where[j][0], off, sizes, strides) for j, off, sizes, strides in outs]
    launch_plan = [launch[:6] + ([(k, where[i][0], where[i][1] + v, n) if k == _ALLOC else (k, i, v, n)
                                  for k, i, v, n in launch[6]],) for launch in raw_launches]
    return (device.index or 0, alloc_plan, out_plan, launch_plan), None


def foreign_work(what: str) -> None:
    """Say that the running call puts work on the GPU outside aten and Triton (a library called
    through ctypes): a call being recorded then gets no plan, as its replay would skip that work."""
    if getattr(_local, "launches", None) is not None:
        _local.foreign = getattr(_local, "foreign", None) or what


#: why the last signature of each op got no plan (diagnostics)
refusals = {}
#: the compiled kernels a plan launches: kept alive (their CUfunction must stay loaded)
_kept = {}


def recorder(op: str, kernel: Callable, tier_of: Callable) -> Callable:
    """The function csrc/launch.cpp calls at a signature's recorded call: ``(outputs, plan or None)``.
    None also where the call ran a deferred key's first config (``tune``'s deferred cold keys):
    the signature stays in Python until the key's final pick clears every plan
    (``register.py``), and a later call of it is recorded then.

    ``kernel``: the op's Python CUDA kernel; ``tier_of(*args)``: the backend tier
    that served these arguments (a plan is made for the ``triton`` tier only)."""

    def record(*args):
        from lycoris_ops.tuner import tune  # the tuner's state, read at a recorded call only

        deferred = tune.deferred_calls()
        try:
            _install_launch_watch()
        except Exception as exc:  # noqa: BLE001 - an unknown Triton: no plans, calls stay in Python
            refusals[op] = f"launches cannot be watched: {exc}"
            return kernel(*args), None
        watch = _Watch()
        outer = getattr(_local, "launches", None)  # a recording this one is nested in (then refused: an op call)
        outer_foreign = getattr(_local, "foreign", None)
        _local.launches = launches = []
        _local.foreign = None
        try:
            with watch:
                out = kernel(*args)
            foreign = _local.foreign
        finally:
            _local.launches, _local.foreign = outer, outer_foreign
        if tune.deferred_calls() != deferred:  # ran a deferred key's first config: not its final pick
            refusals[op] = "a tuning was still deferred (recorded again once it is final)"
            return out, None
        if foreign:
            refusals[op] = f"the call ran {foreign}"
            return out, None
        if tier_of(*args) != "triton":
            refusals[op] = "not served by the triton tier"
            return out, None
        # the op sets launch on the first tensor argument's device (triton/_common.device_guard)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        plan, why = plan_of(args, out, watch, launches, device)
        if plan is None:
            refusals[op] = why
        else:
            for k, *_ in launches:
                _kept.setdefault(id(k), k)
        return out, plan

    record.__name__ = record.__qualname__ = f"record_{op}"
    return record
