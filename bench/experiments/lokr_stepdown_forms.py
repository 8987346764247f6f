"""A/B of the LoKr bypass step-down body's forms at wide factors (out of the fused scope).

Out of scope (a factor side over the fused kernels' limit), ``lokr_bypass_fwd/bwd`` run the
step-down body (``reference/lokr.py``'s ``*_native``) on the compile tier. This times, per
shape and per form, the body eager and under ``torch.compile``, forward and backward, next to
the formula a user writes (einsum, autograd for the backward):

    python bench/experiments/lokr_stepdown_forms.py [--shapes f8-3072,f8-4096,f16-3072] [--dtype bf16]

Forms: ``matmul`` (the shipped body: w1 applied by a broadcast matmul over the tokens),
``einsum`` (each product one ``torch.einsum``, torch picks the GEMM layout), ``formula``
(the user's einsum; its backward through autograd). Prints median device ms and the error
of each form against the fp32 reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import DeviceTimer, _tensors, rel_err  # noqa: E402

from lycoris_ops.reference import lokr as R  # noqa: E402

#: name -> (T tokens, a, b, c, d): LyCORIS's factorization(D, factor) of a square layer
SHAPES = {
    "f8-3072": (8192, 8, 8, 384, 384),
    "f8-4096": (32768, 8, 8, 512, 512),
    "f16-3072": (8192, 16, 16, 192, 192),
    "f-1-3072": (8192, 48, 48, 64, 64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fwd_einsum(x, w1, w2, gamma, base):
    a, b = w1.shape
    c, d = w2.shape
    z = torch.einsum("tvd,cd->tvc", x.reshape(-1, b, d), w2)
    y = torch.einsum("uv,tvc->tuc", w1, z).reshape(x.shape[0], a * c)
    return torch.add(base, y, alpha=gamma)


def bwd_einsum(grad, x, w1, w2, gamma):
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    G, X = grad.reshape(T, a, c), x.reshape(T, b, d)
    H = torch.einsum("tuc,cd->tud", G, w2)
    gx = torch.einsum("uv,tud->tvd", w1, H).reshape(T, b * d)
    g_w1 = torch.einsum("tud,tvd->uv", H, X)
    R_ = torch.einsum("tuc,uv->tvc", G, w1)
    g_w2 = torch.einsum("tvc,tvd->cd", R_, X)
    return gx * gamma, (g_w1 * gamma).to(w1.dtype), (g_w2 * gamma).to(w2.dtype)


def formula(x, w1, w2, gamma, base):
    b, d = w1.shape[1], w2.shape[1]
    return base + gamma * torch.einsum("ub,nbd,cd->nuc", w1, x.reshape(-1, b, d), w2).reshape(x.shape[0], -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev, dt, gamma = torch.device(a.device), DTYPES[a.dtype], 0.7
    timer = DeviceTimer(dev) if dev.type == "cuda" else DeviceTimer(dev, min_reps=2)
    print(f"{torch.__version__} {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'} {a.dtype}")
    print(f"{'shape':10} {'form':8} {'mode':8} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd err':>8} {'bwd err':>8}")
    for name in a.shapes.split(","):
        T, A, B, C, D = SHAPES[name]
        if dev.type == "cpu":
            T = 256
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, B * D, device=dev, generator=g).to(dt)
        w1 = (torch.randn(A, B, device=dev, generator=g) / B ** 0.5).to(dt)
        w2 = (torch.randn(C, D, device=dev, generator=g) / D ** 0.5).to(dt)
        base = torch.randn(T, A * C, device=dev, generator=g).to(dt)
        grad = torch.randn(T, A * C, device=dev, generator=g).to(dt)
        ref_y = R.lokr_bypass_fwd(x.float(), w1.float(), w2.float(), gamma, base.float())
        ref_g = R.lokr_bypass_bwd(grad.float(), x.float(), w1.float(), w2.float(), gamma)

        def err(got, ref):
            return max(rel_err(g, r) for g, r in zip(_tensors(got), _tensors(ref)))

        forms = {"matmul": (R.lokr_bypass_fwd_native, R.lokr_bypass_bwd_native), "einsum": (fwd_einsum, bwd_einsum)}
        for form, (f, b) in forms.items():
            for mode in ("eager", "compile"):
                ff, bb = (torch.compile(f, dynamic=False), torch.compile(b, dynamic=False)) if mode == "compile" else (f, b)
                tf = timer.time(lambda: ff(x, w1, w2, gamma, base))["median_ms"]
                tb = timer.time(lambda: bb(grad, x, w1, w2, gamma))["median_ms"]
                ef, eb = err(ff(x, w1, w2, gamma, base), ref_y), err(bb(grad, x, w1, w2, gamma), ref_g)
                print(f"{name:10} {form:8} {mode:8} {tf:8.3f} {tb:8.3f} {tf + tb:8.3f} {ef:8.1e} {eb:8.1e}", flush=True)
        xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))
        for mode in ("eager", "compile"):
            fn = torch.compile(formula, dynamic=False) if mode == "compile" else formula
            tf = timer.time(lambda: fn(xs, w1s, w2s, gamma, base))["median_ms"]
            tfb = timer.time(lambda: torch.autograd.grad(fn(xs, w1s, w2s, gamma, base), (xs, w1s, w2s), grad))["median_ms"]
            print(f"{name:10} {'formula':8} {mode:8} {tf:8.3f} {tfb - tf:8.3f} {tfb:8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
