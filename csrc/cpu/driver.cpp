#include "driver.h"

#include <ATen/Functions.h>
#include <ATen/Version.h>

#include <cmath>
#include <string>

namespace accum_fused::cpu {
namespace {

struct PlanStorage {
  std::vector<Chunk> chunks;
  std::vector<int64_t> task_begin;
  Plan plan{};
};

// Tasks per thread below which at::parallel_for stays serial (every plan's).
constexpr int64_t kTaskGrain = kCpuSerialElems / kCpuTaskElems > 1 ? kCpuSerialElems / kCpuTaskElems : 1;

// Lays the tensors end to end, each padded to a multiple of kCpuAlign elements, and cuts the
// line into tasks of kCpuTaskElems; every task's range is cut again at tensor boundaries.
// Tasks are equally large, and at::parallel_for hands each thread an equal run of them.
PlanStorage make_plan(const std::vector<TensorEntry>& tensors) {
  PlanStorage s;
  int64_t offset = 0;  // start of the current tensor on the padded line
  s.task_begin.push_back(0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t numel = tensors[i].numel;
    int64_t begin = 0;
    while (begin < numel) {
      const int64_t task = (offset + begin) / kCpuTaskElems;
      while (static_cast<int64_t>(s.task_begin.size()) <= task) {
        s.task_begin.push_back(static_cast<int64_t>(s.chunks.size()));
      }
      const int64_t end = std::min(numel, (task + 1) * kCpuTaskElems - offset);
      s.chunks.push_back({static_cast<int64_t>(i), begin, end});
      begin = end;
    }
    offset += (numel + kCpuAlign - 1) / kCpuAlign * kCpuAlign;
  }
  s.task_begin.push_back(static_cast<int64_t>(s.chunks.size()));
  s.plan.tensors = tensors.data();
  s.plan.num_tensors = static_cast<int64_t>(tensors.size());
  s.plan.chunks = s.chunks.data();
  s.plan.num_chunks = static_cast<int64_t>(s.chunks.size());
  s.plan.task_begin = s.task_begin.data();
  s.plan.num_tasks = static_cast<int64_t>(s.task_begin.size()) - 1;
  s.plan.grain = kTaskGrain;
  return s;
}

const Kernels& select() {
  static const Kernels* chosen = [] {
    // Follow torch's own choice (it honours ATEN_CPU_CAPABILITY), so both round alike.
    // AVX2+FMA for torch's AVX512 too: the same roundings, and no faster for these memory- and
    // divide-bound loops on the CPU measured (AMD EPYC Zen 4: 0.50 ns/element either way).
    const std::string cap = at::get_cpu_capability();
    const bool avx2 = cap == "AVX2" || cap == "AVX512";
    return (avx2 && AVX2::kernels_ptr != nullptr) ? AVX2::kernels_ptr : &DEFAULT::kernels;
  }();
  return *chosen;
}

// Per-tensor norms from per-chunk sums of squares, summed in chunk order (deterministic).
void reduce_norms(const PlanStorage& s, size_t num_tensors, const std::vector<double>& partials, float* norms_out) {
  std::vector<double> sums(num_tensors, 0.0);
  for (size_t c = 0; c < s.chunks.size(); ++c) sums[s.chunks[c].tensor] += partials[c];
  for (size_t i = 0; i < num_tensors; ++i) norms_out[i] = static_cast<float>(std::sqrt(sums[i]));
}

}  // namespace

const char* kernel_variant() { return select().name; }

void accumulate(const std::vector<TensorEntry>& tensors, DType grad_dtype, AccumScalars accum, float grad_scale,
                float norm_weight_sum, float* norms_out) {
  const PlanStorage s = make_plan(tensors);
  std::vector<double> partials(norms_out ? s.chunks.size() : 0);
  select().accumulate(s.plan, grad_dtype, accum, grad_scale, norm_weight_sum, norms_out ? partials.data() : nullptr);
  if (norms_out) reduce_norms(s, tensors.size(), partials, norms_out);
}

void accumulate_one(const TensorEntry& tensor, DType grad_dtype, AccumScalars accum, float grad_scale,
                    float norm_weight_sum, float* norm_out) {
  if (tensor.numel > kCpuTaskElems) {  // several tasks: make_plan's
    accumulate({tensor}, grad_dtype, accum, grad_scale, norm_weight_sum, norm_out);
    return;
  }
  // make_plan's plan of one tensor of at most one task: one chunk, [0, numel) (none if empty).
  const Chunk chunk{0, 0, tensor.numel};
  const int64_t task_begin[2] = {0, tensor.numel > 0 ? 1 : 0};
  Plan plan{};
  plan.tensors = &tensor;
  plan.num_tensors = 1;
  plan.chunks = &chunk;
  plan.num_chunks = task_begin[1];
  plan.task_begin = task_begin;
  plan.num_tasks = task_begin[1];
  plan.grain = kTaskGrain;
  double partial = 0.0;
  select().accumulate(plan, grad_dtype, accum, grad_scale, norm_weight_sum, norm_out ? &partial : nullptr);
  if (norm_out) *norm_out = static_cast<float>(std::sqrt(partial));  // (reduce_norms of one chunk)
}

void window_norms(const std::vector<TensorEntry>& tensors, float weight_sum, float* norms_out) {
  const PlanStorage s = make_plan(tensors);
  std::vector<double> partials(s.chunks.size());
  select().window_norms(s.plan, weight_sum, partials.data());
  reduce_norms(s, tensors.size(), partials, norms_out);
}

void sgd_update(const std::vector<TensorEntry>& tensors, DType param_dtype, const FoldScalars& fold,
                WindowScalars window, float clip_coef, const SgdScalars& sgd) {
  const PlanStorage s = make_plan(tensors);
  select().sgd(s.plan, param_dtype, fold, window, clip_coef, sgd);
}

void adam_update(const std::vector<TensorEntry>& tensors, DType param_dtype, const FoldScalars& fold,
                 WindowScalars window, float clip_coef, const AdamScalars& adam) {
  const PlanStorage s = make_plan(tensors);
  select().adam(s.plan, param_dtype, fold, window, clip_coef, adam);
}

}  // namespace accum_fused::cpu
