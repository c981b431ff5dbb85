#pragma once
// Which torch the extension is compiled against, and the fast paths that torch's internals allow.
// The extension reaches into torch internals (autograd's AccumulateGrad node and its hook slots,
// PyObject preservation); their shapes change between releases. Every such reach is guarded here,
// by the version in the headers being compiled against, so a build never fails on a supported
// torch: where an internal is missing or differs, the fast path compiles out and the Python path
// (the spec) takes over. bindings.cpp exports the flags as _C.fast_paths (`python -m accum_fused
// info` prints them); in_backward.py and window.py read them before they use a fast path.
// Supported: torch 2.4 (the oldest whose public APIs the Python side uses, README "Set up") to
// 2.15 (the newest released); csrc/check_torch_headers.sh compile-checks any release.
#include <torch/version.h>

#define ACCUM_FUSED_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// FunctionPreHook/PostAccumulateGradHook::compiled_args became const in 2.7.
#if ACCUM_FUSED_TORCH_AT_LEAST(2, 7)
#define ACCUM_FUSED_COMPILED_ARGS_CONST const
#else
#define ACCUM_FUSED_COMPILED_ARGS_CONST
#endif

// torch >= 2.10 preserves a tensor's Python object by a reference the object holds to the tensor,
// and tells whether that is the object's only reference (is_tensor_stealable,
// PyObjectSlot::has_unique_reference; both new in 2.10). Without it, a gradient read once from
// Python (`p.grad`, by a user's clipping or logging) counts one reference more than autograd's and
// the step table's, and was copied where it should be adopted: measured on torch 2.11, CPU and
// CUDA alike (issue 43's "CUDA copies": the GPU image's torch, not CUDA). Before 2.10, a dropped
// wrapper is owned by the tensor and holds no reference to it: use_count tells alone.
#define ACCUM_FUSED_PRESERVED_PYOBJECTS_TELL ACCUM_FUSED_TORCH_AT_LEAST(2, 10)
