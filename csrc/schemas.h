// The 23 schemas of the lycoris namespace: the only place a schema is written.
// ops.cpp registers them with TORCH_LIBRARY; module.cpp exposes them to Python.
#pragma once

namespace lycoris {

inline constexpr const char* kSchemas[] = {
    "lora_merge_fwd(Tensor a1, Tensor b1, Tensor? a2, Tensor? b2, Tensor? base, float gamma, str mode, ScalarType? out_dtype=None) -> Tensor",
    "lora_merge_bwd(Tensor grad, Tensor up, Tensor down, float gamma) -> (Tensor, Tensor)",
    "lora_bypass_fwd(Tensor x, Tensor up, Tensor down, float gamma, Tensor? base=None) -> Tensor",
    "lora_bypass_bwd(Tensor grad, Tensor x, Tensor up, Tensor down, float gamma) -> (Tensor, Tensor, Tensor)",
    "lora_tucker_fwd(Tensor a1, Tensor t1, Tensor b1, Tensor? a2, Tensor? t2, Tensor? b2, float gamma) -> Tensor",
    "loha_merge_bwd(Tensor grad, Tensor a1, Tensor b1, Tensor a2, Tensor b2, float gamma) -> (Tensor, Tensor, Tensor, Tensor)",
    "loha_bypass_fwd(Tensor x, Tensor a1, Tensor b1, Tensor a2, Tensor b2, float gamma, Tensor? base=None) -> Tensor",
    "loha_bypass_bwd(Tensor grad, Tensor x, Tensor a1, Tensor b1, Tensor a2, Tensor b2, float gamma) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "lokr_full_merge_fwd(Tensor w1, Tensor w2, Tensor? base, float gamma, ScalarType? out_dtype=None) -> Tensor",
    "lokr_full_merge_bwd(Tensor grad, Tensor w1, Tensor w2, float gamma) -> (Tensor, Tensor)",
    "lokr_merge_fwd(Tensor w1a, Tensor? w1b, Tensor w2a, Tensor? w2b, int[] shape, Tensor? base, float gamma, ScalarType? out_dtype=None) -> Tensor",
    "lokr_merge_bwd(Tensor grad, Tensor w1a, Tensor? w1b, Tensor w2a, Tensor? w2b, int[] shape, float gamma) -> (Tensor, Tensor, Tensor, Tensor)",
    "lokr_bypass_fwd(Tensor x, Tensor w1, Tensor w2, float gamma, Tensor? base=None) -> Tensor",
    "lokr_bypass_bwd(Tensor grad, Tensor x, Tensor w1, Tensor w2, float gamma) -> (Tensor, Tensor, Tensor)",
    "dora_fwd(Tensor w, Tensor dscale, float mult, int row_axis, Tensor? delta=None) -> (Tensor, Tensor)",
    "dora_bwd(Tensor grad, Tensor w, Tensor dscale, Tensor norms, float mult, int row_axis, Tensor? delta=None) -> (Tensor, Tensor)",
    "oft_fwd(Tensor blocks, Tensor x, Tensor? rescale, float cscale, bool shift, bool weight) -> Tensor",
    "oft_bwd(Tensor grad, Tensor blocks, Tensor x, Tensor? rescale, float cscale, bool shift, bool weight) -> (Tensor, Tensor, Tensor)",
    "boft_fwd(Tensor blocks, Tensor x, int axis, float cscale, float scale, Tensor? rescale, bool diff) -> Tensor",
    "boft_bwd(Tensor grad, Tensor blocks, Tensor x, int axis, float cscale, float scale) -> (Tensor, Tensor)",
    "ia3_fwd(Tensor x, Tensor w, int channel_axis, float alpha, float gamma) -> Tensor",
    "ia3_bwd(Tensor grad, Tensor x, Tensor w, int channel_axis, float alpha, float gamma) -> (Tensor, Tensor)",
    "add_scaled(Tensor base, Tensor delta, float gamma) -> Tensor",
};

inline constexpr int kNumSchemas = sizeof(kSchemas) / sizeof(kSchemas[0]);

}  // namespace lycoris
