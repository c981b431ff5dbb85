// The tensor table every kernel of a call walks: one entry per tensor, all tensors of the call.
// Torch-free (plain pointers and sizes) so the CUDA sources compile with nvcc alone.
//
// Slots by op (unused slots are null):
//   accumulate     grad, buffer
//   window_norms   buffer
//   sgd_update     grad (fused last micro-batch, else null), buffer, param, state0 = momentum buffer
//   adam_update    grad (idem), buffer, param, state0 = exp_avg, state1 = exp_avg_sq,
//                  state2 = max_exp_avg_sq (amsgrad only)
//   both updates   comp = the bf16 Kahan compensation of a bf16 param (kRoundKahan only)
// Buffers and state are fp32; grads and params fp32, bf16 or fp16 (one dtype per call each).
#pragma once

#include <cstdint>

namespace accum_fused {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum Slot : int32_t {
  kGrad = 0, kBuffer = 1, kParam = 2, kState0 = 3, kState1 = 4, kState2 = 5, kComp = 6, kNumSlots = 7
};

enum EntryFlag : int32_t {
  kAligned16 = 1,       // every non-null pointer of the entry is 16-byte aligned (CUDA vector path)
  kFirstMomentum = 2,   // SGD: the momentum buffer is new this step (b <- g)
};

struct TensorEntry {
  void* ptr[kNumSlots];
  int64_t numel;
  int64_t chunk_begin;  // CUDA: index of the tensor's first chunk in the launch (assign_chunks)
  int32_t flags;
  uint32_t rounding_key;  // kRoundStochastic: this update's key for the tensor (see math.h)
};
static_assert(sizeof(TensorEntry) == 80, "TensorEntry layout is shared by host and device");

// Numbers every entry's chunks consecutively (chunk_begin) and sets kAligned16; returns the
// total number of chunks. Used by the CUDA launchers' callers to size per-chunk workspaces.
inline int64_t assign_chunks(TensorEntry* entries, int64_t n, int64_t chunk_size) {
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    TensorEntry& e = entries[i];
    e.chunk_begin = chunks;
    chunks += (e.numel + chunk_size - 1) / chunk_size;
    bool aligned = true;
    for (int s = 0; s < kNumSlots; ++s) {
      aligned = aligned && (reinterpret_cast<uintptr_t>(e.ptr[s]) % 16 == 0);
    }
    e.flags = aligned ? (e.flags | kAligned16) : (e.flags & ~kAligned16);
  }
  return chunks;
}

}  // namespace accum_fused
