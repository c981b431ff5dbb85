// CUDA kernels of accum_fused: multi-tensor accumulate, window_norms, sgd_update, adam_update.
// Torch-free (raw pointers, a stream): `nvcc -std=c++17 -c` compiles this file alone.
//
// One launch per op walks every tensor of the call. Work unit: a chunk of kChunkElems elements
// of one tensor; block b takes chunks b, b + gridDim.x, ...; a chunk finds its tensor by binary
// search over the device-resident table's chunk_begin (no kernel-argument size limit, one
// launch for any number of tensors). Per thread: 8 elements per iteration with 16-byte
// accesses (2 x float4 for fp32 arrays, 1 x uint4 for bf16/fp16) when every pointer of the
// tensor is 16-byte aligned, else a scalar loop; chunk starts are multiples of 8 elements, so
// alignment holds for every chunk of an aligned tensor. 64-bit indices throughout.
//
// Tensors and scalars per op (slots of multi_tensor.h; G/P = grad/param dtype, rest fp32):
//   accumulate    grad (G, read), buffer (read unless overwrite, written); weight, overwrite,
//                 grad_scale (device ptr), [norm_weight_sum, partials, norms_out]
//   window_norms  buffer (read); weight_sum, partials, norms_out
//   sgd           [grad (G)], buffer (read), param (P, rw), [momentum (rw)]; fold scalars,
//                 weight_sum, maximize, clip_coef (device ptr), SgdScalars
//   adam          [grad (G)], buffer (read), param (P, rw), exp_avg, exp_avg_sq, [max_exp_avg_sq]
//                 (rw); fold scalars, weight_sum, maximize, clip_coef (device ptr), AdamScalars
// Norms: each chunk's sum of squares of acc / W goes to partials[chunk] (block tree reduction),
// then one block per tensor sums its chunks in a fixed order in double: deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "launch.h"

namespace accum_fused::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per thread per iteration
static_assert(kChunkElems % kVec == 0, "chunk starts must keep 16-byte alignment");

// ------------------------------------------------------------------------------- loads/stores
template <class T>
struct Io;

template <>
struct Io<float> {
  static __device__ __forceinline__ void load8(const float* p, float (&x)[kVec]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  }
  static __device__ __forceinline__ void store8(float* p, const float (&x)[kVec]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
  static __device__ __forceinline__ float load1(const float* p) { return *p; }
  static __device__ __forceinline__ void store1(float* p, float x) { *p = x; }
};

template <>
struct Io<__nv_bfloat16> {
  static __device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[kVec]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
  static __device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&x)[kVec]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) h[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
  static __device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ void store1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
};

template <>
struct Io<__half> {
  static __device__ __forceinline__ void load8(const __half* p, float (&x)[kVec]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      const float2 f = __half22float2(h[j]);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
  static __device__ __forceinline__ void store8(__half* p, const float (&x)[kVec]) {
    uint4 raw;
    __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) h[j] = __floats2half2_rn(x[2 * j], x[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
  static __device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void store1(__half* p, float x) { *p = __float2half_rn(x); }
};

// ------------------------------------------------------------------------------- reductions
// Sum over the block, result valid in thread 0. Every thread of the block must call it.
template <class T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_sums[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  __syncthreads();  // warp_sums is reused by the next call
  return v;
}

// ------------------------------------------------------------------------------- driver
// The tensor owning `chunk`: the last entry whose chunk_begin <= chunk (empty tensors share
// their successor's chunk_begin and so are never chosen).
__device__ __forceinline__ int64_t find_tensor(const TensorEntry* table, int64_t n, int64_t chunk) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].chunk_begin <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Runs op.vec(e, i) on aligned 8-element groups and op.scalar(e, i) on the rest of the chunk,
// then op.finish(chunk) (every thread of the block calls it: it may reduce over the block).
template <class Op>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(const TensorEntry* __restrict__ table, int64_t n,
                                                                 int64_t total_chunks, Op op) {
  op.init();
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    const TensorEntry e = table[find_tensor(table, n, chunk)];
    const int64_t begin = (chunk - e.chunk_begin) * kChunkElems;
    const int64_t end = begin + kChunkElems < e.numel ? begin + kChunkElems : e.numel;
    int64_t scalar_begin = begin;
    if (e.flags & kAligned16) {
      const int64_t vec_end = begin + (end - begin) / kVec * kVec;
      for (int64_t i = begin + int64_t(threadIdx.x) * kVec; i < vec_end; i += int64_t(kThreads) * kVec) op.vec(e, i);
      scalar_begin = vec_end;
    }
    for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) op.scalar(e, i);
    op.finish(chunk);
  }
}

// norms_out[t] = sqrt(sum of partials over tensor t's chunks), one block per tensor.
__global__ void __launch_bounds__(kThreads) finalize_norms_kernel(const TensorEntry* __restrict__ table,
                                                                   const float* __restrict__ partials,
                                                                   float* __restrict__ norms_out) {
  const TensorEntry& e = table[blockIdx.x];
  const int64_t chunks = (e.numel + kChunkElems - 1) / kChunkElems;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) s += partials[e.chunk_begin + c];
  s = block_sum(s);
  if (threadIdx.x == 0) norms_out[blockIdx.x] = static_cast<float>(sqrt(s));
}

__device__ __forceinline__ float read_or_one(const float* p) { return p ? *p : 1.0f; }

// ------------------------------------------------------------------------------- ops
template <class G, bool kOverwrite, bool kNorm>
struct AccumulateOp {
  AccumScalars s;
  const float* grad_scale_ptr;
  Divisor norm_weight_sum;
  float* partials;
  Div<float> scale, weight_sum;
  float sq;

  __device__ __forceinline__ void init() {
    scale = Div<float>(af_divisor(read_or_one(grad_scale_ptr)));
    weight_sum = Div<float>(norm_weight_sum);
    sq = 0.0f;
  }
  __device__ __forceinline__ float one(float g, float acc) {
    const float a = kOverwrite ? af_contribution(g, s.weight, scale) : af_accumulate(acc, g, s.weight, scale, false);
    if (kNorm) {
      const float q = af_div(a, weight_sum);
      sq = fmaf(q, q, sq);
    }
    return a;
  }
  __device__ __forceinline__ void vec(const TensorEntry& e, int64_t i) {
    float g[kVec], a[kVec];
    Io<G>::load8(static_cast<const G*>(e.ptr[kGrad]) + i, g);
    float* acc = static_cast<float*>(e.ptr[kBuffer]) + i;
    if (!kOverwrite) Io<float>::load8(acc, a);
#pragma unroll
    for (int j = 0; j < kVec; ++j) a[j] = one(g[j], kOverwrite ? 0.0f : a[j]);
    Io<float>::store8(acc, a);
  }
  __device__ __forceinline__ void scalar(const TensorEntry& e, int64_t i) {
    float* acc = static_cast<float*>(e.ptr[kBuffer]) + i;
    *acc = one(Io<G>::load1(static_cast<const G*>(e.ptr[kGrad]) + i), kOverwrite ? 0.0f : *acc);
  }
  __device__ __forceinline__ void finish(int64_t chunk) {
    if (kNorm) {
      const float total = block_sum(sq);
      if (threadIdx.x == 0) partials[chunk] = total;
      sq = 0.0f;
    }
  }
};

struct NormOp {
  Divisor divisor;
  float* partials;
  Div<float> weight_sum;
  float sq;
  __device__ __forceinline__ void init() {
    weight_sum = Div<float>(divisor);
    sq = 0.0f;
  }
  __device__ __forceinline__ void vec(const TensorEntry& e, int64_t i) {
    float a[kVec];
    Io<float>::load8(static_cast<const float*>(e.ptr[kBuffer]) + i, a);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float q = af_div(a[j], weight_sum);
      sq = fmaf(q, q, sq);
    }
  }
  __device__ __forceinline__ void scalar(const TensorEntry& e, int64_t i) {
    const float q = af_div(static_cast<const float*>(e.ptr[kBuffer])[i], weight_sum);
    sq = fmaf(q, q, sq);
  }
  __device__ __forceinline__ void finish(int64_t chunk) {
    const float total = block_sum(sq);
    if (threadIdx.x == 0) partials[chunk] = total;
    sq = 0.0f;
  }
};

// The window gradient with the last micro-batch folded in when kFold (see math.h).
template <class G, bool kFold, bool kOverwrite>
struct WindowGrad {
  AccumScalars accum;
  const float* grad_scale_ptr;
  WindowScalars window;
  const float* clip_coef_ptr;
  Div<float> scale, weight_sum;
  float clip;

  __device__ __forceinline__ void init() {
    scale = Div<float>(af_divisor(kFold ? read_or_one(grad_scale_ptr) : 1.0f));
    weight_sum = Div<float>(af_divisor(window.weight_sum));
    clip = read_or_one(clip_coef_ptr);
  }
  __device__ __forceinline__ void vec(const TensorEntry& e, int64_t i, float (&g)[kVec]) const {
    float a[kVec];
    if (!(kFold && kOverwrite)) Io<float>::load8(static_cast<const float*>(e.ptr[kBuffer]) + i, a);
    if (kFold) {
      float x[kVec];
      Io<G>::load8(static_cast<const G*>(e.ptr[kGrad]) + i, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        a[j] = kOverwrite ? af_contribution(x[j], accum.weight, scale) : af_accumulate(a[j], x[j], accum.weight, scale, false);
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) g[j] = af_window_grad(a[j], weight_sum, clip, window.maximize);
  }
  __device__ __forceinline__ float scalar(const TensorEntry& e, int64_t i) const {
    float a = kFold && kOverwrite ? 0.0f : static_cast<const float*>(e.ptr[kBuffer])[i];
    if (kFold) {
      const float x = Io<G>::load1(static_cast<const G*>(e.ptr[kGrad]) + i);
      a = af_accumulate(a, x, accum.weight, scale, kOverwrite);
    }
    return af_window_grad(a, weight_sum, clip, window.maximize);
  }
};

// The parameter of an update, read and written as the call's rounding says (see math.h and
// the CPU kernels' ParamIO): nearest, stochastic, or Kahan (p + c, c in slot kComp).
template <class P>
struct ParamIO {
  static __device__ __forceinline__ void read8(const TensorEntry& e, int64_t i, ParamRounding r, float (&p)[kVec]) {
    Io<P>::load8(static_cast<const P*>(e.ptr[kParam]) + i, p);
    if (r == kRoundKahan) {
      float c[kVec];
      Io<__nv_bfloat16>::load8(static_cast<const __nv_bfloat16*>(e.ptr[kComp]) + i, c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) p[j] += c[j];
    }
  }
  static __device__ __forceinline__ void write8(const TensorEntry& e, int64_t i, ParamRounding r, float (&p)[kVec]) {
    if constexpr (std::is_same<P, __nv_bfloat16>::value) {
      if (r == kRoundStochastic) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) p[j] = af_bf16_stochastic(p[j], e.rounding_key, i + j);
      } else if (r == kRoundKahan) {
        float c[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float rounded = __bfloat162float(__float2bfloat16_rn(p[j]));
          c[j] = p[j] - rounded;
          p[j] = rounded;
        }
        Io<__nv_bfloat16>::store8(static_cast<__nv_bfloat16*>(e.ptr[kComp]) + i, c);
      }
    }
    Io<P>::store8(static_cast<P*>(e.ptr[kParam]) + i, p);
  }
  static __device__ __forceinline__ float read1(const TensorEntry& e, int64_t i, ParamRounding r) {
    const float p = Io<P>::load1(static_cast<const P*>(e.ptr[kParam]) + i);
    return r == kRoundKahan ? p + Io<__nv_bfloat16>::load1(static_cast<const __nv_bfloat16*>(e.ptr[kComp]) + i) : p;
  }
  static __device__ __forceinline__ void write1(const TensorEntry& e, int64_t i, ParamRounding r, float p) {
    if constexpr (std::is_same<P, __nv_bfloat16>::value) {
      if (r == kRoundStochastic) p = af_bf16_stochastic(p, e.rounding_key, i);
      if (r == kRoundKahan) {
        const float rounded = __bfloat162float(__float2bfloat16_rn(p));
        Io<__nv_bfloat16>::store1(static_cast<__nv_bfloat16*>(e.ptr[kComp]) + i, p - rounded);
        p = rounded;
      }
    }
    Io<P>::store1(static_cast<P*>(e.ptr[kParam]) + i, p);
  }
};

template <class P, class G, bool kFold, bool kOverwrite>
struct SgdOp {
  WindowGrad<G, kFold, kOverwrite> source;
  SgdScalars s;
  SgdCoef<float> k;

  __device__ __forceinline__ void init() {
    source.init();
    k = SgdCoef<float>(s);
  }
  __device__ __forceinline__ void vec(const TensorEntry& e, int64_t i) {
    const bool first = (e.flags & kFirstMomentum) != 0;
    float g[kVec], p[kVec], b[kVec];
    source.vec(e, i, g);
    float* momentum = static_cast<float*>(e.ptr[kState0]) + i;
    ParamIO<P>::read8(e, i, source.window.rounding, p);
    if (s.has_momentum && !first) {
      Io<float>::load8(momentum, b);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) af_sgd(p[j], b[j], g[j], first, k);
    ParamIO<P>::write8(e, i, source.window.rounding, p);
    if (s.has_momentum) Io<float>::store8(momentum, b);
  }
  __device__ __forceinline__ void scalar(const TensorEntry& e, int64_t i) {
    const bool first = (e.flags & kFirstMomentum) != 0;
    float* momentum = static_cast<float*>(e.ptr[kState0]) + i;
    float p = ParamIO<P>::read1(e, i, source.window.rounding);
    float b = (s.has_momentum && !first) ? *momentum : 0.0f;
    af_sgd(p, b, source.scalar(e, i), first, k);
    ParamIO<P>::write1(e, i, source.window.rounding, p);
    if (s.has_momentum) *momentum = b;
  }
  __device__ __forceinline__ void finish(int64_t) {}
};

template <class P, class G, bool kFold, bool kOverwrite>
struct AdamOp {
  WindowGrad<G, kFold, kOverwrite> source;
  AdamScalars s;
  AdamCoef<float> k;

  __device__ __forceinline__ void init() {
    source.init();
    k = AdamCoef<float>(s);
  }
  __device__ __forceinline__ void vec(const TensorEntry& e, int64_t i) {
    float g[kVec], p[kVec], m[kVec], v[kVec], x[kVec];
    source.vec(e, i, g);
    float* exp_avg = static_cast<float*>(e.ptr[kState0]) + i;
    float* exp_avg_sq = static_cast<float*>(e.ptr[kState1]) + i;
    float* max_exp_avg_sq = static_cast<float*>(e.ptr[kState2]) + i;
    ParamIO<P>::read8(e, i, source.window.rounding, p);
    Io<float>::load8(exp_avg, m);
    Io<float>::load8(exp_avg_sq, v);
    if (s.amsgrad) {
      Io<float>::load8(max_exp_avg_sq, x);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) af_adam(p[j], m[j], v[j], x[j], g[j], k);
    ParamIO<P>::write8(e, i, source.window.rounding, p);
    Io<float>::store8(exp_avg, m);
    Io<float>::store8(exp_avg_sq, v);
    if (s.amsgrad) Io<float>::store8(max_exp_avg_sq, x);
  }
  __device__ __forceinline__ void scalar(const TensorEntry& e, int64_t i) {
    float* exp_avg = static_cast<float*>(e.ptr[kState0]) + i;
    float* exp_avg_sq = static_cast<float*>(e.ptr[kState1]) + i;
    float* max_exp_avg_sq = static_cast<float*>(e.ptr[kState2]) + i;
    float p = ParamIO<P>::read1(e, i, source.window.rounding), m = *exp_avg, v = *exp_avg_sq, x = s.amsgrad ? *max_exp_avg_sq : 0.0f;
    af_adam(p, m, v, x, source.scalar(e, i), k);
    ParamIO<P>::write1(e, i, source.window.rounding, p);
    *exp_avg = m;
    *exp_avg_sq = v;
    if (s.amsgrad) *max_exp_avg_sq = x;
  }
  __device__ __forceinline__ void finish(int64_t) {}
};

// ------------------------------------------------------------------------------- host side
// Blocks to fill the device: 8 resident blocks of 256 threads per SM (2048 threads), cached per
// device (benign race: every thread computes the same value).
int64_t max_blocks() {
  static int cache[128] = {0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 128) return 1024;
  if (cache[device] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 128;
    cache[device] = sms * (2048 / kThreads);
  }
  return cache[device];
}

const char* status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <class Op>
const char* launch(const TensorEntry* table, int64_t n, int64_t total_chunks, const Op& op, void* stream) {
  if (total_chunks == 0) return nullptr;
  const int grid = static_cast<int>(std::min<int64_t>(total_chunks, max_blocks()));
  multi_tensor_kernel<Op><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table, n, total_chunks, op);
  return status();
}

const char* finalize(const TensorEntry* table, int64_t n, const float* partials, float* norms_out, void* stream) {
  if (n == 0) return nullptr;
  // One block per tensor; a call has at most a few thousand tensors (grid.x allows 2^31 - 1).
  finalize_norms_kernel<<<static_cast<unsigned>(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table, partials,
                                                                                                     norms_out);
  return status();
}

template <class F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(float{}); break;
    case kBFloat16: f(__nv_bfloat16{}); break;
    case kFloat16: f(__half{}); break;
  }
}

template <bool kValue>
struct Bool {
  static constexpr bool value = kValue;
};

template <class F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(Bool<true>{});
  } else {
    f(Bool<false>{});
  }
}

// Calls f(P{}, G{}, Bool<kFold>, Bool<kOverwrite>) for the update's types and fold mode.
template <class F>
void dispatch_update(DType param_dtype, const DeviceFold& fold, F&& f) {
  dispatch_dtype(param_dtype, [&](auto p) {
    if (!fold.present) {
      f(p, float{}, Bool<false>{}, Bool<false>{});
      return;
    }
    dispatch_dtype(fold.grad_dtype, [&](auto g) {
      dispatch_bool(fold.accum.overwrite, [&](auto overwrite) { f(p, g, Bool<true>{}, overwrite); });
    });
  });
}

}  // namespace

const char* launch_accumulate(const TensorEntry* table, int64_t n, int64_t total_chunks, DType grad_dtype,
                              AccumScalars accum, const float* grad_scale, float norm_weight_sum, float* partials,
                              float* norms_out, void* stream) {
  const char* err = nullptr;
  const bool norms = norms_out != nullptr;
  dispatch_dtype(grad_dtype, [&](auto g) {
    using G = decltype(g);
    dispatch_bool(accum.overwrite, [&](auto overwrite) {
      dispatch_bool(norms, [&](auto norm) {
        AccumulateOp<G, decltype(overwrite)::value, decltype(norm)::value> op{};
        op.s = accum;
        op.grad_scale_ptr = grad_scale;
        op.norm_weight_sum = af_divisor(norm_weight_sum);
        op.partials = partials;
        err = launch(table, n, total_chunks, op, stream);
      });
    });
  });
  if (err == nullptr && norms) err = finalize(table, n, partials, norms_out, stream);
  return err;
}

const char* launch_window_norms(const TensorEntry* table, int64_t n, int64_t total_chunks, float weight_sum,
                                float* partials, float* norms_out, void* stream) {
  NormOp op{};
  op.divisor = af_divisor(weight_sum);
  op.partials = partials;
  const char* err = launch(table, n, total_chunks, op, stream);
  return err != nullptr ? err : finalize(table, n, partials, norms_out, stream);
}

const char* launch_sgd(const TensorEntry* table, int64_t n, int64_t total_chunks, DType param_dtype,
                       const DeviceFold& fold, WindowScalars window, const float* clip_coef, const SgdScalars& sgd,
                       void* stream) {
  const char* err = nullptr;
  dispatch_update(param_dtype, fold, [&](auto p, auto g, auto fold_t, auto overwrite_t) {
    SgdOp<decltype(p), decltype(g), decltype(fold_t)::value, decltype(overwrite_t)::value> op{};
    op.source.accum = fold.accum;
    op.source.grad_scale_ptr = fold.grad_scale;
    op.source.window = window;
    op.source.clip_coef_ptr = clip_coef;
    op.s = sgd;
    err = launch(table, n, total_chunks, op, stream);
  });
  return err;
}

const char* launch_adam(const TensorEntry* table, int64_t n, int64_t total_chunks, DType param_dtype,
                        const DeviceFold& fold, WindowScalars window, const float* clip_coef,
                        const AdamScalars& adam, void* stream) {
  const char* err = nullptr;
  dispatch_update(param_dtype, fold, [&](auto p, auto g, auto fold_t, auto overwrite_t) {
    AdamOp<decltype(p), decltype(g), decltype(fold_t)::value, decltype(overwrite_t)::value> op{};
    op.source.accum = fold.accum;
    op.source.grad_scale_ptr = fold.grad_scale;
    op.source.window = window;
    op.source.clip_coef_ptr = clip_coef;
    op.s = adam;
    err = launch(table, n, total_chunks, op, stream);
  });
  return err;
}

}  // namespace accum_fused::cuda
