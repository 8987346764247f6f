"""Host time per call of the GEMM forms our eager bodies use (tiny CUDA operands, GPU idle):
``torch.mm`` in 16 bits, ``torch.mm(out_dtype=float32)`` (``reference.mm32``), an fp32
product of upcast operands, and ``addmm`` with alpha/beta (``reference.gemm_epilogue``)."""
import time

import torch


def per_call(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    for shape in ((64, 64, 64), (4096, 3072, 32), (3072, 3072, 32)):
        M, K, N = shape
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        rows = {
            "torch.add": lambda: torch.add(c, c),
            "mm bf16": lambda: torch.mm(a, b),
            "mm out_dtype=fp32": lambda: torch.mm(a, b, out_dtype=torch.float32),
            "upcast fp32 mm": lambda: a.float() @ b.float(),
            "addmm bf16 alpha": lambda: torch.addmm(c, a, b, alpha=0.5),
        }
        for name, fn in rows.items():
            print(f"{str(shape):20s} {name:20s} {per_call(fn):8.1f} us/call (host, back to back)", flush=True)


if __name__ == "__main__":
    main()
