"""TileLang tuning spaces of LoKr (``backends/tilelang/kernels/lokr.py``): the six ``lokr_*`` ops,
scored by the Triton kernels' work models (``tuner/models/lokr.py``) with the names mapped."""
from __future__ import annotations

import itertools

from lycoris_ops.backends.tilelang.kernels import lokr as kernels, lokr_bypass as bypass_kernels, lora as lora_kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.backends.tilelang.tuning.oft import TL_ACC_PER_THREAD
# the Triton backward's launch rules its work model takes (the TileLang model borrows that model)
from lycoris_ops.backends.triton.kernels import fusedkit, lokr_bypass as triton_lokr_bypass
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner.cost import Work, add_second, esize, p2, smem_fits, tl_shortlist
from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.models import lokr as models

#: The launch configs' spaces: the Kronecker build's (BM x BN) output tile and threads (TL_KRON,
#: tiles of TL_KRON_TILE elements: the merge forwards; ``stream``: the streamed form, a tile of
#: w2 a program, its base blocks in registers or a ``stages``-deep pipeline), the gradient
#: kernels' most tile elements and threads (TL_GRADS: the merge backwards; ``one_pass``: both
#: gradients in one pass), the bypass kernels' most token rows per program and most threads
#: (TL_BYPASS; a kernel takes 256 only where its GEMMs have >= 128 rows: ``bypass_kernels._threads``).
#: ``tl_configs`` keeps a config when it builds kernels of its own (not the fixed config's,
#: not an earlier config's) that fit (``tl_fits``); the corners compile for sm_90a
#: (tests/tilelang/test_tilelang_lokr.py)
TL_KRON = dict(BM=(16, 32, 64), BN=(64, 128, 256), threads=(128, 256), stream=(False, True), stages=(0, 3))
TL_KRON_TILE = (2048, 8192)
TL_GRADS = dict(elems=(2048, 4096, 8192), threads=(128, 256), one_pass=(False, True), stages=(0, 3))
TL_BYPASS = dict(rows=(64, 128, 256), threads=(128, 256))
#: fp32 elements a gradient-kernel thread owns at least (one 16-byte vector)
TL_GRAD_MIN_PER_THREAD = 4
#: op -> (its space, its fixed config in the kernels module, the shortlist's tile axes)
_TL_SPACES = {
    "lokr_full_merge_fwd": (TL_KRON, kernels.KRON, ("stream", "stages", "BM", "BN")),
    "lokr_merge_fwd": (TL_KRON, kernels.KRON, ("stream", "stages", "BM", "BN")),
    "lokr_full_merge_bwd": (TL_GRADS, kernels.GRADS, ("one_pass", "stages", "elems")),
    "lokr_merge_bwd": (TL_GRADS, kernels.GRADS, ("one_pass", "stages", "elems")),
    "lokr_bypass_fwd": (TL_BYPASS, bypass_kernels.BYPASS, ("rows",)), "lokr_bypass_bwd": (TL_BYPASS, bypass_kernels.BYPASS, ("rows",)),
}


def tl_fixed(op: str) -> dict:
    """The fixed config of ``op``'s TileLang launcher (a copy)."""
    return dict(_TL_SPACES[op][1])


def _bypass_kernels(op: str, dims) -> list:
    """(kernel, its factor dims) of a bypass op: the backward's gx is kron_apply with (G, w1ᵀ, w2ᵀ)."""
    a, b, c, d = dims
    if op == "lokr_bypass_fwd":
        return [("apply", dims)]
    return [("apply", (b, a, d, c)), ("wgrad1", dims), ("wgrad2", dims)]


def tl_kernels(op: str, dims, cfg: dict) -> tuple:
    """What ``cfg`` builds for ``op`` on factors dims = (a, b, c, d): per kernel (kind, tile,
    threads); a bypass kernel's tile is (its factor dims, tokens per program step)."""
    a, b, c, d = dims
    if op.endswith("merge_fwd"):  # the output-tile form ignores stages; the stream's w2 tile is (BM, BN)
        if cfg.get("stream"):
            return (("stream", (cfg["BM"], cfg["BN"]), cfg["threads"], cfg.get("stages", 0)),)
        return (("kron", (cfg["BM"], cfg["BN"]), cfg["threads"]),)
    if op.endswith("merge_bwd"):  # the two-pass form ignores stages; the one pass's stages are its own kernel
        tile = kernels._grad_tile(c, d, cfg["elems"])
        if cfg.get("one_pass"):
            return (("grads1", tile, cfg["threads"], cfg.get("stages", 0)),)
        return (("grads", tile, cfg["threads"]),)
    geometry = {"apply": bypass_kernels.apply_geometry, "wgrad1": bypass_kernels.wgrad1_geometry, "wgrad2": bypass_kernels.wgrad2_geometry}
    out = []
    for kind, kd in _bypass_kernels(op, dims):
        bt, threads = geometry[kind](*kd, cfg["rows"], cfg["threads"])
        out.append((kind, (kd, bt), threads))
    return tuple(out)


def bypass_footprint(kind: str, dims, bt: int) -> tuple:
    """(shared-memory elements, fp32 fragment elements) of a bypass kernel on factors dims at
    bt tokens per step: ``backends/tilelang/kernels/lokr.py``'s allocations (padded dims)."""
    Ap, Bp, Cp, Dp = (models.p16(n) for n in dims)
    if kind == "apply":  # xs, w1s, w2s, zs | z, y
        return bt * Bp * Dp + Ap * Bp + Cp * Dp + Bp * bt * Cp, bt * Bp * Cp + Ap * bt * Cp
    if kind == "wgrad1":  # xs, w2s, gs, zs | z, g1
        return bt * Bp * Dp + Cp * Dp + Ap * bt * Cp + Bp * bt * Cp, bt * Bp * Cp + Ap * Bp
    return Bp * bt * Dp + Ap * Bp + bt * Ap * Cp + bt * Ap * Dp, Ap * bt * Dp + Cp * Dp  # wgrad2: xs, w1s, gs, ps | p, g2


def tl_fits(dev: DeviceFacts, kind: str, tile, threads: int, dims, csize: int) -> bool:
    """Whether one kernel of a TileLang config fits: the merge tile within TL_KRON_TILE and no
    larger than the output (a power of two up; the smallest of each axis always), a gradient
    tile of at least TL_GRAD_MIN_PER_THREAD elements a thread; a bypass kernel's shared memory
    (csize-byte operands, the planners' margin) and every kernel's fp32 fragments within
    TL_ACC_PER_THREAD registers a thread."""
    a, b, c, d = dims
    if kind in ("kron", "stream"):  # an output tile, or (stream) a tile of w2
        (bm, bn), acc = tile, tile[0] * tile[1]
        rows, cols = (a * c, b * d) if kind == "kron" else (c, d)
        if not (TL_KRON_TILE[0] <= acc <= TL_KRON_TILE[1] and bm <= max(16, p2(rows))
                and bn <= max(64 if kind == "kron" else 16, p2(cols))):
            return False
    elif kind in ("grads", "grads1"):
        acc = tile[0] * tile[1]
        if acc < TL_GRAD_MIN_PER_THREAD * threads:
            return False
    else:
        smem, acc = bypass_footprint(kind, *tile)
        if not smem_fits(dev, smem * csize):
            return False
    return acc <= TL_ACC_PER_THREAD * threads


def tl_built(op: str, dims, cfg: dict) -> tuple:
    """What the launcher builds for ``cfg``, to tell configs apart: ``tl_kernels``, except the
    backward bypass (its one pass, ``kron_wgrads_kernel``, takes its token step from
    ``wgrads_geometry``: at 64 x 64 factors rows 64 and 128 build the same kernel)."""
    if op == "lokr_bypass_bwd":
        return (("wgrads", (tuple(dims), *bypass_kernels.wgrads_geometry(*dims, cfg["rows"], cfg["threads"]))),)
    return tl_kernels(op, dims, cfg)


def tl_configs(dev: DeviceFacts, op: str, dims, csize: int) -> list:
    """The legal configs of ``op``'s space on factors dims = (a, b, c, d), csize-byte GEMM
    operands: the first of each distinct build (``tl_built``), none the fixed config's; each
    kernel fits (``tl_fits``) or is one the fixed config builds too (it runs anyway)."""
    space = _TL_SPACES[op][0]
    fixed = tl_kernels(op, dims, tl_fixed(op))
    seen = {tl_built(op, dims, tl_fixed(op))}
    out = []
    for values in itertools.product(*space.values()):
        cfg = dict(zip(space, values))
        for form in ("one_pass", "stream"):  # the form it is an option of off: its config as before (no stages)
            if not cfg.get(form, True):
                cfg = {k: v for k, v in cfg.items() if k not in (form, "stages")}
        builds = tl_kernels(op, dims, cfg)
        built = tl_built(op, dims, cfg)
        if built in seen or not all(k in fixed or tl_fits(dev, *k[:3], dims, csize) for k in builds):
            continue
        seen.add(built)
        out.append(cfg)
    return out


def _tl_plan(op: str, dev: DeviceFacts, dims, csize: int, work, eager: float, n: int):
    """The shortlist: the fixed config first, the model's best legal configs, eager."""
    return tl_shortlist(op, tl_configs(dev, op, dims, csize), work, dev, tl_fixed(op), eager, _TL_SPACES[op][2], n)


def _tl_kron(op, dev, dims, r1, r2, compute, out_dtype, base, n):
    """kron_kernel through the Triton merge model, names mapped: the whole product is the tile
    factor and a 1 x 1 loop factor (a program per output tile, no split); threads -> warps,
    one stage. kron_stream_kernel is the Triton merge program itself (a tile of w2, generated
    when factored, and a split of the w1 entries), its stages or one. Eager: the Triton
    planner's."""
    e, eo, eb = esize(compute), esize(out_dtype), esize(None if base is None else base.dtype)
    a, b, c, d = dims

    def work(k):
        cfg = dict(block_m=k["BM"], block_n=k["BN"], block_r=16, block_rl=16, swap=False,
                   num_warps=k["threads"] // 32, num_stages=max(1, k.get("stages", 0)))
        if k.get("stream"):
            return models.merge_works(dev, cfg, a, b, c, d, r1, r2, e, eo, eb, False)
        return models.merge_works(dev, {**cfg, "num_stages": 1}, 1, 1, a * c, b * d, 0, 0, e, eo, eb, False)

    return _tl_plan(op, dev, dims, e, work, models.merge_eager(dev, a, b, c, d, r1, r2, compute, eo, eb, False), n)


def _tl_grads(op, dev, dims, r1, r2, compute, g_dtype, n):
    """kron_grad2 and the one-pass kron_grads_kernel are the Triton merge backward's program (a
    tile of w2 = the gradient tile, a split of the a·b loop entries; threads -> warps, its stages
    or one); the two-pass form's kron_grad1 reads G once more, a program per w1 entry."""
    e, eg = esize(compute), esize(g_dtype)
    a, b, c, d = dims

    def work(k):
        (kind, (bc, bd), threads, *stages), = tl_kernels(op, dims, k)
        if kind == "grads1" and p2(max(r1, r2)) > kernels.MAX_ONE_PASS_RANK:
            return None  # its finishing kernel's factor blocks would not fit shared memory
        cfg = dict(block_m=bc, block_n=bd, block_r=16, block_rl=16, swap=False, num_warps=threads // 32,
                   num_stages=max([1, *stages]))
        works = models.merge_works(dev, cfg, a, b, c, d, 0, 0, e, eg, 0, True)
        if kind == "grads1":
            return works
        return [Work(grid=a * b, warps=threads // 32, acc=bc * bd, dram=a * b * c * d * eg + c * d * e,
                     fma=2.0 * a * b * c * d, inflight=bc * bd * eg)] + works

    return _tl_plan(op, dev, dims, e, work, models.merge_eager(dev, a, b, c, d, r1, r2, compute, eg, 0, True), n)


def _tl_apply_cfg(dims, bt: int, threads: int) -> dict:
    """The Triton forward bypass config of kron_apply's program: bt tokens, whole padded
    factors (block_a, block_c, block_d), no swap; threads -> warps, one stage."""
    Ap, _, Cp, Dp = (models.p16(n) for n in dims)
    return dict(block_t=bt, block_c=Cp, block_d=Dp, block_a=Ap, split=True, swap=False, num_warps=threads // 32,
                num_stages=1)


def _tl_dims(w1, w2) -> tuple:
    return tuple(int(s) for s in (*w1.shape, *w2.shape))


def _full_merge_fwd_tl(dev, w1, w2, base, gamma, out_dtype=None, n: int = TL_N):
    return _tl_kron("lokr_full_merge_fwd", dev, _tl_dims(w1, w2), 0, 0, compute_dtype(w1.dtype, w2.dtype),
                    w2.dtype if out_dtype is None else out_dtype, base, n)


def _full_merge_bwd_tl(dev, grad, w1, w2, gamma, n: int = TL_N):
    return _tl_grads("lokr_full_merge_bwd", dev, _tl_dims(w1, w2), 0, 0, compute_dtype(w1.dtype, w2.dtype),
                     grad.dtype, n)


def _tl_factored(w1a, w1b, w2a, w2b, shape) -> tuple:
    """(a, b, c, d, r1, r2) of a factored merge (rank 0: a whole factor)."""
    return (*(int(s) for s in shape), *models.ranks(w1b, w1a, w2b, w2a))


def _merge_fwd_tl(dev, w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None, n: int = TL_N):
    a, b, c, d, r1, r2 = _tl_factored(w1a, w1b, w2a, w2b, shape)
    compute = compute_dtype(*(t.dtype for t in (w1a, w1b, w2a, w2b) if t is not None))
    return _tl_kron("lokr_merge_fwd", dev, (a, b, c, d), r1, r2, compute, w2a.dtype if out_dtype is None else out_dtype,
                    base, n)


def _merge_bwd_tl(dev, grad, w1a, w1b, w2a, w2b, shape, gamma, n: int = TL_N):
    a, b, c, d, r1, r2 = _tl_factored(w1a, w1b, w2a, w2b, shape)
    compute = compute_dtype(*(t.dtype for t in (w1a, w1b, w2a, w2b) if t is not None))
    return _tl_grads("lokr_merge_bwd", dev, (a, b, c, d), r1, r2, compute, grad.dtype, n)


def _with_staged_twin(plan, dev: DeviceFacts, kd, csize: int, osize: int, bsize: int):
    """``plan`` with its fixed config's other apply epilogue (``staged`` flipped) second, where
    the staged blocks fit: the model cannot tell the two apart and neither wins the forward
    at every shape (the launcher's default is staged), so the tuner times both. The backward's gx
    (no base) gets no twin: staged measured faster there, and each twin is one more cold build."""
    first = plan.candidates[0]
    cf = bypass_kernels.launch_config(bypass_kernels.BYPASS, first)
    if bypass_kernels.apply_staged_fits(*kd, cf["rows"], cf["threads"], csize, osize, bsize, dev.smem_per_block):
        add_second(plan, {**first, "staged": not first.get("staged", True)}, plan.predicted[0])
    return plan


def _bypass_fwd_tl(dev, x, w1, w2, gamma, base=None, n: int = TL_N):
    """kron_apply through the Triton forward bypass model (``_tl_apply_cfg``)."""
    dims, compute = _tl_dims(w1, w2), compute_dtype(x.dtype, w1.dtype, w2.dtype)
    work, eager = models.fwd_model(dev, int(x.shape[0]), *dims, compute, x.dtype,
                                   x.dtype if base is None else base.dtype, base is not None)

    def tl_work(k):
        (_, (kd, bt), threads), = tl_kernels("lokr_bypass_fwd", dims, k)
        return work(_tl_apply_cfg(kd, bt, threads))

    plan = _tl_plan("lokr_bypass_fwd", dev, dims, esize(compute), tl_work, eager, n)
    out = x if base is None else base
    return _with_staged_twin(plan, dev, dims, esize(compute), esize(out.dtype), 0 if base is None else esize(base.dtype))


def _bypass_bwd_tl(dev, grad, x, w1, w2, gamma, n: int = TL_N):
    """gx's kron_apply through the forward bypass model (G in, roles transposed), the two
    weight-gradient kernels as the Triton backward's two passes over the tokens (their larger
    fp32 fragments live, the more threads; its gx share is counted once more, the same for
    every config). Eager: the Triton planner's."""
    T, dims = int(x.shape[0]), _tl_dims(w1, w2)
    a, b, c, d = dims
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    gx_work, _ = models.fwd_model(dev, T, b, a, d, c, compute, grad.dtype, x.dtype, False)
    wg_work, eager = models.bwd_model(dev, T, a, b, c, d, compute, x.dtype, grad.dtype, grid=triton_lokr_bypass.bwd_grid,
                                      reduce_block=fusedkit.reduce_block)

    def tl_work(k):
        (_, (kd, bt), threads), (_, (_, bt1), th1), (_, (_, bt2), th2) = tl_kernels("lokr_bypass_bwd", dims, k)
        gx = gx_work(_tl_apply_cfg(kd, bt, threads))
        live = max(bypass_footprint("wgrad1", dims, bt1)[1], bypass_footprint("wgrad2", dims, bt2)[1])
        wg = wg_work(dict(block_t=bt1, passes=2, swap=False, num_warps=max(th1, th2) // 32, num_stages=1,
                          programs=dev.sm_count), live=live)
        return None if gx is None or wg is None else [gx] + wg

    return _tl_plan("lokr_bypass_bwd", dev, dims, esize(compute), tl_work, eager, n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key: the factor
#: shapes (and ranks); the token count stays bucketed)
TILELANG = {
    "lokr_full_merge_fwd": (_full_merge_fwd_tl, lambda w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_full_merge_bwd": (_full_merge_bwd_tl, lambda g, w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_merge_fwd": (_merge_fwd_tl, lambda w1a, w1b, w2a, w2b, shape, *a: _tl_factored(w1a, w1b, w2a, w2b, shape)),
    "lokr_merge_bwd": (_merge_bwd_tl, lambda g, w1a, w1b, w2a, w2b, shape, *a: _tl_factored(w1a, w1b, w2a, w2b,
                                                                                              shape)),
    "lokr_bypass_fwd": (_bypass_fwd_tl, lambda x, w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_bypass_bwd": (_bypass_bwd_tl, lambda g, x, w1, w2, *a: _tl_dims(w1, w2)),
}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"lokr_full_merge_fwd": kernels.full_merge_fwd, "lokr_full_merge_bwd": kernels.full_merge_bwd,
             "lokr_merge_fwd": kernels.merge_fwd, "lokr_merge_bwd": kernels.merge_bwd,
             "lokr_bypass_fwd": bypass_kernels.bypass_fwd, "lokr_bypass_bwd": bypass_kernels.bypass_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels, bypass_kernels, lora_kernels)
