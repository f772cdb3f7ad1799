// Plain float64 reference for MLA attention, written the long way: expand
// every context row into per-head K [P + R] (k_pe broadcast to each head) and
// V [V], then causal softmax attention per head. No absorption, no tiling, no
// paging: nothing shared with the kernels under test.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace mlarun::ref {

struct MlaRefShape {
  int64_t h_q, d_latent, d_rope, d_nope, d_v;
};

// rows:   [seq_len, d_latent + d_rope]  the sequence's cache rows (kv_c | k_pe)
// q:      [q_len, h_q, d_nope + d_rope] the last q_len positions' queries
// w_uk_t: [h_q, d_nope, d_latent]; w_uv: [h_q, d_latent, d_v]
// out:    [q_len, h_q, d_v]; lse: [q_len, h_q] (natural log of sum exp(scaled score))
inline void MlaReference(const MlaRefShape& s, const std::vector<double>& rows, const std::vector<double>& q,
                         const std::vector<double>& w_uk_t, const std::vector<double>& w_uv, int64_t q_len,
                         int64_t seq_len, double scale, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t N = s.h_q, L = s.d_latent, R = s.d_rope, P = s.d_nope, V = s.d_v, W = L + R, Dq = P + R;
  const int64_t prefix = seq_len - q_len;
  out.assign(static_cast<size_t>(q_len * N * V), 0.0);
  lse.assign(static_cast<size_t>(q_len * N), 0.0);
  std::vector<double> k(static_cast<size_t>(seq_len * Dq)), v(static_cast<size_t>(seq_len * V));
  std::vector<double> scores(static_cast<size_t>(seq_len));
  for (int64_t h = 0; h < N; ++h) {
    // Expand this head's keys and values.
    for (int64_t t = 0; t < seq_len; ++t) {
      const double* c = &rows[static_cast<size_t>(t * W)];
      for (int64_t p = 0; p < P; ++p) {
        const double* w = &w_uk_t[static_cast<size_t>((h * P + p) * L)];
        double acc = 0;
        for (int64_t l = 0; l < L; ++l) acc += c[l] * w[l];
        k[static_cast<size_t>(t * Dq + p)] = acc;
      }
      for (int64_t r = 0; r < R; ++r) k[static_cast<size_t>(t * Dq + P + r)] = c[L + r];
      for (int64_t j = 0; j < V; ++j) v[static_cast<size_t>(t * V + j)] = 0;
      for (int64_t l = 0; l < L; ++l) {
        const double* w = &w_uv[static_cast<size_t>((h * L + l) * V)];
        for (int64_t j = 0; j < V; ++j) v[static_cast<size_t>(t * V + j)] += c[l] * w[j];
      }
    }
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t visible = prefix + i + 1;  // keys 0 .. prefix + i
      const double* qi = &q[static_cast<size_t>((i * N + h) * Dq)];
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < visible; ++t) {
        double dot = 0;
        for (int64_t c = 0; c < Dq; ++c) dot += qi[c] * k[static_cast<size_t>(t * Dq + c)];
        scores[static_cast<size_t>(t)] = dot * scale;
        mx = std::max(mx, scores[static_cast<size_t>(t)]);
      }
      double sum = 0;
      for (int64_t t = 0; t < visible; ++t) sum += std::exp(scores[static_cast<size_t>(t)] - mx);
      double* o = &out[static_cast<size_t>((i * N + h) * V)];
      for (int64_t t = 0; t < visible; ++t) {
        const double pr = std::exp(scores[static_cast<size_t>(t)] - mx) / sum;
        for (int64_t j = 0; j < V; ++j) o[j] += pr * v[static_cast<size_t>(t * V + j)];
      }
      lse[static_cast<size_t>(i * N + h)] = mx + std::log(sum);
    }
  }
}

}  // namespace mlarun::ref
