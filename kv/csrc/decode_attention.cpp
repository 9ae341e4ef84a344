// One decode query per head over several key sets, in one pass over the keys (the CPU path).
//
// torch reads a gathered copy of the selected blocks and runs small bf16 matmuls (3 query rows
// per KV head) that stream keys at a fraction of the memory bandwidth. Here each KV head's
// keys are read in place (the local window, the sinks, the block store), 128 rows at a time
// with the next 128 prefetched, scored by the head's query group and folded into an fp32
// online softmax, so every byte of K and V is read from DRAM once. The kernel is bound by its
// vector instructions, so bf16 keys and values are not widened into a buffer: on Zen 4 (which
// runs 512-bit instructions at half rate) bf16 pair-product instructions score the keys and
// accumulate the values, with the probabilities rounded to bf16 (a relative 2^-9, below the
// bf16 output's own rounding): ~6.6 ms of attention for 30 layers of a 128K decode step, where
// fp32 arithmetic on widened rows takes 10.3 ms and pair-product scores alone ~7 ms. On
// Intel's cores, where pair products are slow, and on AVX2 CPUs (8 lanes), fp32 FMAs read the
// bf16 rows widened in registers (a 32-bit word's two bf16 halves by a shift and a mask). The
// next tile's rows are prefetched to L2 rather than L1, which a tile's K and V, their value
// pairs and the next tile's rows overflow (30 layers of a 128K step on a Xeon: 10.3 ms, 5% less
// than prefetching to L1).
//
// A key set: rows of head_dim elements in a contiguous source tensor; per KV head, `runs`
// of `rows` rows each, `stride` elements apart, starting at element starts[h][r]; read with
// query 0 or query 1 (the local window's and the retrieved blocks' rotations differ). A set
// of INT8 or INT4 blocks is the block pool's byte rows, each run one block (0.53x / 0.31x the
// bytes of bf16), dequantized a tile at a time (128-row K and V tiles in L1) into what
// BlockPool.gather makes: a 128K step with INT8 blocks read in place takes 16.2 ms, a third
// less than gathering them first (24.4 ms).
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "dequant.h"
#include "kernels.h"

// The FMA path per CPU level (the build's -march picks it): 512-bit or 256-bit vectors.
#if defined(__AVX512F__)
#include <immintrin.h>
#define KVCHAT_AVX512 1
#define KVCHAT_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVCHAT_AVX512 0
#define KVCHAT_AVX2 1
#else
#define KVCHAT_AVX512 0
#define KVCHAT_AVX2 0
#endif
#define KVCHAT_FMA (KVCHAT_AVX512 || KVCHAT_AVX2)


// Pair products (32 a 512-bit instruction) beat FMAs (16) where vdpbf16ps issues as fast as an
// FMA: Zen 4. Intel's cores with AMX issue it at a quarter of an FMA's rate (a Xeon: 1.23
// against 0.31 ns an instruction, independent chains), and there the FMAs on widened keys are
// faster (a 128K step's 30 attention calls, hot: 150 us a layer against 209; in the model, the
// two builds alternated in one process: 19.8 ms a step against 23.0).
#if defined(__AMX_BF16__)
#define PAIR_PRODUCTS_FASTER 0
#else
#define PAIR_PRODUCTS_FASTER 1
#endif

namespace {

// How a tile's products are computed: fp32 on rows widened a tile at a time (any CPU, any
// dtype), fp32 FMAs on bf16 rows widened in registers (AVX-512 or AVX2), or bf16 pair products
// (AVX512-BF16).
enum class Math { Scalar, Fma, PairProducts };

// The bf16 values of one vector register, which the FMA path widens into its even and its odd
// half.
constexpr int FMA_CHUNK = KVCHAT_AVX512 ? 32 : 16;

constexpr int64_t TILE = 128;
static_assert(TILE % 2 == 0, "accumulate_dpbf16 interleaves a tile's rows in pairs");
// Built with -ffast-math (vectorised exp and reductions), which assumes no infinities: the
// running max starts at a finite floor instead, and exp(floor - max) is 0 all the same.
constexpr float NO_MAX = -1e30f;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return kvchat::bf16_to_float(p[i]); }

using kvchat::dequant_int4;
using kvchat::dequant_int8;
using kvchat::meta_bytes;
using kvchat::value_bytes;
using kvchat::Format;
using kvchat::KeyRun;
using kvchat::KeySet;

// The tile after this one, whose rows are prefetched one by one while this tile's rows are
// read (a bulk prefetch at the tile's start, or none, streams at half the rate: the runs are
// scattered 16 KB blocks, which the hardware prefetcher ramps up on too late).
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t stride = 0;  // bytes
  int64_t rows = 0;
  int64_t width = 0;  // bytes of a row
  // A quantized tile's fp16 scales (kept after the block's rows), prefetched at once, and
  // its minimums (INT4) `mins_offset` bytes after them.
  const char* k_scales = nullptr;
  const char* v_scales = nullptr;
  int64_t scale_bytes = 0;
  int64_t mins_offset = 0;
};

inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  // GCC 12 drops __builtin_prefetch here (none left in the object code).
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

inline void prefetch_row(const char* base, const Ahead& ahead, int64_t t) {
  if (t >= ahead.rows) return;
  const char* row = base + t * ahead.stride;
  for (int64_t off = 0; off < ahead.width; off += 64) prefetch_line(row + off);
}

#if KVCHAT_AVX512
// exp(x) for 16 values at once (Cephes' expf: a degree-6 polynomial on x - n ln 2, times 2^n;
// within 2 ulp). GCC vectorises std::exp in a loop (through glibc's libmvec) or not depending on
// the code around it, and a scalar expf per score costs a quarter of the kernel's time.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp is 0 in fp32 below, and n stays small
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lanes 0 .. min(n, 16) - 1.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// The tile's softmax numerators in place: s[t] = exp(s[t] - mx), rounded to bf16 for the pair
// products; their sum.
template <bool ROUND_BF16>
float exp_sum(float* s, int64_t n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = first_lanes(n - t);
    __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
#if KVCHAT_DPBF16
    // Round to nearest even bf16 and back (vcvtneps2bf16 flushes subnormals: those
    // probabilities are below any bf16 output's resolution anyway).
    if constexpr (ROUND_BF16)
      p = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p)), 16));
#endif
    _mm512_mask_storeu_ps(s + t, k, p);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, p));
  }
  return _mm512_reduce_add_ps(sum);
}

inline float max_of(const float* s, int64_t n, float start) {
  __m512 m = _mm512_set1_ps(start);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = first_lanes(n - t);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + t));
  }
  return _mm512_reduce_max_ps(m);
}

// The first two levels of a transposing add tree over N vectors (rows): lane 4 L + j of q[i]
// holds row 4 i + j's sum over its 128-bit lane L.
template <int N>
void fold_lanes(const __m512* v, __m512* q) {
  __m512 p[N / 2];
  for (int i = 0; i < N / 2; ++i)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < N / 4; ++i) {
    const __m512d a = _mm512_castps_pd(p[2 * i]), b = _mm512_castps_pd(p[2 * i + 1]);
    q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
}

// Lane i (< 8) of the result: the sum of v[i]'s 16 lanes.
inline __m256 sum_lanes8(const __m512* v) {
  __m512 q[2];
  fold_lanes<8>(v, q);
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // r: [rows 0-3 (L0 + L1), rows 0-3 (L2 + L3), rows 4-7 (L0 + L1), rows 4-7 (L2 + L3)]
  const __m512 t = _mm512_add_ps(r, _mm512_shuffle_f32x4(r, r, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 0, 2, 0)));
}

// bf16 values 2i (even) and 2i + 1 (odd) of 32 as fp32: a word's low and high halves.
inline __m512 even_values(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
inline __m512 odd_values(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// scores_fma for N (<= 3) queries: 8 key rows at a time, each widened once for all N; the
// first group of queries (`first`) prefetches the next tile's rows.
template <int D, int N>
void scores_fma_group(const float* qs, const uint16_t* kb, int64_t stride, int64_t tn, float scale,
                      const Ahead& ahead, bool first, float* s) {
  constexpr int W = D / 32;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < tn; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, tn - t0);
    __m512 acc[N][8];
    for (int g = 0; g < N; ++g)
      for (int r = 0; r < 8; ++r) acc[g][r] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      if (first) prefetch_row(ahead.k, ahead, t0 + r);
      if (r < n) {
        const uint16_t* row = kb + (t0 + r) * stride;
#pragma GCC unroll 8
        for (int j = 0; j < W; ++j) {
          const __m512i x = _mm512_loadu_si512(row + 32 * j);
          const __m512 e = even_values(x), o = odd_values(x);
          for (int g = 0; g < N; ++g) {
            acc[g][r] = _mm512_fmadd_ps(e, _mm512_loadu_ps(qs + g * D + 32 * j), acc[g][r]);
            acc[g][r] = _mm512_fmadd_ps(o, _mm512_loadu_ps(qs + g * D + 32 * j + 16), acc[g][r]);
          }
        }
      }
    }
    for (int g = 0; g < N; ++g)
      _mm256_mask_storeu_ps(s + g * TILE + t0, static_cast<__mmask8>((1u << n) - 1),
                            _mm256_mul_ps(sum_lanes8(acc[g]), sc));
  }
}

// accumulate_fma for N queries; the first group (`first`) prefetches the next tile's rows.
template <int D, int N>
void accumulate_fma_group(const float* p, const uint16_t* vb, int64_t stride, int64_t tn,
                          const Ahead& ahead, bool first, float* acc) {
  constexpr int W = D / 32;
  __m512 a[N][2 * W];
  for (int g = 0; g < N; ++g)
    for (int j = 0; j < 2 * W; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + 16 * j);
  for (int64_t t = 0; t < tn; ++t) {
    if (first) prefetch_row(ahead.v, ahead, t);
    const uint16_t* row = vb + t * stride;
    __m512 w[N];
    for (int g = 0; g < N; ++g) w[g] = _mm512_set1_ps(p[g * TILE + t]);
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) {
      const __m512i x = _mm512_loadu_si512(row + 32 * j);
      const __m512 e = even_values(x), o = odd_values(x);
      for (int g = 0; g < N; ++g) {
        a[g][2 * j] = _mm512_fmadd_ps(w[g], e, a[g][2 * j]);
        a[g][2 * j + 1] = _mm512_fmadd_ps(w[g], o, a[g][2 * j + 1]);
      }
    }
  }
  for (int g = 0; g < N; ++g)
    for (int j = 0; j < 2 * W; ++j) _mm512_storeu_ps(acc + g * D + 16 * j, a[g][j]);
}

// acc[g] += sum over the tile's rows of p[g][t] * v[t] in fp32 FMAs on the rows widened as
// scores_fma widens keys; acc holds each chunk's even outputs, then its odd ones (fma_slot).
template <int D>
void accumulate_fma(const float* p, int G, const uint16_t* vb, int64_t stride, int64_t tn,
                    const Ahead& ahead, float* acc) {
  constexpr int B = D <= 128 ? 3 : 1;
  for (int g = 0; g < G; g += B) {
    const float* pg = p + g * TILE;
    float* ag = acc + g * D;
    switch (std::min(B, G - g)) {
      case 3: accumulate_fma_group<D, 3>(pg, vb, stride, tn, ahead, g == 0, ag); break;
      case 2: accumulate_fma_group<D, 2>(pg, vb, stride, tn, ahead, g == 0, ag); break;
      default: accumulate_fma_group<D, 1>(pg, vb, stride, tn, ahead, g == 0, ag); break;
    }
  }
}

#endif

#if KVCHAT_AVX2
// The AVX2 path: the AVX-512 one's arithmetic on 8 lanes, with 16 registers (so 4 key rows a
// step of the scores, one query a pass of the values) and no masked loads or scalef.

// exp(x) for 8 values (exp16's polynomial; 2^n built in the exponent bits, so x is held above
// -87, where exp is ~1e-38: below any probability a bf16 output resolves).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes 0 .. min(n, 8) - 1 as an all-ones mask.
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// The tile's softmax numerators in place, s[t] = exp(s[t] - mx); their sum. (ROUND_BF16 is for
// the pair products, which an AVX2 build never chooses.)
template <bool ROUND_BF16>
float exp_sum(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i k = first_lanes(n - t);
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + t, k), m)),
                                   _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + t, k, p);
    sum = _mm256_add_ps(sum, p);
  }
  return sum8(sum);
}

inline float max_of(const float* s, int64_t n, float start) {
  const __m256 floor = _mm256_set1_ps(start);
  __m256 m = floor;
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i k = first_lanes(n - t);
    m = _mm256_max_ps(m, _mm256_blendv_ps(floor, _mm256_maskload_ps(s + t, k),
                                          _mm256_castsi256_ps(k)));
  }
  return max8(m);
}

// Lane i (< 4) of the result: the sum of v[i]'s 8 lanes.
inline __m128 sum_lanes4(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

// bf16 values 2i (even) and 2i + 1 (odd) of 16 as fp32: a word's low and high halves.
inline __m256 even_values(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 odd_values(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// scores_fma for N (<= 3) queries: 4 key rows at a time, each widened once for all N; the
// first group of queries (`first`) prefetches the next tile's rows.
template <int D, int N>
void scores_fma_group(const float* qs, const uint16_t* kb, int64_t stride, int64_t tn, float scale,
                      const Ahead& ahead, bool first, float* s) {
  constexpr int W = D / 16;
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t t0 = 0; t0 < tn; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, tn - t0);
    __m256 acc[N][4];
    for (int g = 0; g < N; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      if (first) prefetch_row(ahead.k, ahead, t0 + r);
      if (r < n) {
        const uint16_t* row = kb + (t0 + r) * stride;
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
          const __m256 e = even_values(x), o = odd_values(x);
          for (int g = 0; g < N; ++g) {
            acc[g][r] = _mm256_fmadd_ps(e, _mm256_loadu_ps(qs + g * D + 16 * j), acc[g][r]);
            acc[g][r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(qs + g * D + 16 * j + 8), acc[g][r]);
          }
        }
      }
    }
    for (int g = 0; g < N; ++g) {
      const __m128 sums = _mm_mul_ps(sum_lanes4(acc[g]), sc);
      if (n == 4) {
        _mm_storeu_ps(s + g * TILE + t0, sums);
      } else {
        float lanes[4];
        _mm_storeu_ps(lanes, sums);
        std::copy(lanes, lanes + n, s + g * TILE + t0);
      }
    }
  }
}

// acc += sum over the tile's rows of p[t] * v[t] for one query, D / 8 accumulators held in
// registers; the first query (`first`) prefetches the next tile's rows.
template <int D>
void accumulate_fma_one(const float* p, const uint16_t* vb, int64_t stride, int64_t tn,
                        const Ahead& ahead, bool first, float* acc) {
  constexpr int W = D / 16;
  if constexpr (W > 4) {
    // Over 16 accumulators: two passes over halves of the row.
    accumulate_fma_one<D / 2>(p, vb, stride, tn, ahead, first, acc);
    accumulate_fma_one<D / 2>(p, vb + D / 2, stride, tn, Ahead{}, false, acc + D / 2);
  } else {
    __m256 a[2 * W];
    for (int j = 0; j < 2 * W; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int64_t t = 0; t < tn; ++t) {
      if (first) prefetch_row(ahead.v, ahead, t);
      const uint16_t* row = vb + t * stride;
      const __m256 w = _mm256_set1_ps(p[t]);
#pragma GCC unroll 8
      for (int j = 0; j < W; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
        a[2 * j] = _mm256_fmadd_ps(w, even_values(x), a[2 * j]);
        a[2 * j + 1] = _mm256_fmadd_ps(w, odd_values(x), a[2 * j + 1]);
      }
    }
    for (int j = 0; j < 2 * W; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
  }
}

// acc[g] += sum over the tile's rows of p[g][t] * v[t] in fp32 FMAs on the rows widened as
// scores_fma widens keys; acc holds each chunk's even outputs, then its odd ones (fma_slot).
template <int D>
void accumulate_fma(const float* p, int G, const uint16_t* vb, int64_t stride, int64_t tn,
                    const Ahead& ahead, float* acc) {
  for (int g = 0; g < G; ++g)
    accumulate_fma_one<D>(p + g * TILE, vb, stride, tn, ahead, g == 0, acc + g * D);
}
#endif

#if KVCHAT_FMA
// Scores of tn bf16 key rows for the G queries, straight from the keys' memory, up to 3
// queries a pass (scores_fma_group): each 32-bit word of a row holds two bf16 values, which a
// shift and a mask make fp32 (its even and its odd element), multiplied by the queries'
// matching elements in fp32 FMAs. qs: the queries split as the keys are, per FMA_CHUNK values
// the even ones, then the odd ones.
template <int D>
void scores_fma(const float* qs, int G, const uint16_t* kb, int64_t stride, int64_t tn, float scale,
                const Ahead& ahead, float* s) {
  for (int g = 0; g < G; g += 3) {
    const float* qg = qs + g * D;
    float* sg = s + g * TILE;
    switch (std::min(3, G - g)) {
      case 3: scores_fma_group<D, 3>(qg, kb, stride, tn, scale, ahead, g == 0, sg); break;
      case 2: scores_fma_group<D, 2>(qg, kb, stride, tn, scale, ahead, g == 0, sg); break;
      default: scores_fma_group<D, 1>(qg, kb, stride, tn, scale, ahead, g == 0, sg); break;
    }
  }
}

// Where accumulate_fma keeps output element d: per FMA_CHUNK-value chunk, the even elements in
// the first vector and the odd ones in the second.
inline int64_t fma_slot(int64_t d) {
  constexpr int64_t half = FMA_CHUNK / 2;
  const int64_t r = d % FMA_CHUNK;
  return d - r + (r & 1) * half + (r >> 1);
}
#endif

#if KVCHAT_DPBF16
// Lane i of the result: the sum of v[i]'s 16 lanes (a transposing add tree, 45 instructions
// for 16 rows instead of a horizontal reduction per row).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 q[4], r[2];
  fold_lanes<16>(v, q);
  for (int i = 0; i < 2; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of tn bf16 key rows for the G queries, straight from the keys' memory: bf16 pair
// products summed in fp32 (vdpbf16ps), exact for bf16 queries, which is what the model makes.
template <int D>
void scores_dpbf16(const __m512bh* qb, int G, const uint16_t* kb, int64_t stride, int64_t tn,
                   float scale, const Ahead& ahead, float* s) {
  constexpr int W = D / 32;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < tn; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, tn - t0);
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        if (g == 0) prefetch_row(ahead.k, ahead, t0 + r);
        acc[r] = _mm512_setzero_ps();
        if (r < n) {
          const uint16_t* row = kb + (t0 + r) * stride;
#pragma GCC unroll 8
          for (int j = 0; j < W; ++j)
            acc[r] = _mm512_dpbf16_ps(acc[r], qb[g * W + j],
                                      (__m512bh)_mm512_loadu_si512(row + 32 * j));
        }
      }
      _mm512_mask_storeu_ps(s + g * TILE + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum_lanes16(acc), sc));
    }
  }
}

// acc[g] += sum over the tile's rows of p[g][t] * v[t], by bf16 pair products summed in fp32:
// rows t and t+1 are interleaved element by element once (into `pairs`, for every query of the
// group), then each query's (p[t], p[t+1]) pair multiplies them in one vdpbf16ps per 16
// outputs. The probabilities are bf16 values already (attend rounds them, and sums the rounded
// ones, so the weights stay normalised). acc holds the outputs in the order the interleave
// leaves them; dpbf16_slot maps them back.
template <int D>
void accumulate_dpbf16(const float* p, int G, const uint16_t* vb, int64_t stride, int64_t tn,
                       const Ahead& ahead, uint16_t* pairs, float* acc) {
  constexpr int W = D / 32;  // 32-value chunks per row
  const int64_t n_pairs = (tn + 1) / 2;
  for (int64_t i = 0; i < n_pairs; ++i) {
    const int64_t t = 2 * i;
    prefetch_row(ahead.v, ahead, t);
    prefetch_row(ahead.v, ahead, t + 1);
    const uint16_t* row = vb + t * stride;
    __m512i* dst = reinterpret_cast<__m512i*>(pairs + i * 2 * D);
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) {
      const __m512i x = _mm512_loadu_si512(row + 32 * j);
      const __m512i y = t + 1 < tn ? _mm512_loadu_si512(row + stride + 32 * j)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * j, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(dst + 2 * j + 1, _mm512_unpackhi_epi16(x, y));
    }
  }
  for (int g = 0; g < G; ++g) {
    const float* pg = p + g * TILE;
    __m512 a[2 * W];
#pragma GCC unroll 16
    for (int j = 0; j < 2 * W; ++j) a[j] = _mm512_loadu_ps(acc + g * D + 16 * j);
    for (int64_t i = 0; i < n_pairs; ++i) {
      const int64_t t = 2 * i;
      uint32_t lo, hi = 0;
      std::memcpy(&lo, pg + t, 4);
      if (t + 1 < tn) std::memcpy(&hi, pg + t + 1, 4);
      // Both probabilities are bf16 values: their high halves are their bf16 encodings.
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>((lo >> 16) | (hi & 0xFFFF0000u)));
      const __m512i* src = reinterpret_cast<const __m512i*>(pairs + i * 2 * D);
#pragma GCC unroll 16
      for (int j = 0; j < 2 * W; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], pp, (__m512bh)_mm512_loadu_si512(src + j));
    }
#pragma GCC unroll 16
    for (int j = 0; j < 2 * W; ++j) _mm512_storeu_ps(acc + g * D + 16 * j, a[j]);
  }
}

// Where accumulate_dpbf16 keeps output element d: per 32-value chunk, the unpacks put
// elements 8L+0..3 of each 128-bit lane L in the first vector and 8L+4..7 in the second.
inline int64_t dpbf16_slot(int64_t d) {
  const int64_t r = d & 31;
  return (d & ~31) + (((r >> 2) & 1) << 4) + ((r >> 3) << 2) + (r & 3);
}
#endif

// Where the paths keep output element d in their accumulators.
template <Math M>
int64_t slot(int64_t d) {
#if KVCHAT_FMA
  if constexpr (M == Math::Fma) return fma_slot(d);
#endif
#if KVCHAT_DPBF16
  if constexpr (M == Math::PairProducts) return dpbf16_slot(d);
#endif
  return d;
}

// The tile's tn rows as fp32 in `tile`, prefetching the matching rows of `next` (the next
// tile's keys or values).
template <typename T, int D>
void widen_rows(const T* src, int64_t stride, int64_t tn, const char* next, const Ahead& ahead,
                float* tile) {
  for (int64_t t = 0; t < tn; ++t) {
    prefetch_row(next, ahead, t);
    const T* row = src + t * stride;
    for (int d = 0; d < D; ++d) tile[t * D + d] = load(row, d);
  }
}

// Online softmax over this head's runs [r0, r1); writes the running max, sum and
// unnormalised output of each query of the group.
template <typename T, int D, Math M>
void attend(const float* q, int G, const std::vector<KeySet>& sets, const KeyRun* runs, int64_t n_runs,
            float scale, float* m, float* l, float* acc) {
  std::vector<float> s(G * TILE), tile(M == Math::Scalar ? TILE * D : 0);
  std::vector<uint16_t> pairs(M == Math::PairProducts ? TILE * D : 0);
  // The queries as the fast paths read them: split into even and odd values per FMA_CHUNK
  // values (FMA), or rounded to bf16 (pair products: exact for the model's bf16 queries).
  std::vector<float> qs(M == Math::Fma ? 2 * G * D : 0);
  constexpr size_t half = FMA_CHUNK / 2;
  for (size_t i = 0; i < qs.size(); ++i) {
    const size_t chunk = i / FMA_CHUNK, k = i % FMA_CHUNK;
    qs[i] = q[chunk * FMA_CHUNK + (k < half ? 2 * k : 2 * (k - half) + 1)];
  }
#if KVCHAT_DPBF16
  std::vector<__m512bh> qb(M == Math::PairProducts ? 2 * G * D / 32 : 0);
  for (size_t i = 0; i < qb.size(); ++i)
    qb[i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * i + 16), _mm512_loadu_ps(q + 32 * i));
#endif
  std::fill(m, m + G, NO_MAX);
  std::fill(l, l + G, 0.f);
  std::fill(acc, acc + G * D, 0.f);
  // Where tile t0 of run r lies, and how wide its rows are.
  auto tile_at = [&](int64_t r, int64_t t0) {
    const KeySet& set = sets[runs[r].set];
    const char* k = static_cast<const char*>(set.k);
    const char* v = static_cast<const char*>(set.v);
    const bool quantized = set.format != Format::Plain;
    const int64_t row =
        quantized ? value_bytes(set.format, D) : set.stride * static_cast<int64_t>(sizeof(T));
    const int64_t start =
        quantized ? runs[r].start : runs[r].start * static_cast<int64_t>(sizeof(T));
    const int64_t rows = runs[r].rows - t0;
    Ahead at{k + start + t0 * row, v + start + t0 * row, row, rows,
             quantized ? row : D * static_cast<int64_t>(sizeof(T))};
    if (quantized) {
      const int64_t scales = start + runs[r].rows * row + t0 * (D / 32) * 2;
      at.k_scales = k + scales;
      at.v_scales = v + scales;
      at.scale_bytes = std::min(rows, TILE) * (D / 32) * 2;
      if (set.format == Format::Int4) at.mins_offset = runs[r].rows * (D / 32) * 2;
    }
    return at;
  };
  std::vector<T> kq, vq;
  for (int64_t r = 0; r < n_runs; ++r) {
    const KeySet& set = sets[runs[r].set];
    const float* qq = q + set.qid * G * D;
    for (int64_t t0 = 0; t0 < runs[r].rows; t0 += TILE) {
      const int64_t tn = std::min(TILE, runs[r].rows - t0);
      Ahead ahead;
      if (t0 + TILE < runs[r].rows)
        ahead = tile_at(r, t0 + TILE);
      else if (r + 1 < n_runs)
        ahead = tile_at(r + 1, 0);
      for (int64_t off = 0; off < ahead.scale_bytes; off += 64) {
        prefetch_line(ahead.k_scales + off);
        prefetch_line(ahead.v_scales + off);
        if (ahead.mins_offset) {
          prefetch_line(ahead.k_scales + ahead.mins_offset + off);
          prefetch_line(ahead.v_scales + ahead.mins_offset + off);
        }
      }
      const Ahead here = tile_at(r, t0);
      const T* kb = reinterpret_cast<const T*>(here.k);
      const T* vb = reinterpret_cast<const T*>(here.v);
      int64_t stride = set.stride;
      if (set.format != Format::Plain) {
        const auto* kblock = static_cast<const uint8_t*>(set.k) + runs[r].start;
        const auto* vblock = static_cast<const uint8_t*>(set.v) + runs[r].start;
        if (kq.empty()) kq.resize(TILE * D), vq.resize(TILE * D);
        const auto dequant = set.format == Format::Int8 ? dequant_int8<T, D> : dequant_int4<T, D>;
        dequant(kblock, runs[r].rows, t0, tn, kq.data());
        dequant(vblock, runs[r].rows, t0, tn, vq.data());
        kb = kq.data();
        vb = vq.data();
        stride = D;
      }
      if constexpr (M == Math::Fma) {
#if KVCHAT_FMA
        scores_fma<D>(qs.data() + set.qid * G * D, G, reinterpret_cast<const uint16_t*>(kb),
                      stride, tn, scale, ahead, s.data());
#endif
      } else if constexpr (M == Math::PairProducts) {
#if KVCHAT_DPBF16
        scores_dpbf16<D>(qb.data() + set.qid * G * D / 32, G,
                         reinterpret_cast<const uint16_t*>(kb), stride, tn, scale, ahead,
                         s.data());
#endif
      } else {
        widen_rows<T, D>(kb, stride, tn, ahead.k, ahead, tile.data());
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
        }
      }
      for (int g = 0; g < G; ++g) {
        float* sg = s.data() + g * TILE;
        float mx = m[g];
        float sum = 0.f;
        if constexpr (M != Math::Scalar) {
#if KVCHAT_FMA
          mx = max_of(sg, tn, mx);
          sum = exp_sum<M == Math::PairProducts>(sg, tn, mx);
#endif
        } else {
          for (int64_t t = 0; t < tn; ++t) mx = std::max(mx, sg[t]);
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < tn; ++t) {
            const float p = std::exp(sg[t] - mx);
            sg[t] = p;
            sum += p;
          }
        }
        const float corr = std::exp(m[g] - mx);
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        float* a = acc + g * D;
        for (int d = 0; d < D; ++d) a[d] *= corr;
      }
      if constexpr (M == Math::Fma) {
#if KVCHAT_FMA
        accumulate_fma<D>(s.data(), G, reinterpret_cast<const uint16_t*>(vb), stride, tn, ahead,
                          acc);
#endif
      } else if constexpr (M == Math::PairProducts) {
#if KVCHAT_DPBF16
        accumulate_dpbf16<D>(s.data(), G, reinterpret_cast<const uint16_t*>(vb), stride, tn,
                             ahead, pairs.data(), acc);
#endif
      } else {
        widen_rows<T, D>(vb, stride, tn, ahead.v, ahead, tile.data());
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
}

template <typename T, int D, Math M>
void attend_heads(const float* q, int64_t n_kv, int G, const std::vector<KeySet>& sets,
                  const std::vector<std::vector<KeyRun>>& runs, float scale, float* out) {
  // Each head's runs are cut into `splits` parts of about equal rows, so that 2 threads share
  // 3 heads evenly; the parts are merged by their softmax statistics.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, (2 * threads + n_kv - 1) / n_kv);
  std::vector<std::vector<int64_t>> cut(n_kv);
  for (int64_t h = 0; h < n_kv; ++h) {
    int64_t total = 0;
    for (const KeyRun& run : runs[h]) total += run.rows;
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
      attend<T, D, M>(q + h * 2 * G * D, G, sets, runs[h].data() + r0, r1 - r0, scale,
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
      for (int d = 0; d < D; ++d) out[(h * G + g) * D + d] = o[slot<M>(d)] / l;
    }
  }
}

template <int D>
void dispatch(bool bf16, Math math, const float* q, int64_t n_kv, int G,
              const std::vector<KeySet>& sets, const std::vector<std::vector<KeyRun>>& runs,
              float scale, float* out) {
  if (!bf16)
    attend_heads<float, D, Math::Scalar>(q, n_kv, G, sets, runs, scale, out);
  else if (math == Math::Fma)
    attend_heads<uint16_t, D, Math::Fma>(q, n_kv, G, sets, runs, scale, out);
  else if (math == Math::PairProducts)
    attend_heads<uint16_t, D, Math::PairProducts>(q, n_kv, G, sets, runs, scale, out);
  else
    attend_heads<uint16_t, D, Math::Scalar>(q, n_kv, G, sets, runs, scale, out);
}

}  // namespace

// q0, q1: [n_heads, 1, D] (any float dtype); per set i: k_srcs[i], v_srcs[i] (contiguous, the
// kv dtype: bf16 or fp32), qids[i], strides[i], rows[i] (rows per run) and starts[i] (int64
// [n_kv, runs_i]); formats[i] (Format): 1 / 2 when the sources are uint8 rows of INT8 / INT4
// blocks (kv/quant.py's pool storage), each run one block of rows[i] rows, starts[i] in bytes,
// strides[i] == D. Returns [n_heads, 1, D] in q0's dtype (computed in fp32).
at::Tensor decode_attention(at::Tensor q0, at::Tensor q1,
                               std::vector<at::Tensor> k_srcs, std::vector<at::Tensor> v_srcs,
                               std::vector<int64_t> qids, std::vector<int64_t> strides,
                               std::vector<int64_t> rows, std::vector<at::Tensor> starts,
                               std::vector<int64_t> formats, int64_t n_kv, double scale) {
  const int64_t n_heads = q0.size(0), D = q0.size(-1), G = n_heads / n_kv;
  TORCH_CHECK(n_heads % n_kv == 0, "n_heads must be a multiple of n_kv");
  TORCH_CHECK(!k_srcs.empty(), "at least one key set");
  TORCH_CHECK(formats.size() == k_srcs.size() && formats[0] == 0, "the first set holds the kv dtype");
  const auto dtype = k_srcs[0].scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "keys must be bf16 or fp32");
  // [n_kv, 2, G, D]: both queries of a head next to each other.
  auto q = at::stack({q0.reshape({n_kv, G, D}), q1.reshape({n_kv, G, D})}, 1)
               .to(at::kFloat)
               .contiguous();
  std::vector<KeySet> sets;
  std::vector<std::vector<KeyRun>> runs(n_kv);
  for (size_t i = 0; i < k_srcs.size(); ++i) {
    TORCH_CHECK(k_srcs[i].is_contiguous() && v_srcs[i].is_contiguous(), "sources must be contiguous");
    TORCH_CHECK(formats[i] >= 0 && formats[i] <= 2, "set ", i, ": format 0, 1 or 2");
    const auto format = static_cast<Format>(formats[i]);
    const bool quantized = format != Format::Plain;
    const auto want = quantized ? at::kByte : dtype;
    TORCH_CHECK(k_srcs[i].scalar_type() == want && v_srcs[i].scalar_type() == want,
                "set ", i, quantized ? ": quantized blocks are uint8 rows" : ": one dtype");
    TORCH_CHECK(!quantized || strides[i] == D, "quantized rows are D values apart");
    sets.push_back({k_srcs[i].data_ptr(), v_srcs[i].data_ptr(), static_cast<int>(qids[i]),
                    strides[i], format});
    // A quantized block's rows are followed by their fp16 scales (and minimums).
    const int64_t extent = quantized ? rows[i] * (value_bytes(format, D) + meta_bytes(format, D))
                                     : (rows[i] - 1) * strides[i] + D;
    auto st = starts[i].contiguous();
    TORCH_CHECK(st.scalar_type() == at::kLong && st.dim() == 2 && st.size(0) == n_kv, "starts: int64 [n_kv, runs]");
    const int64_t* p = st.data_ptr<int64_t>();
    const int64_t numel = k_srcs[i].numel();
    TORCH_CHECK(v_srcs[i].numel() == numel, "K and V sources of a set differ in size");
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t r = 0; r < st.size(1); ++r) {
        const int64_t start = p[h * st.size(1) + r];
        if (rows[i] == 0) continue;
        TORCH_CHECK(start >= 0 && start + extent <= numel,
                    "a run of set ", i, " reads outside its source");
        runs[h].push_back({static_cast<int>(i), start, rows[i]});
      }
  }
  for (int64_t h = 0; h < n_kv; ++h) TORCH_CHECK(!runs[h].empty(), "every head needs a key");
  auto out = at::empty({n_kv, G, D}, q.options());
  const bool bf16_queries =
      q0.scalar_type() == at::kBFloat16 && q1.scalar_type() == at::kBFloat16;
  kvchat::attend_sets(q.data_ptr<float>(), n_kv, G, D, dtype == at::kBFloat16, bf16_queries,
                      sets, runs, static_cast<float>(scale), out.data_ptr<float>());
  // Converted here rather than by a torch call from Python (one op less per layer and step).
  return out.view({n_heads, 1, D}).to(q0.scalar_type());
}

void kvchat::attend_sets(const float* q, int64_t n_kv, int64_t G, int64_t D, bool bf16,
                         bool bf16_queries, const std::vector<KeySet>& sets,
                         const std::vector<std::vector<KeyRun>>& runs, float scale, float* out) {
  // Pair products are exact for bf16 queries and keys, so their scores differ from converting
  // both to fp32 only in the order of the fp32 sums; the widened keys' FMAs are exact for any.
  Math math = Math::Scalar;
  if (KVCHAT_DPBF16 && PAIR_PRODUCTS_FASTER && bf16_queries)
    math = Math::PairProducts;
  else if (KVCHAT_FMA)
    math = Math::Fma;
  const int g = static_cast<int>(G);
  switch (D) {
    case 32: dispatch<32>(bf16, math, q, n_kv, g, sets, runs, scale, out); break;
    case 64: dispatch<64>(bf16, math, q, n_kv, g, sets, runs, scale, out); break;
    case 128: dispatch<128>(bf16, math, q, n_kv, g, sets, runs, scale, out); break;
    case 256: dispatch<256>(bf16, math, q, n_kv, g, sets, runs, scale, out); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, got ", D);
  }
}
