"""The TileLang launchers at the largest operands their scope admits build kernels that fit
their arch's shared memory (``tilelang_harness.compile_failures`` reads each launch's size
from the kernel's host code). A kernel over the limit compiles but fails at its launch on
the GPU: the LoKr apply kernel's persistent staged form did at 128-wide factors until its
planner counted the pipeline's stages (test_tilelang_lokr.py: the LoKr cases)."""
import pytest
import torch

pytest.importorskip("tilelang")

import tilelang_harness as harness  # noqa: E402


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.cpu_only  # on the GPU, kernels an earlier test built are cached and not captured
@pytest.mark.parametrize("family", ["lora", "loha", "tucker", "oft"])
def test_scope_extremes_fit_shared_memory(monkeypatch, family):
    """sm_90a, bf16, the launchers' default configs: LoRA's bypass forward and backward and the
    hada merge, LoHa's bypass backward and tucker at ranks 64 and 128 (scope: <= 128), diag-OFT's
    forward and backward at block sizes 32 and 64 (scope: <= 64)."""
    from lycoris_ops.backends.tilelang.kernels import loha, lora, oft, tucker

    for mod in (lora, loha, tucker, oft):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
        if hasattr(mod, "num_sms"):
            monkeypatch.setattr(mod, "num_sms", lambda d: 132)

    def e(*s):
        return torch.empty(*s, dtype=torch.bfloat16)

    D, x = 4096, e(2048, 4096)
    calls = []
    for r in (64, 128):
        if family == "lora":
            calls += [(lora.bypass_fwd, (x, e(D, r), e(r, D), 0.7, x), {}),
                      (lora.bypass_bwd, (x, x, e(D, r), e(r, D), 0.7), {}),
                      (lora.merge_fwd, (e(D, r), e(r, D), e(D, r), e(r, D), e(D, D), 0.7, "hada"), {})]
        elif family == "loha":
            calls.append((loha.bypass_bwd, (x, x, e(D, r), e(r, D), e(D, r), e(r, D), 0.7), {}))
        elif family == "tucker":
            calls.append((tucker.tucker_fwd, (e(D, r), e(r, r, 9), e(r, D), e(D, r), e(r, r, 9), e(r, D), 0.7), {}))
    if family == "oft":
        for s in (32, 64):
            calls += [(oft.oft_fwd, (e(D // s, s, s), x, None, 1.0, False, False), {}),
                      (oft.oft_bwd, (x, e(D // s, s, s), x, None, 1.0, False, False), {})]
    captured, failed = harness.compile_calls(calls)
    assert captured >= len(calls) and not failed, failed
