#include "runtime/base/cpu_gemm.h"

#include <atomic>
#include <functional>
#include <list>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>

namespace mlarun {
namespace {

using dnnl::memory;

memory::data_type ToDnnl(DType t) {
  return t == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
}

dnnl::engine& CpuEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct DescHash {
  size_t operator()(const GemmDesc& d) const {
    size_t h = 0x9e3779b97f4a7c15ull;
    auto mix = [&h](int64_t v) { h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(d.m), mix(d.n), mix(d.k), mix(d.lda), mix(d.b_stride_k), mix(d.b_stride_n), mix(d.ldc);
    mix(static_cast<int64_t>(d.a_type) | static_cast<int64_t>(d.b_type) << 8 |
        static_cast<int64_t>(d.c_type) << 16 | static_cast<int64_t>(d.accumulate) << 24);
    return h;
  }
};

// Process-wide LRU of prepared products. Entries are shared_ptr so a plan that
// holds one keeps it alive after eviction.
class GemmCache {
 public:
  static constexpr size_t kCapacity = 4096;

  std::shared_ptr<const CpuGemm> Find(const GemmDesc& d) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(d);
    if (it == map_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->second;
  }
  void Insert(const GemmDesc& d, std::shared_ptr<const CpuGemm> g) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (map_.count(d)) return;
    lru_.emplace_front(d, std::move(g));
    map_[d] = lru_.begin();
    if (lru_.size() > kCapacity) {
      map_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }

 private:
  using Entry = std::pair<GemmDesc, std::shared_ptr<const CpuGemm>>;
  std::mutex mutex_;
  std::list<Entry> lru_;  // GUARDED_BY(mutex_), most recent first
  std::unordered_map<GemmDesc, std::list<Entry>::iterator, DescHash> map_;  // GUARDED_BY(mutex_)
};

GemmCache& Cache() {
  static GemmCache cache;
  return cache;
}

std::atomic<int64_t> g_prepared{0};

}  // namespace

struct CpuGemm::Impl {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  memory::desc a_md, b_md, c_md, scratch_md;
};

std::ostream& operator<<(std::ostream& os, const GemmDesc& d) {
  return os << "gemm{m=" << d.m << " n=" << d.n << " k=" << d.k << " types=" << DTypeName(d.a_type) << "x"
            << DTypeName(d.b_type) << "->" << DTypeName(d.c_type) << " lda=" << d.lda
            << " b_strides=(" << d.b_stride_k << "," << d.b_stride_n << ") ldc=" << d.ldc
            << (d.accumulate ? " +=" : "") << "}";
}

Status ValidateGemmDesc(const GemmDesc& d) {
  if (d.m <= 0 || d.n <= 0 || d.k <= 0) return InvalidArgumentError("non-positive size in ", d);
  if (d.a_type != d.b_type || (d.a_type != DType::kF32 && d.a_type != DType::kBF16))
    return InvalidArgumentError("unsupported operand types in ", d, " (both f32 or both bf16)");
  if (d.c_type != DType::kF32 && d.c_type != DType::kBF16)
    return InvalidArgumentError("unsupported result type in ", d);
  if (d.accumulate && d.c_type != DType::kF32)
    return InvalidArgumentError("accumulation needs an f32 result in ", d);
  if (d.lda < d.k) return InvalidArgumentError("lda < k in ", d);
  if (d.ldc < d.n) return InvalidArgumentError("ldc < n in ", d);
  const bool b_row_major = d.b_stride_n == 1 && d.b_stride_k >= d.n;
  const bool b_col_major = d.b_stride_k == 1 && d.b_stride_n >= d.k;
  if (!b_row_major && !b_col_major) return InvalidArgumentError("B strides are neither row- nor column-major in ", d);
  return Status::Ok();
}

CpuGemm::CpuGemm(const GemmDesc& desc) : desc_(desc) {}
CpuGemm::~CpuGemm() = default;

const char* CpuGemm::impl_name() const { return impl_->pd.impl_info_str(); }

int64_t CpuGemm::PreparedCount() { return g_prepared.load(); }

StatusOr<std::shared_ptr<const CpuGemm>> CpuGemm::Get(const GemmDesc& d) {
  if (auto hit = Cache().Find(d)) return hit;
  MLARUN_RETURN_IF_ERROR(ValidateGemmDesc(d));
  std::shared_ptr<CpuGemm> g(new CpuGemm(d));
  try {
    auto impl = std::make_unique<Impl>();
    impl->a_md = memory::desc({d.m, d.k}, ToDnnl(d.a_type), {d.lda, 1});
    impl->b_md = memory::desc({d.k, d.n}, ToDnnl(d.b_type), {d.b_stride_k, d.b_stride_n});
    impl->c_md = memory::desc({d.m, d.n}, ToDnnl(d.c_type), {d.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (d.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.f);
      attr.set_post_ops(ops);
    }
    impl->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(impl->a_md, impl->b_md, impl->c_md), attr,
                                            CpuEngine());
    impl->prim = dnnl::matmul(impl->pd);
    impl->scratch_md = impl->pd.scratchpad_desc();
    g->scratch_bytes_ = impl->scratch_md.get_size();
    g->impl_ = std::move(impl);
  } catch (const dnnl::error& e) {
    return InternalError("oneDNN cannot prepare ", d, ": ", e.what());
  }
  ++g_prepared;
  Cache().Insert(d, g);
  return std::shared_ptr<const CpuGemm>(std::move(g));
}

Status CpuGemm::Run(const void* a, const void* b, void* c, void* scratch) const {
  // A CPU stream only records the engine; keep one per thread so concurrent
  // callers never share one.
  thread_local dnnl::stream stream(CpuEngine());
  try {
    memory am(impl_->a_md, CpuEngine(), const_cast<void*>(a));
    memory bm(impl_->b_md, CpuEngine(), const_cast<void*>(b));
    memory cm(impl_->c_md, CpuEngine(), c);
    memory sm(impl_->scratch_md, CpuEngine(), scratch);
    impl_->prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm},
                                 {DNNL_ARG_SCRATCHPAD, sm}});
  } catch (const dnnl::error& e) {
    return InternalError("oneDNN failed to run ", desc_, ": ", e.what());
  }
  return Status::Ok();
}

}  // namespace mlarun
