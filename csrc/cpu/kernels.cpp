// CPU kernels: accumulate, window_norms, sgd_update, adam_update over a Plan (see kernels.h).
//
// Compiled once per CPU capability: as is (CPU_CAPABILITY DEFAULT: at::vec's portable vector
// type) and through kernels_avx2.cpp with AVX2+FMA code generation. Everything here lives in
// accum_fused::cpu::CPU_CAPABILITY (or an anonymous namespace), so the two builds never share
// a symbol.
//
// Per element and per tensor of the call (buffers/state fp32, G/P the grad/param type):
//   accumulate    reads g (G), acc (unless overwrite)      writes acc
//   window_norms  reads acc
//   sgd           reads [g], acc (unless fold+overwrite), p, [b]      writes p, [b]
//   adam          reads [g], acc (idem), p, m, v, [v_max]              writes p, m, v, [v_max]
//   (both updates with Kahan rounding of bf16 parameters also read and write c, 2 B)
// The accumulation buffer is not written by an update with a fused last micro-batch: it is dead
// once the window closes (the next window overwrites it), and the write would cost 4 B/param.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#endif

#if defined(CPU_CAPABILITY_DEFAULT) && (defined(__x86_64__) || defined(_M_X64))
// torch's own DEFAULT-capability fmadd on x86 is an unfused a * b + c (see math.h).
#define AF_NO_FMA_HARDWARE
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

namespace accum_fused {
namespace {
using VF = at::vec::Vectorized<float>;
// Vector overloads of the helpers math.h's templates call (see math.h).
inline VF af_fma(const VF& a, const VF& b, const VF& c) { return at::vec::fmadd(a, b, c); }
inline VF af_sqrt(const VF& x) { return x.sqrt(); }
inline VF af_neg(const VF& x) { return x.neg(); }
inline VF af_max(const VF& a, const VF& b) { return at::vec::maximum(a, b); }
}  // namespace
}  // namespace accum_fused

#include "kernels.h"

namespace accum_fused::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using c10::BFloat16;
using c10::Half;

constexpr int64_t kF = VF::size();
// Elements per vector iteration: two fp32 vectors, i.e. one full vector of a 16-bit type.
constexpr int64_t kStep = 2 * kF;
static_assert(Vectorized<BFloat16>::size() == kStep, "one bf16 vector widens to two fp32 vectors");
static_assert(Vectorized<Half>::size() == kStep, "one fp16 vector widens to two fp32 vectors");
// Squares are summed in fp32 vectors for this many iterations, then added into a double:
// 16 * kStep values per lane-sum keeps the fp32 part's relative error near 1e-7.
constexpr int kNormFlush = 16;

// ------------------------------------------------------------------------------- loads/stores
inline void load2(const float* p, VF& a, VF& b) {
  a = VF::loadu(p);
  b = VF::loadu(p + kF);
}
inline void load2(const BFloat16* p, VF& a, VF& b) {
  std::tie(a, b) = at::vec::convert_bfloat16_float(Vectorized<BFloat16>::loadu(p));
}
inline void load2(const Half* p, VF& a, VF& b) {
  std::tie(a, b) = at::vec::convert_half_float(Vectorized<Half>::loadu(p));
}
inline void store2(float* p, const VF& a, const VF& b) {
  a.store(p);
  b.store(p + kF);
}
inline void store2(BFloat16* p, const VF& a, const VF& b) { at::vec::convert_float_bfloat16(a, b).store(p); }
inline void store2(Half* p, const VF& a, const VF& b) { at::vec::convert_float_half(a, b).store(p); }

template <class T>
inline float load1(const T* p) {
  return static_cast<float>(*p);
}
template <class T>
inline void store1(T* p, float x) {
  *p = static_cast<T>(x);  // round to nearest even, as Tensor.copy_
}

// Overwrite passes over calls larger than the caches write the buffer with streaming stores:
// a plain store first reads the line it writes (write-allocate), 4 of the pass's 12 bytes per
// element; the buffer is read back from memory by the next micro-batch anyway.
#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kHaveStreamingStores = true;
inline void stream2(float* p, const VF& a, const VF& b) {
  _mm256_stream_ps(p, a);
  _mm256_stream_ps(p + kF, b);
}
inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kHaveStreamingStores = false;
inline void stream2(float* p, const VF& a, const VF& b) { store2(p, a, b); }
inline void stream_fence() {}
#endif

inline double hsum(const VF& v) {
  alignas(64) float lanes[kF];
  v.store(lanes);
  double s = 0.0;
  for (int64_t j = 0; j < kF; ++j) s += lanes[j];
  return s;
}

template <class T>
struct Tag {
  using type = T;
};

template <class F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(Tag<float>{}); break;
    case kBFloat16: f(Tag<BFloat16>{}); break;
    case kFloat16: f(Tag<Half>{}); break;
  }
}

template <class F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Runs body(chunk) for every chunk of the plan in one parallel region.
template <class Body>
void for_each_chunk(const Plan& plan, const Body& body) {
  at::parallel_for(0, plan.num_tasks, plan.grain, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t c = plan.task_begin[task_begin]; c < plan.task_begin[task_end]; ++c) {
      body(c, plan.chunks[c]);
    }
  });
}

// ------------------------------------------------------------------------------- accumulate
template <class G, bool kOverwrite, bool kNorm>
double accumulate_chunk(const G* g, float* acc, int64_t begin, int64_t end, float weight, Divisor scale,
                        Divisor weight_sum, bool stream) {
  // Streaming stores need vector-aligned addresses; chunks start on 64-element boundaries.
  stream = stream && kOverwrite && kHaveStreamingStores &&
           reinterpret_cast<uintptr_t>(acc + begin) % sizeof(VF) == 0;
  const VF vw(weight);
  const Div<VF> vs(scale), vW(weight_sum);
  const Div<float> ss(scale), sW(weight_sum);
  VF sq(0.0f);
  double total = 0.0;
  int pending = 0;
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    VF g0, g1, a0, a1;
    load2(g + i, g0, g1);
    if constexpr (kOverwrite) {
      a0 = af_contribution(g0, vw, vs);
      a1 = af_contribution(g1, vw, vs);
    } else {
      load2(acc + i, a0, a1);
      a0 = af_accumulate(a0, g0, vw, vs, false);
      a1 = af_accumulate(a1, g1, vw, vs, false);
    }
    if (stream) {
      stream2(acc + i, a0, a1);
    } else {
      store2(acc + i, a0, a1);
    }
    if constexpr (kNorm) {
      const VF q0 = af_div(a0, vW), q1 = af_div(a1, vW);
      sq = af_fma(q0, q0, sq);
      sq = af_fma(q1, q1, sq);
      if (++pending == kNormFlush) {
        total += hsum(sq);
        sq = VF(0.0f);
        pending = 0;
      }
    }
  }
  if (stream) stream_fence();
  if constexpr (kNorm) total += hsum(sq);
  for (; i < end; ++i) {
    const float c = af_contribution(load1(g + i), weight, ss);
    const float a = kOverwrite ? c : acc[i] + c;
    acc[i] = a;
    if constexpr (kNorm) {
      const double q = af_div(a, sW);
      total += q * q;
    }
  }
  return total;
}

void accumulate(const Plan& plan, DType grad_dtype, AccumScalars accum, float grad_scale, float norm_weight_sum,
                double* partials) {
  int64_t elements = 0;
  for (int64_t i = 0; i < plan.num_tensors; ++i) elements += plan.tensors[i].numel;
  const bool stream = elements * static_cast<int64_t>(sizeof(float)) > kCpuStreamBytes;
  dispatch_dtype(grad_dtype, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    dispatch_bool(accum.overwrite, [&](auto overwrite) {
      dispatch_bool(partials != nullptr, [&](auto norm) {
        for_each_chunk(plan, [&](int64_t c, const Chunk& chunk) {
          const TensorEntry& t = plan.tensors[chunk.tensor];
          const double s = accumulate_chunk<G, decltype(overwrite)::value, decltype(norm)::value>(
              static_cast<const G*>(t.ptr[kGrad]), static_cast<float*>(t.ptr[kBuffer]), chunk.begin, chunk.end,
              accum.weight, af_divisor(grad_scale), af_divisor(norm_weight_sum), stream);
          if constexpr (decltype(norm)::value) partials[c] = s;
        });
      });
    });
  });
}

// ------------------------------------------------------------------------------- window_norms
double norm_chunk(const float* acc, int64_t begin, int64_t end, Divisor weight_sum) {
  const Div<VF> vW(weight_sum);
  const Div<float> sW(weight_sum);
  VF sq(0.0f);
  double total = 0.0;
  int pending = 0;
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    VF a0, a1;
    load2(acc + i, a0, a1);
    const VF q0 = af_div(a0, vW), q1 = af_div(a1, vW);
    sq = af_fma(q0, q0, sq);
    sq = af_fma(q1, q1, sq);
    if (++pending == kNormFlush) {
      total += hsum(sq);
      sq = VF(0.0f);
      pending = 0;
    }
  }
  total += hsum(sq);
  for (; i < end; ++i) {
    const double q = af_div(acc[i], sW);
    total += q * q;
  }
  return total;
}

void window_norms(const Plan& plan, float weight_sum, double* partials) {
  const Divisor divisor = af_divisor(weight_sum);
  for_each_chunk(plan, [&](int64_t c, const Chunk& chunk) {
    const TensorEntry& t = plan.tensors[chunk.tensor];
    partials[c] = norm_chunk(static_cast<const float*>(t.ptr[kBuffer]), chunk.begin, chunk.end, divisor);
  });
}

// ------------------------------------------------------------------------------- updates
// The window gradient of elements [i, i + kStep) (vec) or of element i (scalar), with the last
// micro-batch folded in when kFold: g = (acc + w * grad / s) / W * clip, negated for maximize.
template <class G, bool kFold, bool kOverwrite>
struct WindowGrad {
  const G* grad;
  const float* acc;
  float weight, clip;
  Div<float> scale, weight_sum;
  bool maximize;
  VF vweight, vclip;
  Div<VF> vscale, vweight_sum;

  WindowGrad(const TensorEntry& t, const FoldScalars& fold, WindowScalars window, float clip_coef)
      : grad(static_cast<const G*>(t.ptr[kGrad])), acc(static_cast<const float*>(t.ptr[kBuffer])),
        weight(fold.accum.weight), clip(clip_coef), scale(af_divisor(fold.grad_scale)),
        weight_sum(af_divisor(window.weight_sum)), maximize(window.maximize), vweight(weight), vclip(clip),
        vscale(af_divisor(fold.grad_scale)), vweight_sum(af_divisor(window.weight_sum)) {}

  inline void vec(int64_t i, VF& out0, VF& out1) const {
    VF a0, a1;
    if constexpr (kFold) {
      VF g0, g1;
      load2(grad + i, g0, g1);
      if constexpr (kOverwrite) {
        a0 = af_contribution(g0, vweight, vscale);
        a1 = af_contribution(g1, vweight, vscale);
      } else {
        load2(acc + i, a0, a1);
        a0 = af_accumulate(a0, g0, vweight, vscale, false);
        a1 = af_accumulate(a1, g1, vweight, vscale, false);
      }
    } else {
      load2(acc + i, a0, a1);
    }
    out0 = af_window_grad(a0, vweight_sum, vclip, maximize);
    out1 = af_window_grad(a1, vweight_sum, vclip, maximize);
  }

  inline float scalar(int64_t i) const {
    float a;
    if constexpr (kFold) {
      a = af_accumulate(kOverwrite ? 0.0f : acc[i], load1(grad + i), weight, scale, kOverwrite);
    } else {
      a = acc[i];
    }
    return af_window_grad(a, weight_sum, clip, maximize);
  }
};

// The parameter of an update, read and written as the call's rounding R says (math.h): nearest,
// stochastic (16 hashed bits per element), or Kahan (the parameter is p + c; p is written
// rounded to nearest and c keeps the remainder, x - p, exact in fp32, rounded to bf16). R is a
// template argument, so the nearest path is the plain load/store it always was; only bf16
// parameters are instantiated with the other two (dispatch_update).
template <class P, ParamRounding R>
struct ParamIO {
  P* param;
  BFloat16* comp;  // kRoundKahan only
  uint32_t key;    // kRoundStochastic only

  explicit ParamIO(const TensorEntry& t)
      : param(static_cast<P*>(t.ptr[kParam])), comp(static_cast<BFloat16*>(t.ptr[kComp])), key(t.rounding_key) {}

  inline void read(int64_t i, VF& p0, VF& p1) const {
    load2(param + i, p0, p1);
    if constexpr (R == kRoundKahan) {
      VF c0, c1;
      load2(comp + i, c0, c1);
      p0 = p0 + c0;
      p1 = p1 + c1;
    }
  }
  inline void write(int64_t i, VF p0, VF p1) const {
    if constexpr (R == kRoundStochastic) {
      float lanes[kStep];
      p0.store(lanes);
      p1.store(lanes + kF);
      for (int64_t j = 0; j < kStep; ++j) lanes[j] = af_bf16_stochastic(lanes[j], key, i + j);
      store2(param + i, VF::loadu(lanes), VF::loadu(lanes + kF));  // (exact: low bits are zero)
    } else if constexpr (R == kRoundKahan) {
      const Vectorized<BFloat16> rounded = at::vec::convert_float_bfloat16(p0, p1);
      rounded.store(param + i);
      VF q0, q1;
      std::tie(q0, q1) = at::vec::convert_bfloat16_float(rounded);
      store2(comp + i, p0 - q0, p1 - q1);
    } else {
      store2(param + i, p0, p1);
    }
  }
  inline float read1(int64_t i) const {
    const float p = load1(param + i);
    if constexpr (R == kRoundKahan) return p + load1(comp + i);
    return p;
  }
  inline void write1(int64_t i, float p) const {
    if constexpr (R == kRoundStochastic) {
      store1(param + i, af_bf16_stochastic(p, key, i));
    } else if constexpr (R == kRoundKahan) {
      const BFloat16 rounded(p);
      param[i] = rounded;
      store1(comp + i, p - static_cast<float>(rounded));
    } else {
      store1(param + i, p);
    }
  }
};

// Calls body.template run<P, G, kFold, kOverwrite, R>() for the call's types, fold mode and
// bf16 rounding (other parameter dtypes: nearest only).
template <class Body>
void dispatch_update(DType param_dtype, ParamRounding rounding, const FoldScalars& fold, Body&& body) {
  dispatch_dtype(param_dtype, [&](auto ptag) {
    using P = typename decltype(ptag)::type;
    const auto with_fold = [&](auto rtag) {
      constexpr ParamRounding R = decltype(rtag)::value;
      if (!fold.present) {
        body.template run<P, float, false, false, R>();
        return;
      }
      dispatch_dtype(fold.grad_dtype, [&](auto gtag) {
        using G = typename decltype(gtag)::type;
        dispatch_bool(fold.accum.overwrite, [&](auto overwrite) {
          body.template run<P, G, true, decltype(overwrite)::value, R>();
        });
      });
    };
    if constexpr (std::is_same_v<P, BFloat16>) {
      if (rounding == kRoundStochastic) return with_fold(std::integral_constant<ParamRounding, kRoundStochastic>{});
      if (rounding == kRoundKahan) return with_fold(std::integral_constant<ParamRounding, kRoundKahan>{});
    }
    with_fold(std::integral_constant<ParamRounding, kRoundNearest>{});
  });
}

template <class P, class G, bool kFold, bool kOverwrite, ParamRounding R>
void sgd_chunk(const TensorEntry& t, int64_t begin, int64_t end, const FoldScalars& fold, WindowScalars window,
               float clip_coef, const SgdScalars& s) {
  const WindowGrad<G, kFold, kOverwrite> source(t, fold, window, clip_coef);
  const SgdCoef<VF> kv(s);
  const SgdCoef<float> ks(s);
  const ParamIO<P, R> param(t);
  float* momentum = static_cast<float*>(t.ptr[kState0]);  // null without momentum
  const bool first = (t.flags & kFirstMomentum) != 0;
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    VF g0, g1, p0, p1, b0(0.0f), b1(0.0f);
    source.vec(i, g0, g1);
    param.read(i, p0, p1);
    if (s.has_momentum && !first) load2(momentum + i, b0, b1);
    af_sgd(p0, b0, g0, first, kv);
    af_sgd(p1, b1, g1, first, kv);
    param.write(i, p0, p1);
    if (s.has_momentum) store2(momentum + i, b0, b1);
  }
  for (; i < end; ++i) {
    float p = param.read1(i);
    float b = (s.has_momentum && !first) ? momentum[i] : 0.0f;
    af_sgd(p, b, source.scalar(i), first, ks);
    param.write1(i, p);
    if (s.has_momentum) momentum[i] = b;
  }
}

struct SgdBody {
  const Plan& plan;
  const FoldScalars& fold;
  WindowScalars window;
  float clip_coef;
  const SgdScalars& s;
  template <class P, class G, bool kFold, bool kOverwrite, ParamRounding R>
  void run() const {
    for_each_chunk(plan, [&](int64_t, const Chunk& chunk) {
      sgd_chunk<P, G, kFold, kOverwrite, R>(plan.tensors[chunk.tensor], chunk.begin, chunk.end, fold, window, clip_coef,
                                         s);
    });
  }
};

void sgd(const Plan& plan, DType param_dtype, const FoldScalars& fold, WindowScalars window, float clip_coef,
         const SgdScalars& s) {
  dispatch_update(param_dtype, window.rounding, fold, SgdBody{plan, fold, window, clip_coef, s});
}

// One pass: moments, IEEE square root and parameter per element (see af_adam in math.h).
template <class P, class G, bool kFold, bool kOverwrite, ParamRounding R>
void adam_chunk(const TensorEntry& t, int64_t begin, int64_t end, const FoldScalars& fold,
                WindowScalars window, float clip_coef, const AdamScalars& s) {
  const WindowGrad<G, kFold, kOverwrite> source(t, fold, window, clip_coef);
  const AdamCoef<VF> kv(s);
  const AdamCoef<float> ks(s);
  const ParamIO<P, R> param(t);
  float* exp_avg = static_cast<float*>(t.ptr[kState0]);
  float* exp_avg_sq = static_cast<float*>(t.ptr[kState1]);
  float* max_exp_avg_sq = static_cast<float*>(t.ptr[kState2]);  // null without amsgrad
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    VF g0, g1, p0, p1, m0, m1, v0, v1, x0(0.0f), x1(0.0f);
    source.vec(i, g0, g1);
    param.read(i, p0, p1);
    load2(exp_avg + i, m0, m1);
    load2(exp_avg_sq + i, v0, v1);
    if (s.amsgrad) load2(max_exp_avg_sq + i, x0, x1);
    af_adam(p0, m0, v0, x0, g0, kv);
    af_adam(p1, m1, v1, x1, g1, kv);
    param.write(i, p0, p1);
    store2(exp_avg + i, m0, m1);
    store2(exp_avg_sq + i, v0, v1);
    if (s.amsgrad) store2(max_exp_avg_sq + i, x0, x1);
  }
  for (; i < end; ++i) {
    float p = param.read1(i);
    float m = exp_avg[i], v = exp_avg_sq[i];
    float x = s.amsgrad ? max_exp_avg_sq[i] : 0.0f;
    af_adam(p, m, v, x, source.scalar(i), ks);
    param.write1(i, p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (s.amsgrad) max_exp_avg_sq[i] = x;
  }
}

struct AdamBody {
  const Plan& plan;
  const FoldScalars& fold;
  WindowScalars window;
  float clip_coef;
  const AdamScalars& s;
  template <class P, class G, bool kFold, bool kOverwrite, ParamRounding R>
  void run() const {
    for_each_chunk(plan, [&](int64_t, const Chunk& chunk) {
      adam_chunk<P, G, kFold, kOverwrite, R>(plan.tensors[chunk.tensor], chunk.begin, chunk.end, fold, window,
                                          clip_coef, s);
    });
  }
};

void adam(const Plan& plan, DType param_dtype, const FoldScalars& fold, WindowScalars window, float clip_coef,
          const AdamScalars& s) {
  dispatch_update(param_dtype, window.rounding, fold, AdamBody{plan, fold, window, clip_coef, s});
}

}  // namespace

#define AF_STR2(x) #x
#define AF_STR(x) AF_STR2(x)
extern const Kernels kernels;
const Kernels kernels = {AF_STR(CPU_CAPABILITY), accumulate, window_norms, sgd, adam};

}  // namespace accum_fused::cpu::CPU_CAPABILITY
