// Per-element math of accum_fused, written once for the CPU kernels (T = float for scalar
// tails, T = at::vec::Vectorized<float> for the vector body) and the CUDA kernels (T = float).
//
// The operation order is the reference backend's (accum_fused/backends/reference.py), which is
// torch's single-tensor SGD/Adam path; where torch's CPU kernels fuse a multiply-add (add with
// alpha, lerp, addcmul: checked bit for bit against torch 2.13 on AVX2/AVX512) we call af_fma,
// elsewhere we round every step as torch does. With FMA hardware the CPU kernels therefore
// reproduce the reference bit for bit for fp32; the CUDA kernels (built with -fmad=false) give
// the same bits as the CPU kernels.
//
// Torch-free: only <cmath>. An includer with a vector type declares, before including this
// header and inside `namespace accum_fused { namespace { ... } }`, overloads of
//   af_fma(a, b, c)  (a * b + c),  af_sqrt(x),  af_neg(x),  af_max(a, b)  (NaN-propagating, as
//   torch.maximum)
// for that type; the float overloads are below.
//
// Every scalar coefficient is computed by the Python backend exactly as the reference computes
// it (in double, or in fp32 tensor arithmetic for a tensor lr) and only then rounded to float,
// because torch rounds Python-number scalars to float inside its kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AF_HD __host__ __device__ __forceinline__
#else
#define AF_HD inline
#endif

namespace accum_fused {

// ---------------------------------------------------------------------------- scalars
// Uniform per call. Booleans pick branches that are the same for every element.
struct AccumScalars {
  float weight;     // the micro-batch weight w
  bool overwrite;   // the first micro-batch of the window: acc <- c, no read of acc
};

// How an update writes a bf16 parameter (the option bf16_update; every other dtype: nearest).
enum ParamRounding : int32_t {
  kRoundNearest = 0,     // round to nearest even, as torch's .to(bfloat16)
  kRoundStochastic = 1,  // up with probability (x - down) / ulp: unbiased (af_bf16_stochastic)
  kRoundKahan = 2,       // p + c is the parameter; c (bf16, slot kComp) keeps what p cannot hold
};

struct WindowScalars {
  float weight_sum;  // W = sum of the window's weights
  bool maximize;
  ParamRounding rounding;
};

struct SgdScalars {
  float weight_decay;         // float(weight_decay)
  float momentum;             // float(momentum)
  float one_minus_dampening;  // float(1 - dampening), computed in double
  float neg_lr;               // float(-lr)
  bool has_weight_decay;      // weight_decay != 0
  bool has_momentum;          // momentum != 0
  bool nesterov;
};

struct AdamScalars {
  float decay_factor;     // float(1 - lr * weight_decay)   (decoupled weight decay)
  float weight_decay;     // float(weight_decay)            (coupled weight decay)
  float lerp_weight;      // float(1 - beta1)
  float beta2;            // float(beta2)
  float one_minus_beta2;  // float(1 - beta2)
  float bc2_sqrt;         // float(sqrt(1 - beta2 ** step))
  float eps;              // float(eps)
  float neg_step_size;    // float(-(lr / (1 - beta1 ** step)))
  bool has_weight_decay;  // weight_decay != 0
  bool decoupled;         // AdamW
  bool amsgrad;
};

// ---------------------------------------------------------------------------- functions
// Internal linkage on purpose: the CPU kernels are compiled once per CPU capability (plain and
// AVX2+FMA) into one library, and af_fma differs between them; external inline functions of
// the same name would be merged by the linker into one of the two.
namespace {

// ---------------------------------------------------------------------------- float helpers
// AF_NO_FMA_HARDWARE: the CPU build for CPUs without FMA, where torch's own vector fmadd is an
// unfused a * b + c; matching it keeps that build equal to the reference too.
#if defined(AF_NO_FMA_HARDWARE) && !defined(__CUDACC__)
AF_HD float af_fma(float a, float b, float c) { return a * b + c; }
#else
AF_HD float af_fma(float a, float b, float c) { return fmaf(a, b, c); }
#endif
AF_HD float af_sqrt(float x) { return sqrtf(x); }
AF_HD float af_neg(float x) { return -x; }
AF_HD float af_max(float a, float b) { return (a != a || a > b) ? a : b; }

// ---------------------------------------------------------------------------- division
// x / d as a multiplication by 1/d where that gives the same bits: d a power of two whose
// reciprocal is a normal float (x / 2^k and x * 2^-k round the same real number). GradScaler's
// scales and unweighted windows of 2^k micro-batches take that path; a divide costs ~10x a
// multiply on CPUs, and the Adam pass was compute-bound on its three divides (measured).
struct Divisor {
  float value;
  float inverse;
  bool by_inverse;
};

AF_HD Divisor af_divisor(float d) {
  int exponent = 0;
  const float mantissa = frexpf(d, &exponent);
  const float inverse = 1.0f / d;
  const bool pow2 = (mantissa == 0.5f || mantissa == -0.5f) && fabsf(inverse) >= 1.17549435e-38f &&
                    fabsf(inverse) <= 3.40282347e+38f;
  return Divisor{d, inverse, pow2};
}

template <class T>
struct Div {
  T value, inverse;
  bool by_inverse;
  Div() = default;
  AF_HD explicit Div(const Divisor& d) : value(d.value), inverse(d.inverse), by_inverse(d.by_inverse) {}
};

template <class T>
AF_HD T af_div(T x, const Div<T>& d) {
  return d.by_inverse ? x * d.inverse : x / d.value;
}

// ---------------------------------------------------------------------------- bf16 rounding
// Stochastic rounding draws 16 random bits per element from a counter-based hash of its index
// in the tensor and the update's 32-bit key (computed on the host from the parameter's rounding
// seed, a new key every update): no generator state on the device, and every backend (the
// reference's integer tensor arithmetic included) draws the same bits, so their results are
// equal bit for bit. The hash is "lowbias32" (C. Wellons' hash prospector), a bijection.
AF_HD uint32_t af_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// x rounded to a bf16 value (returned as the float it is, low 16 bits zero): adding 16 random
// bits below the kept mantissa carries into it with probability (x - down) / ulp. NaN and
// infinity are returned as they are (the bf16 conversion after keeps them).
AF_HD float af_bf16_stochastic(float x, uint32_t key, int64_t index) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u) return x;
  bits = (bits + (af_hash32(static_cast<uint32_t>(index) ^ key) & 0xffffu)) & 0xffff0000u;
  float rounded;
  memcpy(&rounded, &bits, sizeof rounded);
  return rounded;
}

// ---------------------------------------------------------------------------- accumulate
// c = w * g / s (s: GradScaler's scale, 1 without one: dividing by 1 is exact). Dividing, not
// multiplying by a rounded 1/s, keeps any scale exact to the reference.
template <class T>
AF_HD T af_contribution(T grad, T weight, const Div<T>& grad_scale) {
  return af_div(grad * weight, grad_scale);
}

// acc <- c (overwrite) or acc + c.
template <class T>
AF_HD T af_accumulate(T acc, T grad, T weight, const Div<T>& grad_scale, bool overwrite) {
  const T c = af_contribution(grad, weight, grad_scale);
  return overwrite ? c : acc + c;
}

// The window gradient g = acc / W * clip (clip = 1 without clipping: exact), negated for maximize.
// acc / W is a true division, as the reference's `buf / weight_sum` (torch divides exactly).
template <class T>
AF_HD T af_window_grad(T acc, const Div<T>& weight_sum, T clip_coef, bool maximize) {
  const T g = af_div(acc, weight_sum) * clip_coef;
  return maximize ? af_neg(g) : g;
}

// ---------------------------------------------------------------------------- SGD
// Coefficients broadcast once per chunk (T = vector type) or once per thread (T = float).
template <class T>
struct SgdCoef {
  T weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_weight_decay, has_momentum, nesterov;
  SgdCoef() = default;
  AF_HD explicit SgdCoef(const SgdScalars& s)
      : weight_decay(s.weight_decay), momentum(s.momentum), one_minus_dampening(s.one_minus_dampening),
        neg_lr(s.neg_lr), has_weight_decay(s.has_weight_decay), has_momentum(s.has_momentum),
        nesterov(s.nesterov) {}
};

// torch.optim.SGD's single-tensor step on one element; `first`: the momentum buffer is new
// (b <- g, as `grad.clone()`), otherwise b <- momentum * b + (1 - dampening) * g.
template <class T>
AF_HD void af_sgd(T& param, T& momentum_buf, T grad, bool first, const SgdCoef<T>& k) {
  if (k.has_weight_decay) grad = af_fma(param, k.weight_decay, grad);  // grad.add(param, alpha=wd)
  if (k.has_momentum) {
    momentum_buf = first ? grad : af_fma(grad, k.one_minus_dampening, momentum_buf * k.momentum);
    grad = k.nesterov ? af_fma(momentum_buf, k.momentum, grad) : momentum_buf;
  }
  param = af_fma(grad, k.neg_lr, param);  // param.add_(grad, alpha=-lr)
}

// ---------------------------------------------------------------------------- Adam / AdamW
template <class T>
struct AdamCoef {
  T decay_factor, weight_decay, lerp_weight, lerp_weight_m1, beta2, one_minus_beta2, eps, neg_step_size;
  Div<T> bc2_sqrt;
  bool has_weight_decay, decoupled, amsgrad, lerp_small;
  AdamCoef() = default;
  AF_HD explicit AdamCoef(const AdamScalars& s)
      : decay_factor(s.decay_factor), weight_decay(s.weight_decay), lerp_weight(s.lerp_weight),
        lerp_weight_m1(s.lerp_weight - 1.0f), beta2(s.beta2), one_minus_beta2(s.one_minus_beta2),
        eps(s.eps), neg_step_size(s.neg_step_size), bc2_sqrt(af_divisor(s.bc2_sqrt)),
        has_weight_decay(s.has_weight_decay), decoupled(s.decoupled), amsgrad(s.amsgrad),
        lerp_small(fabsf(s.lerp_weight) < 0.5f) {}
};

// torch.optim.Adam(W)'s single-tensor step on one element, in three stages:
//   second = af_adam_moments(param, m, v, v_max, grad)   updates m, v, v_max
//   param  = af_adam_param(af_adam_decay(param), m, sqrt(second))
// `max_exp_avg_sq` is read and written only with amsgrad.
template <class T>
AF_HD T af_adam_moments(T param, T& exp_avg, T& exp_avg_sq, T& max_exp_avg_sq, T grad, const AdamCoef<T>& k) {
  if (k.has_weight_decay && !k.decoupled) grad = af_fma(param, k.weight_decay, grad);  // grad.add(param, alpha=wd)
  // exp_avg.lerp_(grad, w): torch's lerp, w < 0.5 ? m + w (g - m) : g - (1 - w)(g - m), fused.
  const T diff = grad - exp_avg;
  exp_avg = k.lerp_small ? af_fma(k.lerp_weight, diff, exp_avg) : af_fma(k.lerp_weight_m1, diff, grad);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  exp_avg_sq = af_fma(k.one_minus_beta2 * grad, grad, exp_avg_sq * k.beta2);
  if (!k.amsgrad) return exp_avg_sq;
  max_exp_avg_sq = af_max(max_exp_avg_sq, exp_avg_sq);
  return max_exp_avg_sq;
}

// param.mul_(1 - lr * wd) for AdamW (it does not feed the moments, so it may come last).
template <class T>
AF_HD T af_adam_decay(T param, const AdamCoef<T>& k) {
  return (k.has_weight_decay && k.decoupled) ? param * k.decay_factor : param;
}

// denom = sqrt(second) / sqrt(bias_correction2) + eps;
// param.addcdiv_(exp_avg, denom, value=-step_size): torch computes p + (value * m) / denom.
template <class T>
AF_HD T af_adam_param(T decayed_param, T exp_avg, T sqrt_second, const AdamCoef<T>& k) {
  const T denom = af_div(sqrt_second, k.bc2_sqrt) + k.eps;
  return decayed_param + k.neg_step_size * exp_avg / denom;
}

// The whole step, with a correctly rounded (IEEE) square root. torch's CPU sqrt for fp32 is
// MKL's vsSqrt where torch has MKL: within 1 ulp but not always correctly rounded (15% of random
// inputs differ, torch 2.13 x86-64), so on CPU Adam updates are within ~1 ulp of torch.optim's
// rather than bit-equal. Calling torch's sqrt per block instead was measured exact but slow: the
// AdamW k=8 window took 1.02x the native torch loop against 0.92x (2-core AMD EPYC).
template <class T>
AF_HD void af_adam(T& param, T& exp_avg, T& exp_avg_sq, T& max_exp_avg_sq, T grad, const AdamCoef<T>& k) {
  const T second = af_adam_moments(param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, k);
  param = af_adam_param(af_adam_decay(param, k), exp_avg, af_sqrt(second), k);
}

}  // namespace
}  // namespace accum_fused
