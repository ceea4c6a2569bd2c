"""Device-agnostic kernels: attention over a paged KV cache, rotary, RMS norm,
activations; optional compiled CPU kernels in csrc/ (see fdx.ops.cpp)."""
