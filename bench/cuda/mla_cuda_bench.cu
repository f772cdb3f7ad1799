// mla_cuda_bench: the CUDA absorbed MLA decode against the GPU's own
// reference figures.
//   (a) device copy bandwidth: cudaMemcpy D2D of 1 GiB, read + write bytes
//       over the median time;
//   (b) cuBLAS bf16 GEMM (fp32 compute) at 8192^3, TFLOP/s;
//   (c) MlaRun (absorbed path, DeepSeek-V3 shapes: h_q 128 and 16, L 512,
//       R 64, bf16 cache in 64-row pages, q_len 1) over batch x context, as
//       a whole and the split decode kernel alone; median of 20 timed runs
//       (cudaEvents) after 3 warm-up runs. GB/s counts the bytes that must
//       move at least once (every cache row once, queries and outputs),
//       TFLOP/s the attention's FLOPs (MlaAbsorbedFlops for the whole call;
//       the QK^T and PV products for the kernel); "of_copy" is GB/s over (a).
// Every run's outputs are checked finite before timing (the parity with the
// CPU backend is mla_cuda_test's).
//
// Usage: mla_cuda_bench [--quick] [--json FILE]
// --quick: batch {1, 16, 128} x context {4096}. Without a GPU: exits 77.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/cuda/mla_cuda.h"
#include "attention/mla.h"
#include "base/cuda/cuda_check.h"
#include "base/cuda_device.h"
#include "base/device_memory.h"
#include "base/workspace.h"
#include "gemm/cuda/cublas.h"

namespace mlarun {
namespace {

// Deterministic pseudo-random values in [-scale, scale) by index (a hash,
// so filling gigabytes takes one kernel).
__device__ inline float HashUniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 2.f - 1.f;
}

template <typename T>
__global__ void FillKernel(T* dst, uint64_t n, uint64_t seed, float scale) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float v = HashUniform(i, seed) * scale;
    if constexpr (std::is_same_v<T, float>) {
      dst[i] = v;
    } else {
      dst[i] = __float2bfloat16_rn(v);
    }
  }
}

template <typename T>
Status Fill(T* dst, uint64_t n, uint64_t seed, float scale) {
  FillKernel<T><<<1024, 256>>>(dst, n, seed, scale);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("FillKernel");
  return Status::Ok();
}

struct Timer {
  cudaEvent_t a = nullptr, b = nullptr;
  Status Create() {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b));
    return Status::Ok();
  }
  ~Timer() {
    if (a != nullptr) cudaEventDestroy(a);
    if (b != nullptr) cudaEventDestroy(b);
  }
};

// Median milliseconds of `reps` timed calls of f after `warmup` untimed ones.
template <typename F>
StatusOr<double> MedianMs(int warmup, int reps, F&& f) {
  Timer t;
  MLARUN_RETURN_IF_ERROR(t.Create());
  for (int i = 0; i < warmup; ++i) MLARUN_RETURN_IF_ERROR(f());
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventRecord(t.a, 0));
    MLARUN_RETURN_IF_ERROR(f());
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventRecord(t.b, 0));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(t.b));
    float e = 0;
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&e, t.a, t.b));
    ms.push_back(e);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct DeviceAlloc {
  void* p = nullptr;
  ~DeviceAlloc() {
    if (p != nullptr) cudaFree(p);
  }
};

Status Alloc(DeviceAlloc& a, size_t bytes) {
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMalloc(&a.p, bytes));
  return Status::Ok();
}

StatusOr<double> CopyBandwidthGBps(int reps) {
  const size_t bytes = size_t{1} << 30;
  DeviceAlloc src, dst;
  MLARUN_RETURN_IF_ERROR(Alloc(src, bytes));
  MLARUN_RETURN_IF_ERROR(Alloc(dst, bytes));
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemset(src.p, 1, bytes));
  MLARUN_ASSIGN_OR_RETURN(double ms, MedianMs(2, reps, [&]() -> Status {
                            MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice));
                            return Status::Ok();
                          }));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

StatusOr<double> GemmTflops(int reps) {
  const int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceAlloc a, b, c;
  MLARUN_RETURN_IF_ERROR(Alloc(a, elems * 2));
  MLARUN_RETURN_IF_ERROR(Alloc(b, elems * 2));
  MLARUN_RETURN_IF_ERROR(Alloc(c, elems * 2));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<__nv_bfloat16*>(a.p), elems, 1, 1.f));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<__nv_bfloat16*>(b.p), elems, 2, 1.f));
  MLARUN_ASSIGN_OR_RETURN(cublasHandle_t h, cuda::CublasHandle());
  const float one = 1.f, zero = 0.f;
  MLARUN_ASSIGN_OR_RETURN(double ms, MedianMs(2, reps, [&]() -> Status {
                            MLARUN_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
                                h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.p, CUDA_R_16BF, n, b.p, CUDA_R_16BF, n,
                                &zero, c.p, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                            return Status::Ok();
                          }));
  return 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12;
}

struct DecodeResult {
  int64_t h_q, batch, context;
  double run_ms, kernel_ms, run_gbps, kernel_gbps, run_tflops, kernel_tflops;
  cuda::MlaCudaPlanStats stats;
};

// Cache, weights and queries big enough for the largest grid point, filled once.
struct Inputs {
  DeviceAlloc pool, wuk, wuv, q, out, lse;
  int64_t pool_blocks = 0;
  std::vector<int32_t> block_ids;  // a shuffled permutation of the pool's blocks
};

constexpr int64_t kPage = 64;

Status MakeInputs(Inputs& in, int64_t max_batch, int64_t max_context, int64_t max_heads) {
  const MlaShape s = DeepSeekV3MlaShape(max_heads);
  in.pool_blocks = max_batch * ((max_context + kPage - 1) / kPage);
  const uint64_t pool_elems = static_cast<uint64_t>(in.pool_blocks * kPage * s.d_cache());
  MLARUN_RETURN_IF_ERROR(Alloc(in.pool, pool_elems * 2));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<__nv_bfloat16*>(in.pool.p), pool_elems, 3, 1.f));
  const uint64_t wuk = static_cast<uint64_t>(s.h_q * s.d_nope * s.d_latent),
                 wuv = static_cast<uint64_t>(s.h_q * s.d_latent * s.d_v);
  const float w_scale = 1.f / std::sqrt(static_cast<float>(s.d_latent)) * std::sqrt(3.f);
  MLARUN_RETURN_IF_ERROR(Alloc(in.wuk, wuk * 2));
  MLARUN_RETURN_IF_ERROR(Alloc(in.wuv, wuv * 2));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<__nv_bfloat16*>(in.wuk.p), wuk, 4, w_scale));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<__nv_bfloat16*>(in.wuv.p), wuv, 5, w_scale));
  const uint64_t q = static_cast<uint64_t>(max_batch * s.h_q * s.d_qk());
  MLARUN_RETURN_IF_ERROR(Alloc(in.q, q * 4));
  MLARUN_RETURN_IF_ERROR(Fill(static_cast<float*>(in.q.p), q, 6, 1.f));
  MLARUN_RETURN_IF_ERROR(Alloc(in.out, static_cast<size_t>(max_batch * s.h_q * s.d_v) * 4));
  MLARUN_RETURN_IF_ERROR(Alloc(in.lse, static_cast<size_t>(max_batch * s.h_q) * 4));
  in.block_ids.resize(static_cast<size_t>(in.pool_blocks));
  std::iota(in.block_ids.begin(), in.block_ids.end(), 0);
  std::mt19937_64 rng(11);
  std::shuffle(in.block_ids.begin(), in.block_ids.end(), rng);
  MLARUN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

StatusOr<DecodeResult> BenchDecode(Inputs& in, int64_t heads, int64_t batch, int64_t context, Workspace& ws) {
  const MlaShape s = DeepSeekV3MlaShape(heads);
  const int64_t blocks = (context + kPage - 1) / kPage;
  std::vector<int32_t> query_start(static_cast<size_t>(batch + 1)),
      seq_lens(static_cast<size_t>(batch), static_cast<int32_t>(context));
  std::iota(query_start.begin(), query_start.end(), 0);
  std::vector<int32_t> table(in.block_ids.begin(), in.block_ids.begin() + batch * blocks);
  MlaParams p{.shape = s,
              .q = static_cast<const float*>(in.q.p),
              .num_tokens = batch,
              .q_stride_token = s.h_q * s.d_qk(),
              .q_stride_head = s.d_qk(),
              .w_uk_t = in.wuk.p,
              .w_uv = in.wuv.p,
              .w_dtype = DType::kBF16,
              .cache = PagedRowsView{.data = in.pool.p,
                                     .dtype = DType::kBF16,
                                     .num_blocks = in.pool_blocks,
                                     .block_size = kPage,
                                     .row_width = s.d_cache(),
                                     .stride_block = kPage * s.d_cache(),
                                     .stride_token = s.d_cache()},
              .num_seqs = static_cast<int32_t>(batch),
              .query_start = query_start.data(),
              .seq_lens = seq_lens.data(),
              .block_table = table.data(),
              .block_table_stride = blocks,
              .softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d_qk()))),
              .out = static_cast<float*>(in.out.p),
              .out_stride_token = s.h_q * s.d_v,
              .out_stride_head = s.d_v,
              .lse = static_cast<float*>(in.lse.p)};
  const MlaConfig c{.backend = Backend::kCuda, .path = MlaPath::kAbsorbed};
  MLARUN_ASSIGN_OR_RETURN(MlaPlan plan, MlaMakePlan(p, c));
  WorkspaceView view = ws.Reserve(plan.workspace_bytes);
  if (plan.workspace_bytes > 0 && view.data == nullptr)
    return ResourceExhaustedError("bench: no workspace of ", plan.workspace_bytes, " bytes");

  // Verify: one run, every output and lse finite.
  MLARUN_RETURN_IF_ERROR(MlaRun(p, plan, view));
  std::vector<float> out(static_cast<size_t>(batch * s.h_q * s.d_v)), lse(static_cast<size_t>(batch * s.h_q));
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), in.out.p, out.size() * 4, cudaMemcpyDeviceToHost));
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(lse.data(), in.lse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  for (float v : out)
    if (!std::isfinite(v))
      return InternalError("bench: non-finite output at h_q ", heads, " batch ", batch, " context ", context);
  for (float v : lse)
    if (!std::isfinite(v))
      return InternalError("bench: non-finite lse at h_q ", heads, " batch ", batch, " context ", context);

  DecodeResult r{.h_q = heads, .batch = batch, .context = context};
  MLARUN_ASSIGN_OR_RETURN(r.stats, cuda::MlaCudaStats(*plan.impl));
  MLARUN_ASSIGN_OR_RETURN(r.run_ms, MedianMs(3, 20, [&] { return MlaRun(p, plan, view); }));
  MLARUN_ASSIGN_OR_RETURN(r.kernel_ms,
                          MedianMs(3, 20, [&] { return cuda::RunMlaDecodeCore(p, *plan.impl, view, false); }));

  const double rows = static_cast<double>(batch) * static_cast<double>(heads);
  const double cache_bytes = static_cast<double>(batch * context * s.d_cache()) * 2.0;
  const double run_bytes = cache_bytes + rows * static_cast<double>(s.d_qk() + s.d_v) * 4.0 +
                           static_cast<double>(heads * s.d_latent * (s.d_nope + s.d_v)) * 2.0;
  const double kernel_bytes = cache_bytes + rows * static_cast<double>(s.d_cache() + s.d_latent) * 2.0;
  const double run_flops = static_cast<double>(batch) * MlaAbsorbedFlops(s, 1, context);
  const double kernel_flops =
      rows * static_cast<double>(context) * static_cast<double>(2 * s.d_cache() + 2 * s.d_latent);
  r.run_gbps = run_bytes / (r.run_ms * 1e-3) / 1e9;
  r.kernel_gbps = kernel_bytes / (r.kernel_ms * 1e-3) / 1e9;
  r.run_tflops = run_flops / (r.run_ms * 1e-3) / 1e12;
  r.kernel_tflops = kernel_flops / (r.kernel_ms * 1e-3) / 1e12;
  return r;
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: mla_cuda_bench [--quick] [--json FILE]\n");
      return 2;
    }
  }
  auto devices = CudaDevices();
  if (!devices.ok()) {
    std::fprintf(stderr, "mla_cuda_bench: no CUDA device to measure: %s\n", devices.status().ToString().c_str());
    return 77;
  }
  const CudaDevice& dev = devices->front();
  const std::vector<int64_t> heads{128, 16};
  const std::vector<int64_t> batches =
      quick ? std::vector<int64_t>{1, 16, 128} : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128};
  const std::vector<int64_t> contexts = quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 16384};
  const int reps = quick ? 5 : 10;

  auto fail = [](const Status& st) {
    std::fprintf(stderr, "mla_cuda_bench: %s\n", st.ToString().c_str());
    return 1;
  };
  auto copy = CopyBandwidthGBps(reps);
  if (!copy.ok()) return fail(copy.status());
  auto gemm = GemmTflops(reps);
  if (!gemm.ok()) return fail(gemm.status());
  std::printf(
      "device %s (sm_%d%d)\n(a) D2D copy, 1 GiB: %.0f GB/s (read + write)\n(b) cuBLAS bf16 GEMM 8192^3: %.1f TFLOP/s\n",
      dev.name.c_str(), dev.sm_major, dev.sm_minor, *copy, *gemm);

  Inputs in;
  const Status made = MakeInputs(in, batches.back(), contexts.back(), heads.front());
  if (!made.ok()) return fail(made);
  auto memory = CudaMemory();
  if (!memory.ok()) return fail(memory.status());
  Workspace ws(*memory);
  std::vector<DecodeResult> results;
  std::printf("(c) absorbed decode, DeepSeek-V3 L 512 R 64, bf16, q_len 1 (median of 20)\n");
  std::printf("%5s %6s %8s | %10s %9s %8s | %10s %9s %8s %8s | %7s %6s\n", "h_q", "batch", "context", "run ms", "GB/s",
              "TFLOP/s", "kernel ms", "GB/s", "TFLOP/s", "of_copy", "blocks", "splits");
  for (int64_t h : heads) {
    for (int64_t ctx : contexts) {
      for (int64_t b : batches) {
        auto r = BenchDecode(in, h, b, ctx, ws);
        if (!r.ok()) return fail(r.status());
        results.push_back(*r);
        std::printf("%5ld %6ld %8ld | %10.3f %9.0f %8.2f | %10.3f %9.0f %8.2f %8.3f | %7ld %6ld\n",
                    static_cast<long>(h), static_cast<long>(b), static_cast<long>(ctx), r->run_ms, r->run_gbps,
                    r->run_tflops, r->kernel_ms, r->kernel_gbps, r->kernel_tflops, r->kernel_gbps / *copy,
                    static_cast<long>(r->stats.decode_blocks), static_cast<long>(r->stats.max_splits));
      }
    }
  }

  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "mla_cuda_bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"sm\": \"%d.%d\",\n  \"quick\": %s,\n", dev.name.c_str(),
                 dev.sm_major, dev.sm_minor, quick ? "true" : "false");
    std::fprintf(f, "  \"copy_gbps\": %.3f,\n  \"gemm_bf16_8192_tflops\": %.3f,\n  \"decode\": [\n", *copy, *gemm);
    for (size_t i = 0; i < results.size(); ++i) {
      const DecodeResult& r = results[i];
      std::fprintf(
          f,
          "    {\"h_q\": %ld, \"batch\": %ld, \"context\": %ld, \"q_len\": 1, \"run_ms\": %.5f, \"run_gbps\": %.3f, "
          "\"run_tflops\": %.4f, \"run_of_copy\": %.4f, \"kernel_ms\": %.5f, \"kernel_gbps\": %.3f, "
          "\"kernel_tflops\": %.4f, \"kernel_of_copy\": %.4f, \"decode_blocks\": %ld, \"max_splits\": %ld, "
          "\"rows_per_block\": %ld, \"blocks_per_sm\": %ld}%s\n",
          static_cast<long>(r.h_q), static_cast<long>(r.batch), static_cast<long>(r.context), r.run_ms, r.run_gbps,
          r.run_tflops, r.run_gbps / *copy, r.kernel_ms, r.kernel_gbps, r.kernel_tflops, r.kernel_gbps / *copy,
          static_cast<long>(r.stats.decode_blocks), static_cast<long>(r.stats.max_splits),
          static_cast<long>(r.stats.rows_per_block), static_cast<long>(r.stats.blocks_per_sm),
          i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace mlarun

int main(int argc, char** argv) { return mlarun::Main(argc, argv); }
