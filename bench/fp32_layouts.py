"""Layouts and GEMM orientations behind the fp32 cells of #4 (H200, bench/RESULTS.md
2026-12-04 18:08-18:32, the "18:2x" paragraph): device ms of

* the tucker rebuild at 3072² r32 Kk 9 (fp32 and bf16): eager's einsum (it returns a strided
  view), our eager body (rows GEMM + the copy to the contiguous (O, I, Kk) the op returns),
  ``baddbmm`` over o with bᵀ expanded, ``matmul(bᵀ, AT)``, and the op itself;
* the LoHa fp32 backward's two T·O·I GEMMs at 8192 x 3072 in each orientation (Gᵀ·x against
  eager autograd's (xᵀ·G)ᵀ, G·ΔW with and without alpha, x·ΔWᵀ).

    python bench/fp32_layouts.py

CUDA only (CI byte-compiles it).
"""
import sys

import torch

sys.path.insert(0, "bench")
import timing as T
from lycoris_ops.reference.lora import tucker_core, tucker_rows, lora_tucker_fwd
from lycoris_ops.reference import gemm_epilogue
if not torch.cuda.is_available():
    sys.exit("fp32_layouts.py: needs a CUDA device")
dev = "cuda"
timer = T.DeviceTimer(dev)
import lycoris_ops
for dt in (torch.float32, torch.bfloat16):
    D, R, Kk = 3072, 32, 9
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(D, R, device=dev, generator=g).to(dt) / R ** .5
    t = torch.randn(R, R, Kk, device=dev, generator=g).to(dt) / R ** .5
    b = torch.randn(R, D, device=dev, generator=g).to(dt) / D ** .5
    gam = 0.75
    def ref(): return lora_tucker_fwd(a, t, b, None, None, None, gam)
    def eager(): return gam * torch.einsum("op,pqk,qi->oik", a, t, b)
    def bmm():
        at = tucker_core(a, t, dt)  # (O, R, Kk)
        return torch.baddbmm(at.new_empty(()), b.t().expand(D, D, R), at, beta=0, alpha=gam)
    def bmm_t():  # out viewed (O, I, Kk): per o, C_o = b^T (I,R) @ at_o (R,Kk)
        at = tucker_core(a, t, dt)
        return torch.matmul(b.t(), at) * gam
    def op(): return torch.ops.lycoris.lora_tucker_fwd(a, t, b, None, None, None, gam)
    want = ref()
    for name, f in (("eager", eager), ("ref", ref), ("bmm", bmm), ("matmul", bmm_t), ("op", op)):
        y = f()
        err = (y.float() - want.float()).abs().max().item()
        ms = timer.time(f)["median_ms"]
        print(dt, name, tuple(y.shape), y.stride(), "err %.2e" % err, ms)

# LoHa fp32 backward: GW = Gᵀ·x against eager autograd's xᵀ·G orientation
N, D = 8192, 3072
G = torch.randn(N, D, device=dev); x = torch.randn(N, D, device=dev); dw = torch.randn(D, D, device=dev)
for name, f in (("GT.x", lambda: torch.mm(G.t(), x)), ("(xT.G)T", lambda: torch.mm(x.t(), G).t()),
                ("G.dw", lambda: torch.mm(G, dw)), ("G.dw a0.75", lambda: torch.addmm(G.new_zeros(()), G, dw, beta=0, alpha=0.75)),
                ("x.dwT", lambda: torch.mm(x, dw.t()))):
    print("loha fp32", name, timer.time(f)["median_ms"])
