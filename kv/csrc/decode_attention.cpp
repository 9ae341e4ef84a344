// One decode query per head over several key sets, in one pass over the keys (the CPU path).
//
// torch reads a gathered copy of the selected blocks and runs small bf16 matmuls (3 query rows
// per KV head) that stream keys at a fraction of the memory bandwidth. Here each KV head's
// keys are read in place (the local window, the sinks, the block store), 128 rows at a time,
// converted to fp32 once, scored by the head's query group and folded into an online softmax,
// so every byte of K and V is read from DRAM once.
//
// A key set: rows of head_dim elements in a contiguous source tensor; per KV head, `runs`
// of `rows` rows each, `stride` elements apart, starting at element starts[h][r]; read with
// query 0 or query 1 (the local window's and the retrieved blocks' rotations differ).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t TILE = 128;
// Built with -ffast-math (vectorised exp and reductions), which assumes no infinities: the
// running max starts at a finite floor instead, and exp(floor - max) is 0 all the same.
constexpr float NO_MAX = -1e30f;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;  // bf16 is fp32's high half
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Run {
  int set;
  int64_t start;
  int64_t rows;
};

struct Set {
  const void* k;
  const void* v;
  int qid;
  int64_t stride;
};

template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t rows, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(base + t * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
  }
}

// Online softmax over this head's runs [r0, r1); writes the running max, sum and
// unnormalised output of each query of the group.
template <typename T, int D>
void attend(const float* q, int G, const std::vector<Set>& sets, const Run* runs, int64_t n_runs,
            float scale, float* m, float* l, float* acc) {
  std::vector<float> s(G * TILE), tile(TILE * D);
  std::fill(m, m + G, NO_MAX);
  std::fill(l, l + G, 0.f);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t r = 0; r < n_runs; ++r) {
    const Set& set = sets[runs[r].set];
    const T* kb = static_cast<const T*>(set.k) + runs[r].start;
    const T* vb = static_cast<const T*>(set.v) + runs[r].start;
    const float* qq = q + set.qid * G * D;
    for (int64_t t0 = 0; t0 < runs[r].rows; t0 += TILE) {
      const int64_t tn = std::min(TILE, runs[r].rows - t0);
      // Keep the memory system busy with the next tile (this run's, or the next run's first)
      // while this one is computed: the runs are scattered 16 KB blocks.
      if (t0 + TILE < runs[r].rows) {
        const int64_t nn = std::min(TILE, runs[r].rows - t0 - TILE);
        prefetch_rows(kb + (t0 + TILE) * set.stride, set.stride, nn, D);
        prefetch_rows(vb + (t0 + TILE) * set.stride, set.stride, nn, D);
      } else if (r + 1 < n_runs) {
        const Set& next = sets[runs[r + 1].set];
        const int64_t nn = std::min(TILE, runs[r + 1].rows);
        prefetch_rows(static_cast<const T*>(next.k) + runs[r + 1].start, next.stride, nn, D);
        prefetch_rows(static_cast<const T*>(next.v) + runs[r + 1].start, next.stride, nn, D);
      }
      for (int64_t t = 0; t < tn; ++t) {
        const T* row = kb + (t0 + t) * set.stride;
        float* dst = tile.data() + t * D;
        for (int d = 0; d < D; ++d) dst[d] = load(row, d);
      }
      for (int g = 0; g < G; ++g) {
        const float* qg = qq + g * D;
        float* sg = s.data() + g * TILE;
        for (int64_t t = 0; t < tn; ++t) {
          const float* kf = tile.data() + t * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];
          sg[t] = dot * scale;
        }
        float mx = m[g];
        for (int64_t t = 0; t < tn; ++t) mx = std::max(mx, sg[t]);
        const float corr = std::exp(m[g] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < tn; ++t) {
          const float p = std::exp(sg[t] - mx);
          sg[t] = p;
          sum += p;
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        float* a = acc + g * D;
        for (int d = 0; d < D; ++d) a[d] *= corr;
      }
      for (int64_t t = 0; t < tn; ++t) {
        const T* row = vb + (t0 + t) * set.stride;
        float* dst = tile.data() + t * D;
        for (int d = 0; d < D; ++d) dst[d] = load(row, d);
      }
      for (int g = 0; g < G; ++g) {
        const float* pg = s.data() + g * TILE;
        float a[D];
        std::copy(acc + g * D, acc + (g + 1) * D, a);
        for (int64_t t = 0; t < tn; ++t) {
          const float p = pg[t];
          const float* vf = tile.data() + t * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) a[d] += p * vf[d];
        }
        std::copy(a, a + D, acc + g * D);
      }
    }
  }
}

template <typename T, int D>
void attend_heads(const float* q, int64_t n_kv, int G, const std::vector<Set>& sets,
                  const std::vector<std::vector<Run>>& runs, float scale, float* out) {
  // Each head's runs are cut into `splits` parts of about equal rows, so that 2 threads share
  // 3 heads evenly; the parts are merged by their softmax statistics.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, (2 * threads + n_kv - 1) / n_kv);
  std::vector<std::vector<int64_t>> cut(n_kv);
  for (int64_t h = 0; h < n_kv; ++h) {
    int64_t total = 0;
    for (const Run& run : runs[h]) total += run.rows;
    cut[h].push_back(0);
    int64_t seen = 0;
    for (size_t r = 0; r < runs[h].size(); ++r) {
      seen += runs[h][r].rows;
      if (static_cast<int64_t>(cut[h].size()) < splits && seen * splits >= total * static_cast<int64_t>(cut[h].size()))
        cut[h].push_back(r + 1);
    }
    while (static_cast<int64_t>(cut[h].size()) <= splits) cut[h].push_back(runs[h].size());
  }
  const int64_t tasks = n_kv * splits;
  std::vector<float> ms(tasks * G), ls(tasks * G), accs(tasks * G * D);
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t h = task / splits, part = task % splits;
      const int64_t r0 = cut[h][part], r1 = cut[h][part + 1];
      attend<T, D>(q + h * 2 * G * D, G, sets, runs[h].data() + r0, r1 - r0, scale,
                   &ms[task * G], &ls[task * G], &accs[task * G * D]);
    }
  });
  for (int64_t h = 0; h < n_kv; ++h) {
    for (int g = 0; g < G; ++g) {
      float mx = NO_MAX;
      for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, ms[(h * splits + p) * G + g]);
      float l = 0.f;
      float o[D] = {};
      for (int64_t p = 0; p < splits; ++p) {
        const int64_t task = h * splits + p;
        if (ls[task * G + g] == 0.f) continue;  // an empty part (a part's max scores exp(0))
        const float w = std::exp(ms[task * G + g] - mx);
        l += w * ls[task * G + g];
        for (int d = 0; d < D; ++d) o[d] += w * accs[(task * G + g) * D + d];
      }
      for (int d = 0; d < D; ++d) out[(h * G + g) * D + d] = o[d] / l;
    }
  }
}

template <int D>
torch::Tensor dispatch(bool bf16, const float* q, int64_t n_kv, int G, const std::vector<Set>& sets,
                       const std::vector<std::vector<Run>>& runs, float scale, torch::Tensor out) {
  if (bf16)
    attend_heads<uint16_t, D>(q, n_kv, G, sets, runs, scale, out.data_ptr<float>());
  else
    attend_heads<float, D>(q, n_kv, G, sets, runs, scale, out.data_ptr<float>());
  return out;
}

}  // namespace

// q0, q1: [n_heads, 1, D] (any float dtype); per set i: k_srcs[i], v_srcs[i] (contiguous, the
// kv dtype: bf16 or fp32), qids[i], strides[i], rows[i] (rows per run) and starts[i] (int64
// [n_kv, runs_i]). Returns fp32 [n_kv, G, D].
torch::Tensor decode_attention(torch::Tensor q0, torch::Tensor q1,
                               std::vector<torch::Tensor> k_srcs, std::vector<torch::Tensor> v_srcs,
                               std::vector<int64_t> qids, std::vector<int64_t> strides,
                               std::vector<int64_t> rows, std::vector<torch::Tensor> starts,
                               int64_t n_kv, double scale) {
  const int64_t n_heads = q0.size(0), D = q0.size(-1), G = n_heads / n_kv;
  TORCH_CHECK(n_heads % n_kv == 0, "n_heads must be a multiple of n_kv");
  TORCH_CHECK(!k_srcs.empty(), "at least one key set");
  const auto dtype = k_srcs[0].scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "keys must be bf16 or fp32");
  // [n_kv, 2, G, D]: both queries of a head next to each other.
  auto q = torch::stack({q0.reshape({n_kv, G, D}), q1.reshape({n_kv, G, D})}, 1)
               .to(torch::kFloat)
               .contiguous();
  std::vector<Set> sets;
  std::vector<std::vector<Run>> runs(n_kv);
  for (size_t i = 0; i < k_srcs.size(); ++i) {
    TORCH_CHECK(k_srcs[i].is_contiguous() && v_srcs[i].is_contiguous(), "sources must be contiguous");
    TORCH_CHECK(k_srcs[i].scalar_type() == dtype && v_srcs[i].scalar_type() == dtype, "one dtype");
    sets.push_back({k_srcs[i].data_ptr(), v_srcs[i].data_ptr(), static_cast<int>(qids[i]), strides[i]});
    auto st = starts[i].contiguous();
    TORCH_CHECK(st.scalar_type() == at::kLong && st.dim() == 2 && st.size(0) == n_kv, "starts: int64 [n_kv, runs]");
    const int64_t* p = st.data_ptr<int64_t>();
    const int64_t numel = k_srcs[i].numel();
    TORCH_CHECK(v_srcs[i].numel() == numel, "K and V sources of a set differ in size");
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t r = 0; r < st.size(1); ++r) {
        const int64_t start = p[h * st.size(1) + r];
        if (rows[i] == 0) continue;
        TORCH_CHECK(start >= 0 && start + (rows[i] - 1) * strides[i] + D <= numel,
                    "a run of set ", i, " reads outside its source");
        runs[h].push_back({static_cast<int>(i), start, rows[i]});
      }
  }
  for (int64_t h = 0; h < n_kv; ++h) TORCH_CHECK(!runs[h].empty(), "every head needs a key");
  auto out = torch::empty({n_kv, G, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const bool bf16 = dtype == at::kBFloat16;
  const float sc = static_cast<float>(scale);
  switch (D) {
    case 32: return dispatch<32>(bf16, qp, n_kv, G, sets, runs, sc, out);
    case 64: return dispatch<64>(bf16, qp, n_kv, G, sets, runs, sc, out);
    case 128: return dispatch<128>(bf16, qp, n_kv, G, sets, runs, sc, out);
    case 256: return dispatch<256>(bf16, qp, n_kv, G, sets, runs, sc, out);
  }
  TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, got ", D);
  return out;
}
