#include "gemm/cpu_gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <iterator>
#include <list>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>

#include "base/contiguous_shares.h"
#include "base/cpu_isa.h"
#include "base/thread_annotations.h"
#include "gemm/cpu/kernels.h"

namespace mlarun {
namespace {

using dnnl::memory;

memory::data_type ToDnnl(DType t) { return t == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32; }

dnnl::engine& CpuEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A prepared product depends on the description, the implementation asked
// for and the kernel family in force when it was prepared.
struct GemmKey {
  GemmDesc desc;
  GemmImpl impl;
  CpuIsa isa;
  bool bf16_dot;
  cpu::IntDotMode int_dot;
  bool onednn;
  friend bool operator==(const GemmKey&, const GemmKey&) = default;
};

struct KeyHash {
  size_t operator()(const GemmKey& key) const {
    const GemmDesc& d = key.desc;
    size_t h = 0x9e3779b97f4a7c15ull;
    auto mix = [&h](int64_t v) { h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(d.m), mix(d.n), mix(d.k), mix(d.lda), mix(d.b_stride_k), mix(d.b_stride_n), mix(d.ldc), mix(d.b_group);
    mix(static_cast<int64_t>(d.a_type) | static_cast<int64_t>(d.b_type) << 8 | static_cast<int64_t>(d.c_type) << 16 |
        static_cast<int64_t>(d.accumulate) << 24 | static_cast<int64_t>(key.impl) << 32 |
        static_cast<int64_t>(key.isa) << 40 | static_cast<int64_t>(key.bf16_dot) << 48 |
        static_cast<int64_t>(key.onednn) << 49 | static_cast<int64_t>(key.int_dot) << 50);
    return h;
  }
};

// Process-wide LRU of prepared products. Entries are shared_ptr so a plan that
// holds one keeps it alive after eviction.
class GemmCache {
 public:
  static constexpr size_t kCapacity = 4096;

  std::shared_ptr<const CpuGemm> Find(const GemmKey& k) {
    MutexLock lock(mutex_);
    auto it = map_.find(k);
    if (it == map_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->second;
  }
  void Insert(const GemmKey& k, std::shared_ptr<const CpuGemm> g) {
    MutexLock lock(mutex_);
    if (map_.count(k)) return;
    lru_.emplace_front(k, std::move(g));
    map_[k] = lru_.begin();
    if (lru_.size() > kCapacity) {
      map_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }

 private:
  using Entry = std::pair<GemmKey, std::shared_ptr<const CpuGemm>>;
  Mutex mutex_;
  std::list<Entry> lru_ MLARUN_GUARDED_BY(mutex_);  // most recent first
  std::unordered_map<GemmKey, std::list<Entry>::iterator, KeyHash> map_ MLARUN_GUARDED_BY(mutex_);
};

GemmCache& Cache() {
  static GemmCache cache;
  return cache;
}

std::atomic<int64_t> g_prepared{0};
std::atomic<bool> g_onednn_enabled{true};

// May oneDNN run this product under the kernel family in force (asked for
// by name, or chosen under AMX)? f32 from AVX2 up; bf16 only where the CPU
// has bf16 arithmetic (AVX512-BF16, AMX): elsewhere Debian's oneDNN 2.6
// cannot build one (AVX2) or would emulate it.
bool OneDnnAllowed(const GemmDesc& d) {
  if (!g_onednn_enabled.load(std::memory_order_relaxed)) return false;
  if (d.b_type == DType::kF8E4M3) return false;  // no block-scaled e4m3 in oneDNN 2.6
  if (IsIntWeight(d.b_type)) return false;       // nor group-scaled int8 / int4 with an fp32 A
  const CpuIsa isa = ActiveCpuIsa();
  if (d.a_type == DType::kF32) return isa >= CpuIsa::kAvx2;
  return isa == CpuIsa::kAmx || (isa == CpuIsa::kAvx512 && HostCpu().avx512_bf16);
}

// Products of bf16 weights on AMX: from kTilesFromRows rows on, the tile
// kernel (fewer: the AVX512-BF16 streaming kernels), up to where oneDNN's AMX
// product (which packs the weight) is faster. The tiles, one weight tile per
// pass (amx_tiles.inc), stream a weight from memory as fast as the dot
// products up to 6 rows and faster from 8, where the dot products and oneDNN
// are slower; against oneDNN on projection shapes they are faster at 64 rows
// and as fast or faster at 128-256, but slower with a long k (16384), on a
// weight of hundreds of MB (an lm_head) from 128 rows (the weight read once
// per band of A rows from memory), and at 512 rows. So k past kTilesMaxK
// takes tiles only up to two blocks of A rows (kTilesAnyKRows: A's tiles, at
// most 2 x 32 B per element of k, stay in L2 while the weight streams past
// once). Figures: docs/cpu-kernels.md, 'Kernel choices'.
constexpr int64_t kTilesFromRows = 7;
constexpr int64_t kTilesMaxK = 8192;
constexpr int64_t kTilesAnyKRows = 32;
// Columns below which packing A costs as much as the tile products save (the
// attention's score tiles over a few keys).
constexpr int64_t kTilesMinN = 128;
// Shapes whose tile products beat the other choices (given m >= kTilesFromRows).
bool TilesShape(const GemmDesc& d) { return (d.k <= kTilesMaxK || d.m <= kTilesAnyKRows) && d.n >= kTilesMinN; }
bool TilesFaster(const GemmDesc& d) {
  if (!TilesShape(d)) return false;
  return d.m <= 64 || (d.m <= 256 && d.n * d.k * 2 <= (int64_t{128} << 20));
}

// Can the packed dot kernel of family `k` run this product? bf16 x bf16, and
// fp32 x f8_e4m3 with A rounded to bf16 (the e4m3 codes are exact in bf16,
// their block scales applied per block of 128 of k).
bool PackedDotUsable(const cpu::CpuKernels& k, const GemmDesc& d) {
  const bool bf16 = d.a_type == DType::kBF16 && d.b_type == DType::kBF16;
  const bool fp8 = d.a_type == DType::kF32 && d.b_type == DType::kF8E4M3;
  return (bf16 || fp8) && k.gemm_packed_bf16_dot != nullptr && cpu::UseBf16Dot(k);
}
// bf16 products past the streaming kernels' rows on AVX512-BF16 without AMX:
// our packed dot-product kernel rather than oneDNN's brgemm, which allocates
// inside every call. Ours is as fast on the prefill and the attention's
// shapes, and as fast or faster over a whole prefill and a decode step
// (figures: docs/cpu-kernels.md, 'Kernel choices').
bool PackedDotPreferred(const GemmDesc& d) {
  return ActiveCpuIsa() == CpuIsa::kAvx512 && PackedDotUsable(cpu::Kernels(), d);
}
// Products of many rows that neither the streaming nor the tile kernels take
// go to oneDNN only where its product is the faster one: bf16 under AMX (its
// AMX product, several times our dot products' rate), and on AVX512-BF16 when
// our dot products are turned off. Everything else runs on our packed
// kernels, f32 included: as fast as oneDNN's f32 matmul on the prefill shapes
// under AVX-512 and AVX2, and oneDNN's execute allocates inside every call
// where ours allocates nothing (figures: docs/cpu-kernels.md,
// 'Kernel choices').
bool OneDnnPreferred(const GemmDesc& d) { return d.a_type == DType::kBF16 && !PackedDotPreferred(d); }

// Can our AMX tile kernel run this product under the family in force?
bool TilesAllowed(const GemmDesc& d) {
  return cpu::Kernels().gemm_tiles != nullptr && d.a_type == DType::kBF16 && d.b_type == DType::kBF16 &&
         d.b_stride_k == 1;
}

}  // namespace

// The limits where the streaming kernels stop being the faster choice
// (figures: docs/cpu-kernels.md, 'Kernel choices').
int64_t GemmSmallRowsLimit(const GemmDesc& d) {
  // f8_e4m3 B: our packed kernel is the alternative, as for bf16 without
  // oneDNN; the streaming kernels decode B once per group of rows. Where the
  // packed kernel has the bf16 dot products, as for bf16: batch-32 decode
  // was faster with them at 32 rows (figures: docs/cpu-kernels.md,
  // 'Kernel choices').
  if (d.b_type == DType::kF8E4M3) return PackedDotUsable(cpu::Kernels(), d) ? 16 : 32;
  // int8 / int4 B: decoding in registers against our packed kernel, which
  // decodes a panel once: under AVX2 even at 12-16 rows, the packed kernel
  // faster from 24; elsewhere as f8_e4m3, except where the packed int-dot
  // kernel runs AVX512-VNNI's dot products, which are faster from 24 rows
  // too (figures: docs/cpu-kernels.md, 'int8 and int4 weights'). The AVX2
  // limit was measured against fp32 panels for int8, before its packed
  // products took int16 activations on every family.
  if (IsIntWeight(d.b_type)) {
    const CpuIsa isa = ActiveCpuIsa();
    const bool vnni_packed =
        isa >= CpuIsa::kAvx512 && cpu::UseVnni() && cpu::UsePackedIntDot(cpu::Kernels(), d.b_type, d.k, d.b_group);
    return isa == CpuIsa::kAvx2 || vnni_packed ? 16 : 32;
  }
  // f32: against our packed kernel on a weight from memory, the streaming
  // kernels stay faster up to 32 rows under AVX-512 and up to 8 under AVX2
  // (AVX2's 16 registers hold a 4-row tile of sums).
  if (d.a_type == DType::kF32) {
    const CpuIsa isa = ActiveCpuIsa();
    return isa >= CpuIsa::kAvx512 ? 32 : isa == CpuIsa::kAvx2 ? 8 : 16;
  }
  if (TilesAllowed(d)) return TilesShape(d) ? kTilesFromRows - 1 : 16;
  // Our packed dot kernel (PackedDotPreferred): on a weight from memory the
  // streaming dot products are as fast up to 16 rows and slower from 24.
  if (PackedDotPreferred(d)) return 16;
  // bf16 without bf16 arithmetic: our packed kernel converts each panel of B
  // once and runs a 6 x 16 FMA tile under AVX2: on a weight from memory the
  // streaming kernels are faster up to 12 rows, about even to 20 and slower
  // from 24; with B n-contiguous (the folds) streaming is no slower up to 32.
  // AVX-512 without BF16 and SSE2: streaming stays faster up to 32.
  if (!OneDnnAllowed(d)) return ActiveCpuIsa() == CpuIsa::kAvx2 && d.b_stride_k == 1 ? 20 : 32;
  // B n-contiguous (the attention's folds through W_UK^T and W_UV) has no dot
  // products to use; on AMX oneDNN's product is as fast from 4 rows and
  // faster from 8.
  if (d.b_stride_n == 1 && ActiveCpuIsa() == CpuIsa::kAmx) return 4;
  return cpu::UseBf16Dot(cpu::Kernels()) ? 16 : 8;
}

namespace {

bool Always(const GemmDesc&) { return true; }
bool FewRows(const GemmDesc& d) { return d.m <= GemmSmallRowsLimit(d); }

// The errors of a request that forces an implementation where it cannot run.
Status TilesRefusal(const GemmDesc& d) {
  return InvalidArgumentError("the tile kernel needs the amx kernel family and bf16 A and B with B k-contiguous: ", d,
                              " under ", CpuIsaName(ActiveCpuIsa()));
}
Status OneDnnRefusal(const GemmDesc& d) {
  const std::string why = !OneDnnEnabled() ? std::string("oneDNN is turned off (MLARUN_ONEDNN=off)")
                                           : "not used for " + std::string(DTypeName(d.a_type)) + " products by the " +
                                                 std::string(CpuIsaName(ActiveCpuIsa())) + " kernel family";
  return InternalError("oneDNN cannot prepare ", d, ": ", why);
}

// One implementation and when it runs. The predicates read the kernel
// family and settings in force.
struct GemmImplEntry {
  GemmImpl impl;
  bool (*can_run)(const GemmDesc& d);
  bool (*preferred)(const GemmDesc& d);  // faster than the entries after it (kAuto)
  Status (*refusal)(const GemmDesc& d);  // the error where it cannot run (nullptr: it always can)
};

// The implementations in the order kAuto tries them, as oneDNN's
// cpu_matmul_list.cpp lists its own: it takes the first that can run and is
// preferred. Few rows stream; then our AMX tiles, where their shapes beat
// oneDNN's; oneDNN, where its product is the faster one; our packed kernel,
// last, can always run and is always preferred.
constexpr GemmImplEntry kGemmImpls[] = {
    {GemmImpl::kSmall, Always, FewRows, nullptr},
    {GemmImpl::kTiles, TilesAllowed, TilesFaster, TilesRefusal},
    {GemmImpl::kOneDnn, OneDnnAllowed, OneDnnPreferred, OneDnnRefusal},
    {GemmImpl::kPacked, Always, Always, nullptr},
};
static_assert(kGemmImpls[std::size(kGemmImpls) - 1].can_run == Always &&
                  kGemmImpls[std::size(kGemmImpls) - 1].preferred == Always,
              "kAuto must always find an implementation");

// The implementation of `d`: under kAuto the first entry of kGemmImpls that
// can run and is preferred; else `want`'s, where it can run.
StatusOr<GemmImpl> ChooseGemmImpl(const GemmDesc& d, GemmImpl want) {
  if (want == GemmImpl::kAuto) {
    for (const GemmImplEntry& e : kGemmImpls)
      if (e.can_run(d) && e.preferred(d)) return e.impl;
  }
  for (const GemmImplEntry& e : kGemmImpls)
    if (e.impl == want) return e.can_run(d) ? StatusOr<GemmImpl>(want) : e.refusal(d);
  return InvalidArgumentError("unknown GemmImpl value ", static_cast<int>(want));
}

// An int8 / int4 product's group scales into its kernel arguments, checked.
Status SetIntScales(const GemmDesc& d, const GemmBScales* b_scales, cpu::GemmArgs& g) {
  if (b_scales == nullptr || b_scales->scale == nullptr)
    return InvalidArgumentError("an ", DTypeName(d.b_type), " product needs its group scales: ", d);
  const int64_t groups = (d.k + d.b_group - 1) / d.b_group;
  if (b_scales->ld < groups || b_scales->row0 < 0)
    return InvalidArgumentError(DTypeName(d.b_type), " group scales with ld ", b_scales->ld,
                                " (< ceil(k / group) = ", groups, ") or row0 ", b_scales->row0, " < 0 for ", d);
  g.b_scale = b_scales->scale, g.b_scale_ld = b_scales->ld, g.b_row0 = b_scales->row0;
  g.b_offset = b_scales->offset, g.b_group = d.b_group, g.b_zero = b_scales->zero;
  return Status::Ok();
}

constexpr size_t kAlign = 64;
// An fp32 A of a packed product at most this wide is read from its rows, not
// rewritten into strips first: each strip would serve only n / NR column
// strips, and the rewrite costs a pass over A. Reading the rows was the
// faster up to a few hundred columns (the MoE's items); wider, strips were as
// fast or faster (figures: docs/cpu-kernels.md, 'Kernel choices').
constexpr int64_t kPackedARowsMaxN = 384;
// The tile kernel's column granularity: 4 tiles of 16 weight rows.
constexpr int64_t kTilesNAlign = 64;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

std::string_view GemmImplName(GemmImpl impl) {
  switch (impl) {
    case GemmImpl::kAuto:
      return "auto";
    case GemmImpl::kOneDnn:
      return "onednn";
    case GemmImpl::kSmall:
      return "small";
    case GemmImpl::kPacked:
      return "packed";
    case GemmImpl::kTiles:
      return "tiles";
  }
  return "invalid";
}

// Depth of oneDNN executions on this thread (CpuGemm::InOneDnnExecute).
thread_local int t_onednn_execute_depth = 0;

// The memory objects of one oneDNN execution: A, B, C and the scratchpad,
// made when the product is prepared and pointed at each call's buffers.
struct OneDnnArgs {
  std::atomic<bool> busy{false};
  memory m[4];
};

struct CpuGemm::Impl {
  // oneDNN.
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  memory::desc a_md, b_md, c_md, scratch_md;
  // One argument set per OpenMP thread (the threads of a parallel region
  // may run the same product at once: experts of one shape); a caller that
  // finds all of them busy makes its own.
  std::unique_ptr<OneDnnArgs[]> onednn_args;
  int onednn_arg_sets = 0;
  // Ours.
  const cpu::CpuKernels* kernels = nullptr;
  bool small_bt = false;        // kSmall over a k-contiguous B (else n-contiguous)
  bool bf16_dot = false;        // kSmall, kPacked: AVX512-BF16 dot products on bf16 A as it is
  bool int_dot = false;         // kSmall, kPacked: int B, A rounded to int8 (cpu::UseIntDot)
  size_t a_f32_bytes = 0;       // kSmall with a bf16 A: A widened into scratch first
  size_t c_f32_bytes = 0;       // a bf16 C kPacked cannot round once: fp32 C in scratch, rounded after
  size_t thread_bytes = 0;      // kPacked: packing buffers per thread
  size_t a_prepared_bytes = 0;  // kTiles, kPacked: A rewritten into the kernel's layout first
  bool a_rows = false;          // kPacked with an fp32 A of few columns: A read from its rows
  int threads = 1;              // threads the scratch was sized for

  std::string PrepareOneDnn(const GemmDesc& d, CpuGemm& g);
  void PrepareOwn(const GemmDesc& d, GemmImpl chosen, CpuGemm& g);
};

std::ostream& operator<<(std::ostream& os, const GemmDesc& d) {
  return os << "gemm{m=" << d.m << " n=" << d.n << " k=" << d.k << " types=" << DTypeName(d.a_type) << "x"
            << DTypeName(d.b_type) << "->" << DTypeName(d.c_type) << " lda=" << d.lda << " b_strides=(" << d.b_stride_k
            << "," << d.b_stride_n << ") ldc=" << d.ldc << (d.accumulate ? " +=" : "")
            << (IsIntWeight(d.b_type) ? " group=" + std::to_string(d.b_group) : std::string()) << "}";
}

Status ValidateGemmDesc(const GemmDesc& d) {
  if (d.m <= 0 || d.n <= 0 || d.k <= 0) return InvalidArgumentError("non-positive size in ", d);
  const bool fp8 = d.a_type == DType::kF32 && d.b_type == DType::kF8E4M3;
  const bool int_b = d.a_type == DType::kF32 && IsIntWeight(d.b_type);
  if (!fp8 && !int_b && (d.a_type != d.b_type || (d.a_type != DType::kF32 && d.a_type != DType::kBF16)))
    return InvalidArgumentError("unsupported operand types in ", d,
                                " (both f32, both bf16, or f32 x f8_e4m3, int8 or int4)");
  if ((fp8 || int_b) && !(d.b_stride_k == 1 && d.b_stride_n >= d.k))
    return InvalidArgumentError("an ", DTypeName(d.b_type),
                                " B must have k contiguous (b_stride_k == 1: a weight [n, k]) in ", d);
  if (int_b && (d.b_group <= 0 || d.b_group % 2 != 0))
    return InvalidArgumentError("an ", DTypeName(d.b_type), " B needs a positive even group size (b_group) in ", d);
  if (d.b_type == DType::kInt4 && d.b_stride_n % 2 != 0)
    return InvalidArgumentError("an int4 B's rows must start on a byte (b_stride_n even) in ", d);
  if (d.c_type != DType::kF32 && d.c_type != DType::kBF16)
    return InvalidArgumentError("unsupported result type in ", d);
  if (d.accumulate && d.c_type != DType::kF32) return InvalidArgumentError("accumulation needs an f32 result in ", d);
  if (d.lda < d.k) return InvalidArgumentError("lda < k in ", d);
  if (d.ldc < d.n) return InvalidArgumentError("ldc < n in ", d);
  const bool b_row_major = d.b_stride_n == 1 && d.b_stride_k >= d.n;
  const bool b_col_major = d.b_stride_k == 1 && d.b_stride_n >= d.k;
  if (!b_row_major && !b_col_major) return InvalidArgumentError("B strides are neither row- nor column-major in ", d);
  return Status::Ok();
}

CpuGemm::CpuGemm(const GemmDesc& desc) : desc_(desc) {}
CpuGemm::~CpuGemm() = default;

int64_t CpuGemm::PreparedCount() { return g_prepared.load(); }

void SetOneDnnEnabled(bool enabled) { g_onednn_enabled.store(enabled); }
bool OneDnnEnabled() { return g_onednn_enabled.load(std::memory_order_relaxed); }

// Builds oneDNN's product into this Impl and names it in `g`; returns
// oneDNN's error, or "" when it built one.
std::string CpuGemm::Impl::PrepareOneDnn(const GemmDesc& d, CpuGemm& g) {
  try {
    a_md = memory::desc({d.m, d.k}, ToDnnl(d.a_type), {d.lda, 1});
    b_md = memory::desc({d.k, d.n}, ToDnnl(d.b_type), {d.b_stride_k, d.b_stride_n});
    c_md = memory::desc({d.m, d.n}, ToDnnl(d.c_type), {d.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (d.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.f);
      attr.set_post_ops(ops);
    }
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, CpuEngine());
    prim = dnnl::matmul(pd);
    scratch_md = pd.scratchpad_desc();
    onednn_arg_sets = std::max(1, omp_get_max_threads());
    onednn_args = std::make_unique<OneDnnArgs[]>(static_cast<size_t>(onednn_arg_sets));
    const memory::desc* mds[4] = {&a_md, &b_md, &c_md, &scratch_md};
    for (int s = 0; s < onednn_arg_sets; ++s)
      for (int i = 0; i < 4; ++i) onednn_args[s].m[i] = memory(*mds[i], CpuEngine(), nullptr);
    g.scratch_bytes_ = scratch_md.get_size();
    g.impl_name_ = std::string("onednn:") + pd.impl_info_str();
  } catch (const dnnl::error& e) {
    return e.what();
  }
  return "";
}

// Sizes the scratch of our kernel `chosen` (kSmall, kPacked or kTiles) for
// `d` under the family in force, and names it in `g`.
void CpuGemm::Impl::PrepareOwn(const GemmDesc& d, GemmImpl chosen, CpuGemm& g) {
  kernels = &cpu::Kernels();
  const cpu::CpuKernels& k = *kernels;
  threads = std::max(1, omp_get_max_threads());
  if (chosen == GemmImpl::kTiles) {
    a_prepared_bytes = AlignUp(k.tiles_prepared_a_bytes(d.m, d.k));
    g.impl_name_ = "tiles:" + std::string(CpuIsaName(k.isa));
  } else if (chosen == GemmImpl::kSmall) {
    small_bt = d.b_stride_k == 1;
    bf16_dot = small_bt && d.a_type == DType::kBF16 && cpu::UseBf16Dot(k);
    int_dot = small_bt && cpu::UseIntDot(k.isa, d.b_type, d.k, d.b_group);
    // small_bt reads A in a layout of its own (the dot kernel: bf16 A as it
    // is); small_bn reads fp32 A.
    if (int_dot)
      a_f32_bytes = AlignUp(k.int_dot_prepared_a_bytes(d.m, d.k, d.b_group));
    else if (!bf16_dot && (small_bt || d.a_type == DType::kBF16))
      a_f32_bytes =
          AlignUp(static_cast<size_t>(cpu::SmallBtPreparedAFloats(d.m, d.k, d.b_type, d.b_group)) * sizeof(float));
    g.impl_name_ = std::string(bf16_dot   ? "small_bt_dpbf16:"
                               : int_dot  ? "small_bt_int8a:"
                               : small_bt ? "small_bt:"
                                          : "small_bn:") +
                   std::string(CpuIsaName(k.isa));
  } else if (cpu::UsePackedIntDot(k, d.b_type, d.k, d.b_group)) {  // A rounded and shared; C written once, in any dtype
    int_dot = true;
    thread_bytes = AlignUp(k.packed_int_dot_scratch_bytes(d.k, d.b_group, d.b_type));
    a_prepared_bytes = AlignUp(k.packed_int_dot_prepared_a_bytes(d.m, d.k, d.b_group, d.b_type));
    g.impl_name_ = (d.b_type == DType::kInt8 ? "packed_int16a:" : "packed_int8a:") + std::string(CpuIsaName(k.isa));
  } else {
    const bool c_via_f32 = d.c_type == DType::kBF16 && d.k > k.packed_max_k_bf16_c;
    if (c_via_f32) c_f32_bytes = AlignUp(static_cast<size_t>(d.m * d.n) * sizeof(float));
    // Any thread may draw any chunk of columns (RunOwn), up to all of them;
    // the kernel's panels bound what that needs.
    thread_bytes = AlignUp(k.packed_scratch_bytes(d.m, d.n, d.k, d.c_type == DType::kBF16 && !c_via_f32));
    bf16_dot = PackedDotUsable(k, d);
    a_rows = !bf16_dot && d.a_type == DType::kF32 && d.n <= kPackedARowsMaxN;
    if (!a_rows)
      a_prepared_bytes = AlignUp((bf16_dot ? k.packed_dot_prepared_a_bytes : k.packed_prepared_a_bytes)(d.m, d.k));
    g.impl_name_ = std::string(bf16_dot ? "packed_dpbf16:" : "packed:") + std::string(CpuIsaName(k.isa));
  }
  g.scratch_bytes_ = a_f32_bytes + a_prepared_bytes + c_f32_bytes + static_cast<size_t>(threads) * thread_bytes;
  if (g.scratch_bytes_ > 0) g.scratch_bytes_ += kAlign;  // RunOwn aligns the start
}

StatusOr<std::shared_ptr<const CpuGemm>> CpuGemm::Get(const GemmDesc& d, GemmImpl want) {
  const GemmKey key{d, want, ActiveCpuIsa(), cpu::UseBf16Dot(cpu::Kernels()), cpu::GetIntDotMode(), OneDnnEnabled()};
  if (auto hit = Cache().Find(key)) return hit;
  MLARUN_RETURN_IF_ERROR(ValidateGemmDesc(d));
  MLARUN_ASSIGN_OR_RETURN(GemmImpl chosen, ChooseGemmImpl(d, want));
  std::shared_ptr<CpuGemm> g(new CpuGemm(d));
  auto impl = std::make_unique<Impl>();
  if (chosen == GemmImpl::kOneDnn) {
    const std::string onednn_error = impl->PrepareOneDnn(d, *g);
    if (!onednn_error.empty()) {
      if (want == GemmImpl::kOneDnn) return InternalError("oneDNN cannot prepare ", d, ": ", onednn_error);
      chosen = GemmImpl::kPacked;  // kAuto: ours, the table's last entry
    }
  }
  if (chosen != GemmImpl::kOneDnn) impl->PrepareOwn(d, chosen, *g);
  g->kind_ = chosen;
  g->impl_ = std::move(impl);
  ++g_prepared;
  Cache().Insert(key, g);
  return std::shared_ptr<const CpuGemm>(std::move(g));
}

Status CpuGemm::RunOwn(const void* a, const void* b, void* c, void* scratch, const GemmBScales* b_scales) const {
  const Impl& im = *impl_;
  const cpu::CpuKernels& k = *im.kernels;
  const GemmDesc& d = desc_;
  // Our layouts start on a cache line (the tile kernel's staging buffer
  // especially); scratch_bytes() leaves room for the adjustment.
  std::byte* s = static_cast<std::byte*>(scratch);
  s += (kAlign - reinterpret_cast<uintptr_t>(s) % kAlign) % kAlign;
  cpu::GemmArgs g{.m = d.m,
                  .n = d.n,
                  .k = d.k,
                  .a = a,
                  .a_type = d.a_type,
                  .lda = d.lda,
                  .b = b,
                  .b_type = d.b_type,
                  .b_stride_k = d.b_stride_k,
                  .b_stride_n = d.b_stride_n,
                  .c = c,
                  .c_type = d.c_type,
                  .ldc = d.ldc,
                  .accumulate = d.accumulate};
  if (d.b_type == DType::kF8E4M3) {
    if (b_scales == nullptr || b_scales->scale == nullptr)
      return InvalidArgumentError("an f8_e4m3 product needs its block scales: ", d);
    if (b_scales->ld < (d.k + 127) / 128 || b_scales->row0 < 0)
      return InvalidArgumentError("f8_e4m3 block scales with ld ", b_scales->ld,
                                  " (< ceil(k / 128) = ", (d.k + 127) / 128, ") or row0 ", b_scales->row0, " < 0 for ",
                                  d);
    g.b_scale = b_scales->scale, g.b_scale_ld = b_scales->ld, g.b_row0 = b_scales->row0;
  }
  if (IsIntWeight(d.b_type)) MLARUN_RETURN_IF_ERROR(SetIntScales(d, b_scales, g));
  if (im.a_f32_bytes > 0) {  // the streaming kernels read fp32 A rows
    auto* af = reinterpret_cast<float*>(s);
    if (im.int_dot) {
      k.small_bt_int_dot_prepare_a(g, af);
    } else if (im.small_bt) {
      k.small_bt_prepare_a(g, af);
    } else {
      for (int64_t i = 0; i < d.m; ++i) k.bf16_to_f32(static_cast<const bf16_t*>(a) + i * d.lda, af + i * d.k, d.k);
    }
    g.a = af, g.a_type = DType::kF32, g.lda = d.k;
    s += im.a_f32_bytes;
  }
  g.a_rows = im.a_rows;
  if (im.a_prepared_bytes > 0) {  // the kernel reads A in its own layout
    if (kind_ == GemmImpl::kTiles) {
      k.tiles_prepare_a(g, s);
    } else if (im.int_dot) {  // rows of A rounded, shared out when there are many
      const int64_t per = 16;
      const int prep_threads = std::min(im.threads, omp_get_max_threads());
#pragma omp parallel for schedule(static) num_threads(prep_threads) if (d.m > per && !omp_in_parallel())
      for (int64_t r0 = 0; r0 < d.m; r0 += per) k.packed_int_dot_prepare_a(g, r0, std::min(d.m, r0 + per), s);
    } else {  // the packed kernels' strips of rows, shared out when there are many
      const auto prepare = im.bf16_dot ? k.packed_dot_prepare_a : k.packed_prepare_a;
      const int64_t mr = im.bf16_dot ? k.packed_dot_mr : k.packed_mr;
      const int64_t strips = (d.m + mr - 1) / mr, per = 8;
      const int prep_threads = std::min(im.threads, omp_get_max_threads());
#pragma omp parallel for schedule(static) num_threads(prep_threads) if (strips > per && !omp_in_parallel())
      for (int64_t s0 = 0; s0 < strips; s0 += per) prepare(g, s0, std::min(strips, s0 + per), s);
    }
    g.a = s;
    s += im.a_prepared_bytes;
  }
  float* c_f32 = nullptr;
  if (im.c_f32_bytes > 0) {
    c_f32 = reinterpret_cast<float*>(s);
    g.c = c_f32, g.c_type = DType::kF32, g.ldc = d.n, g.accumulate = false;
    s += im.c_f32_bytes;
  }
  const bool packed = kind_ == GemmImpl::kPacked;
  const bool tiles = kind_ == GemmImpl::kTiles;
  auto part = [&](int t, int64_t n0, int64_t n1) {
    if (n0 >= n1) return;
    if (tiles) {
      k.gemm_tiles(g, n0, n1);
    } else if (!packed) {
      (im.bf16_dot   ? k.gemm_small_bt_bf16_dot
       : im.int_dot  ? k.gemm_small_bt_int_dot
       : im.small_bt ? k.gemm_small_bt
                     : k.gemm_small_bn)(g, n0, n1);
    } else {
      (im.bf16_dot  ? k.gemm_packed_bf16_dot
       : im.int_dot ? k.gemm_packed_int_dot
                    : k.gemm_packed)(g, n0, n1, s + static_cast<size_t>(t) * im.thread_bytes);
    }
  };
  // The streaming kernels: one contiguous share of the columns per thread,
  // taken front to back, so each reads one long sequential run of B (every
  // new run starts the prefetchers cold: handing out chunks as threads finish
  // measured slower; figures: docs/cpu-kernels.md, 'Kernel choices'); a
  // thread done with its share takes half of what is left of a slower one's,
  // from its back (ContiguousShares). The packed kernel, bound by arithmetic:
  // chunks of whole panels handed out as threads finish. Inside a parallel
  // region the calling thread does it all.
  const int threads = omp_in_parallel() ? 1 : std::min(im.threads, omp_get_max_threads());
  const int64_t align = tiles ? kTilesNAlign : k.n_align;
  const int64_t strips = (d.n + align - 1) / align;
  if (threads <= 1 || strips <= 1) {
    part(0, 0, d.n);
  } else if (!packed) {
    ContiguousShares shares(strips, threads, strips / (64 * threads));
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      shares.Run(t, [&](int64_t s0, int64_t s1) { part(t, std::min(d.n, s0 * align), std::min(d.n, s1 * align)); });
    }
  } else {
    // A is prepared once and shared, so small chunks cost only the
    // scheduling and even out the threads (18 strips in 9 chunks of 2 left
    // one thread 10% idle).
    const int64_t per_chunk = std::max<int64_t>(1, strips / (16 * threads));
    const int64_t chunks = (strips + per_chunk - 1) / per_chunk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c)
      part(omp_get_thread_num(), std::min(d.n, c * per_chunk * k.n_align),
           std::min(d.n, (c + 1) * per_chunk * k.n_align));
  }
  if (c_f32 != nullptr)
    for (int64_t i = 0; i < d.m; ++i) k.f32_to_bf16(c_f32 + i * d.n, static_cast<bf16_t*>(c) + i * d.ldc, d.n);
  return Status::Ok();
}

bool CpuGemm::InOneDnnExecute() { return t_onednn_execute_depth > 0; }

Status CpuGemm::Run(const void* a, const void* b, void* c, void* scratch, const GemmBScales* b_scales) const {
  if (kind_ != GemmImpl::kOneDnn) return RunOwn(a, b, c, scratch, b_scales);
  Impl& im = *impl_;
  // A CPU stream only records the engine; keep one per thread so concurrent
  // callers never share one.
  thread_local dnnl::stream stream(CpuEngine());
  // A free argument set of this product: a call makes no memory objects (and
  // so allocates nothing outside oneDNN's execute); only a caller that finds
  // every set busy makes its own below.
  OneDnnArgs* set = nullptr;
  for (int i = 0; i < im.onednn_arg_sets && set == nullptr; ++i) {
    OneDnnArgs& s = im.onednn_args[static_cast<size_t>(i)];
    if (!s.busy.load(std::memory_order_relaxed) && !s.busy.exchange(true, std::memory_order_acquire)) set = &s;
  }
  OneDnnArgs own;  // every set busy: this call's own
  if (set == nullptr) set = &own;
  void* const handles[4] = {const_cast<void*>(a), const_cast<void*>(b), c, scratch};
  const memory::desc* const mds[4] = {&im.a_md, &im.b_md, &im.c_md, &im.scratch_md};
  Status st;
  try {
    for (int i = 0; i < 4; ++i) {
      if (set->m[i])
        set->m[i].set_data_handle(handles[i]);
      else
        set->m[i] = memory(*mds[i], CpuEngine(), handles[i]);
    }
    // The C API takes the arguments as an array: the C++ one builds a hash
    // map of them per call.
    const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, set->m[0].get()},
                                     {DNNL_ARG_WEIGHTS, set->m[1].get()},
                                     {DNNL_ARG_DST, set->m[2].get()},
                                     {DNNL_ARG_SCRATCHPAD, set->m[3].get()}};
    ++t_onednn_execute_depth;
    const dnnl_status_t rc = dnnl_primitive_execute(im.prim.get(), stream.get(), 4, args);
    --t_onednn_execute_depth;
    if (rc != dnnl_success) st = InternalError("oneDNN failed to run ", desc_, ": status ", static_cast<int>(rc));
  } catch (const dnnl::error& e) {
    st = InternalError("oneDNN failed to run ", desc_, ": ", e.what());
  }
  if (set != &own) set->busy.store(false, std::memory_order_release);
  return st;
}

}  // namespace mlarun
