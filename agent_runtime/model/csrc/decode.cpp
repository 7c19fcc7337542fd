// One decode step of `MoEModel` (one new token per row, KV cache in place) as a single C++
// call. It issues the same operations, in the same order and with the same arguments, as
// `MoEModel.forward` does for a one-token step, so its logits and routes are bitwise those of
// the Python path; what it removes is the interpreter between ~70 small operations per layer.
// Its common case (bf16, no biases, int8 copies of every weight `quantize` copies or of none)
// runs on pointers (`decode_direct`), the same kernels without those operations between them.
// Its bf16 matmuls of at most 8 rows run in `rows_linear` below, which `model.linear` calls
// for them too. Supported: every layer MoE, softmax-then-top-k routing, q/k norm per head or
// none, no shared expert, no multipliers (see `fast_decode.supported`).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif

namespace {

// ---- few-row bf16 matmul: y [M, N] = x [M, K] @ w [N, K]^T (+ b), M <= kRows -------------
// Each output is a dot product accumulated in 16 fp32 lanes in increasing k (with AVX512-BF16,
// pairs of bf16 products per lane; otherwise fused multiply-adds, lane k % 16), the lanes
// summed by a fixed tree and rounded once to bf16 (round to nearest even). Its bits depend
// only on x's row and w's row: not on M, N, the thread count or the split of N between
// threads, so the Python path (`model.linear`) and this step, calling it alike, agree bitwise,
// and a row decodes to the same bits alone or in a batch. The weights are read once for all
// rows (oneDNN, which `at::mm` uses for bf16 here, costs ~10 us of setup per call, more than a
// 256x256 matrix takes to read).

constexpr int64_t kRows = 8;
constexpr int64_t kPackedRows = 32;   // query rows a kv head from which attention packs keys
constexpr int kLanes = 16;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(uint16_t v) { return bf16_to_float(v); }   // a weight as fp32, exactly
inline float widen(int8_t v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
// 8 weights widened to fp32, exactly: bf16 bits << 16, or int8 to int32 to fp32
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// lo[m], hi[m] (lanes 0-7 and 8-15) += x's row m times weight row wr for k < full (a multiple
// of 16), one fused multiply-add a lane and k, in increasing k
template <int M, class W>
inline void fma_lanes(const float* x, const W* wr, int64_t K, int64_t full, __m256 (&lo)[M],
                      __m256 (&hi)[M]) {
  for (int64_t k = 0; k < full; k += kLanes) {
    const __m256 w0 = widen8(wr + k), w1 = widen8(wr + k + 8);
    for (int m = 0; m < M; ++m) {
      lo[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, hi[m]);
    }
  }
}
#endif

// The fp32 lanes of NB x M dot products (AVX2, or no vector instructions): lane l of acc[j][m]
// sums x[m][k] * w[n + j][k] over the k = l (mod 16), in increasing k
template <int M, int NB, class W>
inline void dot_lanes(const float* x, const W* w, int64_t K, int64_t n,
                      float (&acc)[NB][M][kLanes]) {
#if defined(__AVX2__) && defined(__FMA__)
  // AVX2 + FMA (most laptops without AVX512): the 16 lanes as two ymm registers (lanes 0-7 and
  // 8-15), `fma_lanes`: bitwise the portable loop (#else), the partial last block too.
  const int64_t full = K / kLanes * kLanes;
  for (int j = 0; j < NB; ++j) {      // w's rows one after another: one stream (`kBlock`)
    const W* wr = w + (n + j) * K;
    __m256 lo[M], hi[M];
    for (int m = 0; m < M; ++m) {
      lo[m] = _mm256_loadu_ps(acc[j][m]);
      hi[m] = _mm256_loadu_ps(acc[j][m] + 8);
    }
    fma_lanes<M>(x, wr, K, full, lo, hi);
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(acc[j][m], lo[m]);
      _mm256_storeu_ps(acc[j][m] + 8, hi[m]);
      for (int64_t k = full; k < K; ++k)
        acc[j][m][k - full] = std::fma(x[m * K + k], widen(wr[k]), acc[j][m][k - full]);
    }
  }
#else
  for (int j = 0; j < NB; ++j)        // w's rows one after another: one stream (`kBlock`)
    for (int64_t k = 0; k < K; k += kLanes) {
      const int64_t width = std::min<int64_t>(kLanes, K - k);
      for (int m = 0; m < M; ++m)
        for (int64_t l = 0; l < width; ++l)
          acc[j][m][l] = std::fma(x[m * K + k + l], widen(w[(n + j) * K + k + l]), acc[j][m][l]);
    }
#endif
}

inline float lane_sum(const float* a) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#if defined(__AVX512F__)
inline float lane_sum(__m512 a) {  // the same tree in registers
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 t = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m512 widen_bf16(__m256i h) {  // 16 bf16 to fp32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 from memory, widened exactly
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 to bf16 as `at::BFloat16(float)` rounds them: to nearest even, NaN to 0x7FC0
inline __m256i bf16_round(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                                          _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                          _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 bf16_rounded(__m512 v) { return widen_bf16(bf16_round(v)); }   // fp32 again
#endif

#if defined(__AVX512F__)
// out[i] = lane_sum(v[i]) for the 8 vectors v[0..7], bitwise: the same pairs added in the same
// tree, but eight sums at a time across registers (a transpose as it adds) instead of one
// horizontal sum each: 8 additions and 17 shuffles for eight sums, where eight `lane_sum`s
// take 32 and 32. At K = 64 (attention's scores: two dot-product instructions a sum) those
// cost more than the products.
inline void lane_sums8(const __m512* v, float* out) {
  __m512 c[4], e[2];
  for (int i = 0; i < 4; ++i)       // s8: lanes 0-7 v[2i]'s a[l] + a[l + 8], 8-15 v[2i + 1]'s
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)       // s4: quarter q is v[4i + q]'s s8[l] + s8[l + 4]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // quarter q: v[q]'s s4[0] + s4[2], s4[1] + s4[3], then v[4 + q]'s
  const __m512 g = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))));
  // quarter q: v[q]'s sum, v[4 + q]'s (and the two again)
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(g, g, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(g, g, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m256i order = _mm256_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13);  // v[0..7]'s lanes
  _mm256_storeu_ps(out, _mm512_castps512_ps256(
      _mm512_permutexvar_ps(_mm512_castsi256_si512(order), r)));
}

// The NB x M dot products of `dot_rows` (fp32 lanes in registers) summed by `lane_sum`'s
// tree (eight at a time, `lane_sums8`), biased and rounded once into y.
template <int M, int NB, class Out>
inline void store_rows(const __m512 (&acc)[NB][M], int64_t n, const float* bias, Out* y,
                       int64_t N, const float* scale = nullptr) {
  constexpr int C = NB * M;
  __m512 v[(C + 7) / 8 * 8];
  float s[(C + 7) / 8 * 8];
  for (int i = 0; i < C; ++i) v[i] = acc[i / M][i % M];
  for (int i = C; i < (C + 7) / 8 * 8; ++i) v[i] = _mm512_setzero_ps();
  for (int i = 0; i < C; i += 8)
    lane_sums8(v + i, s + i);
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) {
      float t = s[j * M + m];
      if (scale) t *= scale[n + j];
      if (bias) t += bias[n + j];
      y[m * N + n + j] = Out(t);
    }
}
#else
// The NB x M dot products of `dot_rows` (fp32 lanes in an array) summed by `lane_sum`,
// biased and rounded once into y.
template <int M, int NB, class Lanes, class Out>
inline void store_rows(const Lanes (&acc)[NB][M], int64_t n, const float* bias, Out* y,
                       int64_t N, const float* scale = nullptr) {
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) {
      float s = lane_sum(acc[j][m]);
      if (scale) s *= scale[n + j];
      if (bias) s += bias[n + j];
      y[m * N + n + j] = Out(s);
    }
}
#endif

// Rows n..n+NB of w against the M rows of x (NB rows at a time for independent accumulators).
#if defined(__AVX512BF16__)
using XRow = uint16_t;  // x as stored (bf16)
// step(k, load) over k = 0, 32, 64, ... < K: whole blocks of 32 bf16 with plain loads, then
// the partial last block with a masked one (zeros past K)
template <class Step>
inline void bf16_blocks(int64_t K, Step step) {
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes)
    step(k, [](const uint16_t* p) { return _mm512_loadu_si512(p); });
  if (k < K) {
    const __mmask32 mask = (__mmask32(1) << (K - k)) - 1;
    step(k, [mask](const uint16_t* p) { return _mm512_maskz_loadu_epi16(mask, p); });
  }
}

// AVX512-BF16: one instruction multiplies 16 pairs of bf16 and adds them to 16 fp32 lanes (lane
// l takes k = 32c + 2l and 32c + 2l + 1), reading x and w as stored, without conversion.
// `Stream`: w's NB rows one after another (`kBlock`); false: side by side along k, each x load
// serving NB products, for keys that sit in cache (attention's scores), where that was faster
// for several rows of x. The same bits either way.
template <int M, int NB, bool Stream = true, class Out>
inline void dot_rows(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n,
                     const float* bias, Out* y, int64_t N) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  if constexpr (!Stream && M > 1) {
    bf16_blocks(K, [&](int64_t k, auto load) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)load(x + m * K + k);
      for (int j = 0; j < NB; ++j) {
        const __m512bh wv = (__m512bh)load(w + (n + j) * K + k);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv[m], wv);
      }
    });
  } else {
    for (int j = 0; j < NB; ++j) {    // w's rows one after another: one stream (`kBlock`)
      const uint16_t* wr = w + (n + j) * K;
      bf16_blocks(K, [&](int64_t k, auto load) {
        const __m512bh wv = (__m512bh)load(wr + k);
        for (int m = 0; m < M; ++m)
          acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)load(x + m * K + k), wv);
      });
    }
  }
  store_rows<M, NB>(acc, n, bias, y, N);
}
#elif defined(__AVX512F__)
using XRow = float;     // x converted to fp32 once
template <int M, int NB, bool Stream = true, class Out>   // Stream unused: always a stream
inline void dot_rows(const float* x, const uint16_t* w, int64_t K, int64_t n, const float* bias,
                     Out* y, int64_t N) {
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int j = 0; j < NB; ++j) {      // w's rows one after another, as the loop above
    const uint16_t* wr = w + (n + j) * K;
    auto step = [&](int64_t k, auto load_x, auto load_w) {
      const __m512 wv = widen_bf16(load_w(wr + k));
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(load_x(x + m * K + k), wv, acc[j][m]);
    };
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes)
      step(k, [](const float* p) { return _mm512_loadu_ps(p); }, [](const uint16_t* p) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      });
    if (k < K) {
      const __mmask16 mask = __mmask16((1u << (K - k)) - 1);
      step(k, [mask](const float* p) { return _mm512_maskz_loadu_ps(mask, p); },
           [mask](const uint16_t* p) { return _mm256_maskz_loadu_epi16(mask, p); });
    }
  }
  store_rows<M, NB>(acc, n, bias, y, N);
}
#else
using XRow = float;
#if defined(__AVX2__) && defined(__FMA__)
// out[i] = lane_sum(a_i) for 8 dot products at once, given s8[i] = lanes 0-7 of a_i plus lanes
// 8-15 (`lane_sum`'s first level): the same pairs added in the same tree, across registers
// (AVX512's `lane_sums8` in halves), instead of 15 scalar additions a sum. At K = 64
// (attention's scores: eight multiply-adds a sum) those cost more than the products.
inline void lane_sums8(const __m256* s8, float* out) {
  __m256 u[4];
  for (int i = 0; i < 4; ++i)     // s4 of s8[2i] (low half), of s8[2i + 1] (high half)
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x31));
  __m256 g[2];
  for (int i = 0; i < 2; ++i)     // s4[0] + s4[2] and s4[1] + s4[3] of u[2i]'s, then u[2i + 1]'s
    g[i] = _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]))),
        _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]))));
  // low half: the sums of s8[0], s8[2], s8[4], s8[6]; high half: of s8[1], s8[3], s8[5], s8[7]
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// s8[m] = lanes 0-7 plus lanes 8-15 of the 16 lanes of x's row m against one weight row (K a
// multiple of 16): `dot_lanes`' fused multiply-adds (`fma_lanes`), kept in registers
template <int MB>
inline void dot_s8(const float* x, const uint16_t* wr, int64_t K, __m256* s8) {
  __m256 lo[MB], hi[MB];
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  fma_lanes<MB>(x, wr, K, K, lo, hi);
  for (int m = 0; m < MB; ++m) s8[m] = _mm256_add_ps(lo[m], hi[m]);
}
#endif

// AVX2 + FMA: each weight row against x's rows four at a time (eight registers of sums), the
// lanes summed eight products at a time (`lane_sums8`); bitwise `dot_lanes` and `store_rows`
// (the portable path, and this one's where K is not a multiple of 16).
template <int M, int NB, bool Stream = true, class Out>   // Stream unused: always a stream
inline void dot_rows(const float* x, const uint16_t* w, int64_t K, int64_t n, const float* bias,
                     Out* y, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if (K % kLanes == 0) {
    constexpr int C = NB * M, CP = (C + 7) / 8 * 8, M4 = M / 4 * 4;
    __m256 s8[CP];
    float s[CP];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* wr = w + (n + j) * K;
      for (int m = 0; m < M4; m += 4) dot_s8<4>(x + m * K, wr, K, s8 + j * M + m);
      if constexpr (M % 4 != 0) dot_s8<M % 4>(x + M4 * K, wr, K, s8 + j * M + M4);
    }
    for (int i = C; i < CP; ++i) s8[i] = _mm256_setzero_ps();
    for (int i = 0; i < C; i += 8) lane_sums8(s8 + i, s + i);
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) {
        float t = s[j * M + m];
        if (bias) t += bias[n + j];
        y[m * N + n + j] = Out(t);
      }
    return;
  }
#endif
  float acc[NB][M][kLanes] = {};
  dot_lanes<M, NB>(x, w, K, n, acc);
  store_rows<M, NB>(acc, n, bias, y, N);
}

#if defined(__AVX2__) && defined(__FMA__)
// M rows of x against w's rows begin..end in S streams: the range cut into S equal runs, a
// step taking one row of each run side by side along k, so S reads are in flight at a time
// far apart (separate pages) instead of one row after another. A single row of x reads its
// weights at 16-20 GB/s from one stream on a 2-core AVX2-only AMD EPYC, 21-27 from four (a 256
// MB matrix of K = 1,024, both cores; PyTorch's sum of 256 MB read 22-23 there); rows adjacent
// along k (`dot_lanes` side by side) were slower than one stream (11-21). Each product is
// still its pair's `fma_lanes` chains and `lane_sums8` tree, so the same bits as `dot_rows`.
// A step takes P rows of each run (S x M x P sums, eight at a time through the tree); returns
// the first row it did not take (the S runs cover begin..begin + S x run). W: bf16 weights, or
// int8 copies (`int8_span`) whose row's scale multiplies the sum before the bias, as
// `store_rows` does.
template <int S, int M, class W, class Out>
inline int64_t row_streams(const float* x, const W* w, int64_t K, const float* bias,
                           Out* y, int64_t N, int64_t begin, int64_t end,
                           const float* scale = nullptr) {
  constexpr int C = S * M, P = C < 8 && 8 % C == 0 ? 8 / C : 1, CP = (C * P + 7) / 8 * 8;
  const int64_t run = (end - begin) / S / P * P;    // rows of each stream, P a step
  for (int64_t i = 0; i < run; i += P) {
    __m256 s8[CP];
    for (int p = 0; p < P; ++p) {
      const W* wr[S];
      __m256 lo[S][M], hi[S][M];
      for (int r = 0; r < S; ++r) {
        wr[r] = w + (begin + r * run + i + p) * K;
        for (int m = 0; m < M; ++m) lo[r][m] = hi[r][m] = _mm256_setzero_ps();
      }
      for (int64_t k = 0; k < K; k += kLanes)
        for (int r = 0; r < S; ++r) {
          const __m256 w0 = widen8(wr[r] + k), w1 = widen8(wr[r] + k + 8);
          for (int m = 0; m < M; ++m) {
            lo[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, lo[r][m]);
            hi[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, hi[r][m]);
          }
        }
      for (int r = 0; r < S; ++r)
        for (int m = 0; m < M; ++m) s8[(p * S + r) * M + m] = _mm256_add_ps(lo[r][m], hi[r][m]);
    }
    for (int c = C * P; c < CP; ++c) s8[c] = _mm256_setzero_ps();
    float s[CP];
    for (int c = 0; c < CP; c += 8) lane_sums8(s8 + c, s + c);
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < S; ++r) {
        const int64_t n = begin + r * run + i + p;
        for (int m = 0; m < M; ++m) {
          float t = s[(p * S + r) * M + m];
          if (scale) t *= scale[n];
          if (bias) t += bias[n];
          y[m * N + n] = Out(t);
        }
      }
  }
  return begin + S * run;
}
#endif
#endif

// exp(x) for x <= 0 as 2^n * p(r), r = x - n ln 2 (ln 2 in two parts), p a degree-7 polynomial
// in r (|error| ~1 ulp), 0 below e^-87: `exp_ps`, `exp8_ps` and `exp_one` take the same steps in
// 16, 8 and 1 lanes, so the same bits
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {   // x <= 0: 2^n * p(r), r = x - n ln 2, |error| ~1 ulp
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));   // below e^-87: 0
}

// s[t] = t < last and m[t] (or no m) ? s[t] * sc : -inf for t < n; returns their max. Max
// and the product are exact, so 16 lanes at a time give the scalar loop's bits.
inline float scale_visible(float* s, int64_t n, int64_t last, const bool* m, float sc) {
  const __m512 scale = _mm512_set1_ps(sc), hidden = _mm512_set1_ps(-INFINITY);
  __m512 mx = hidden;
  for (int64_t t = 0; t < n; t += kLanes) {
    const int64_t live = std::min<int64_t>(kLanes, std::max<int64_t>(0, std::min(n, last) - t));
    __mmask16 keep = live >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    const int64_t width = std::min<int64_t>(kLanes, n - t);
    const __mmask16 in = width >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
    if (m && keep)                                   // bools as bytes: seen where nonzero
      keep &= _mm_test_epi8_mask(_mm_maskz_loadu_epi8(keep, m + t), _mm_set1_epi8(-1));
    const __m512 v = _mm512_mask_mul_ps(hidden, keep, _mm512_maskz_loadu_ps(keep, s + t), scale);
    _mm512_mask_storeu_ps(s + t, in, v);
    mx = _mm512_mask_max_ps(mx, in, mx, v);
  }
  return _mm512_reduce_max_ps(mx);
}

// s[t] = exp(s[t] - mx) for t < n (exp(-inf) = 0); returns the sum over the columns the row
// sees (t < last, and m[t] where there is a mask) in 16 lanes, the i-th seen column in lane
// i % 16 in increasing i, summed by `lane_sum`'s tree. So the sum's bits do not depend on
// where padding puts a row's keys ([pad | cached prefix | pad | new tokens] in a batch): a
// row gets the bits it gets alone. Without a mask, column t is the t-th seen.
inline float exp_lanes(float* s, int64_t n, float mx, const bool* m = nullptr,
                       int64_t last = -1) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(mx);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t rank = 0;                                  // seen columns before t
  for (int64_t t = 0; t < n; t += kLanes) {
    const __mmask16 mask = n - t >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_mask_loadu_ps(x, mask, s + t), x));
    _mm512_mask_storeu_ps(s + t, mask, e);
    if (!m) {
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
      continue;
    }
    const int64_t live = std::min<int64_t>(kLanes, std::max<int64_t>(0, (last < 0 ? n : last) - t));
    __mmask16 seen = live >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    seen &= mask;
    if (seen) seen &= _mm_test_epi8_mask(_mm_maskz_loadu_epi8(seen, m + t), _mm_set1_epi8(-1));
    // the seen columns packed to the low lanes, then turned so the i-th lands in lane
    // (rank + i) % 16: each lane gets at most one, in increasing rank
    const __m512 c = _mm512_maskz_compress_ps(seen, e);
    const __m512i from = _mm512_and_si512(
        _mm512_sub_epi32(iota, _mm512_set1_epi32(static_cast<int>(rank % kLanes))),
        _mm512_set1_epi32(kLanes - 1));
    sum = _mm512_add_ps(sum, _mm512_permutexvar_ps(from, c));
    rank += __builtin_popcount(static_cast<unsigned>(seen));
  }
  return lane_sum(sum);
}

// whether any of the GN rows of p (row stride ps) gives position t a weight
template <int GN>
inline bool weighed(const float* p, int64_t ps, int64_t t) {
  bool any = false;
  for (int j = 0; j < GN; ++j) any |= p[j * ps + t] != 0.0f;
  return any;
}

// `values_block` over DP whole blocks of 32 lanes: each position's 32 bf16 values read as 16
// pairs and widened in two instructions, the even ones (shifted up) and the odd ones (masked),
// instead of two loads and two conversions per 16; the lanes are the same values in another
// order, each with the same chain of fused multiply-adds, put back in order at the end. So the
// same bits with half the widening.
template <int GN, int DP>
inline void values_pairs(const float* p, int64_t ps, int64_t S, const uint16_t* v, int64_t D,
                         int64_t d, float* acc, bool more, bool dense) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 ae[GN][DP], ao[GN][DP];
  for (int j = 0; j < GN; ++j)
    for (int b = 0; b < DP; ++b) {
      if (!more) {
        ae[j][b] = ao[j][b] = _mm512_setzero_ps();
        continue;
      }
      const float* a = acc + j * D + d + 32 * b;
      const __m512 x0 = _mm512_loadu_ps(a), x1 = _mm512_loadu_ps(a + kLanes);
      ae[j][b] = _mm512_permutex2var_ps(x0, even, x1);
      ao[j][b] = _mm512_permutex2var_ps(x0, odd, x1);
    }
  for (int64_t t = 0; t < S; ++t) {
    if (!dense && !weighed<GN>(p, ps, t)) continue;
    const uint16_t* vp = v + t * D + d;
    __m512 ve[DP], vo[DP];
    for (int b = 0; b < DP; ++b) {
      const __m512i x = _mm512_loadu_si512(vp + 32 * b);
      ve[b] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vo[b] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
    for (int j = 0; j < GN; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * ps + t]);
      for (int b = 0; b < DP; ++b) {
        ae[j][b] = _mm512_fmadd_ps(pj, ve[b], ae[j][b]);
        ao[j][b] = _mm512_fmadd_ps(pj, vo[b], ao[j][b]);
      }
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int b = 0; b < DP; ++b) {
      float* a = acc + j * D + d + 32 * b;
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(ae[j][b], lo, ao[j][b]));
      _mm512_storeu_ps(a + kLanes, _mm512_permutex2var_ps(ae[j][b], hi, ao[j][b]));
    }
}

// acc[j, d:d+16*DB] = sum over t < S, in increasing t, of p[j * ps + t] * v[t, d:d+16*DB] for
// the GN rows j of acc (row stride D), in registers; the last of the DB blocks of 16 lanes may
// be partial (the values end at D). Each position's values are read and widened once for all
// DB blocks and GN rows. A position every row gives weight 0 (masked: exp(-inf)) is skipped,
// so what it holds (NaN in a cache column never written) never reaches a row; adding a
// product with weight 0 would not change a sum's bits anyway, so a row's result does not
// depend on the rows beside it. `dense`: every position is a written column (no mask), so the
// check, which costs about what the products do, is left out.
template <int GN, int DB>
inline void values_block(const float* p, int64_t ps, int64_t S, const uint16_t* v, int64_t D,
                         int64_t d, float* acc, bool more, bool dense) {
  if constexpr (DB % 2 == 0) {
    if (D - d >= kLanes * DB)
      return values_pairs<GN, DB / 2>(p, ps, S, v, D, d, acc, more, dense);
  }
  const int64_t tail = D - d - kLanes * (DB - 1);            // lanes of the last block
  const bool full = tail >= kLanes;
  const __mmask16 mask = full ? __mmask16(0xFFFF) : __mmask16((1u << tail) - 1);
  __m512 a[GN][DB];
  for (int j = 0; j < GN; ++j)
    for (int b = 0; b < DB; ++b)
      a[j][b] = !more ? _mm512_setzero_ps()
                : b + 1 < DB ? _mm512_loadu_ps(acc + j * D + d + b * kLanes)
                             : _mm512_maskz_loadu_ps(mask, acc + j * D + d + b * kLanes);
  for (int64_t t = 0; t < S; ++t) {
    if (!dense && !weighed<GN>(p, ps, t)) continue;
    const uint16_t* vp = v + t * D + d;
    __m512 vv[DB];
    for (int b = 0; b + 1 < DB; ++b)
      vv[b] = load_bf16(vp + b * kLanes);
    const uint16_t* last = vp + (DB - 1) * kLanes;
    vv[DB - 1] = widen_bf16(full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last))
                                 : _mm256_maskz_loadu_epi16(mask, last));
    for (int j = 0; j < GN; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * ps + t]);
      for (int b = 0; b < DB; ++b) a[j][b] = _mm512_fmadd_ps(pj, vv[b], a[j][b]);
    }
  }
  for (int j = 0; j < GN; ++j) {
    for (int b = 0; b + 1 < DB; ++b) _mm512_storeu_ps(acc + j * D + d + b * kLanes, a[j][b]);
    _mm512_mask_storeu_ps(acc + j * D + d + (DB - 1) * kLanes, mask, a[j][DB - 1]);
  }
}

template <int GN>
inline void values_blocks(int64_t DB, const float* p, int64_t ps, int64_t S, const uint16_t* v,
                          int64_t D, int64_t d, float* acc, bool more, bool dense) {
  switch (DB) {
    case 1: values_block<GN, 1>(p, ps, S, v, D, d, acc, more, dense); break;
    case 2: values_block<GN, 2>(p, ps, S, v, D, d, acc, more, dense); break;
    case 3: values_block<GN, 3>(p, ps, S, v, D, d, acc, more, dense); break;
    default: values_block<GN, 4>(p, ps, S, v, D, d, acc, more, dense); break;
  }
}

// acc [R, D] = p [R, S] (row stride ps) @ v [S, D] (bf16 values, fp32 sums): up to 4 rows and
// 64 lanes of D at a time, one pass over the positions each. `more`: go on from the sums
// already in acc (the same chain of fused multiply-adds as one call over both ranges).
inline void weighted_values(int64_t R, const float* p, int64_t ps, int64_t S, const uint16_t* v,
                            int64_t D, float* acc, bool more = false, bool dense = false) {
  if (R > 4 && R <= 8) {            // 5-8 rows in one pass over the positions, 32 lanes of D
    for (int64_t d = 0; d < D; d += 2 * kLanes) {
      const int64_t blocks = std::min<int64_t>(2, (D - d + kLanes - 1) / kLanes);
      auto two = [&](auto gn) {
        constexpr int GN = decltype(gn)::value;
        if (blocks == 1) values_block<GN, 1>(p, ps, S, v, D, d, acc, more, dense);
        else values_block<GN, 2>(p, ps, S, v, D, d, acc, more, dense);
      };
      switch (R) {
        case 5: two(std::integral_constant<int, 5>()); break;
        case 6: two(std::integral_constant<int, 6>()); break;
        case 7: two(std::integral_constant<int, 7>()); break;
        default: two(std::integral_constant<int, 8>()); break;
      }
    }
    return;
  }
  for (int64_t d = 0; d < D; d += 4 * kLanes) {
    const int64_t blocks = std::min<int64_t>(4, (D - d + kLanes - 1) / kLanes);
    for (int64_t r = 0; r < R; r += 4) {
      const float* pr = p + r * ps;
      float* ar = acc + r * D;
      switch (std::min<int64_t>(4, R - r)) {
        case 1: values_blocks<1>(blocks, pr, ps, S, v, D, d, ar, more, dense); break;
        case 2: values_blocks<2>(blocks, pr, ps, S, v, D, d, ar, more, dense); break;
        case 3: values_blocks<3>(blocks, pr, ps, S, v, D, d, ar, more, dense); break;
        default: values_blocks<4>(blocks, pr, ps, S, v, D, d, ar, more, dense); break;
      }
    }
  }
}
#else
// Without AVX512: the same three steps with the same bits, 8 lanes at a time with AVX2 (exp
// as `exp_ps` computes it, one value at a time past the last whole 8).
inline float exp_one(float x) {    // `exp_ps`, one lane: the same operations, so the same bits
  if (!(x >= -87.0f)) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpP[i]);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8_ps(__m256 x) {  // `exp_ps` in 8 lanes: 2^n built in the exponent bits
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  // x >= -87: n >= -126, so 2^n is a normal float and p * 2^n rounds once, as scalef does
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
#endif

inline float scale_visible(float* s, int64_t n, int64_t last, const bool* m, float sc) {
  float mx = -INFINITY;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t seen = std::min(n, std::max<int64_t>(0, last));  // columns before `last`
  const __m256 scale = _mm256_set1_ps(sc), hidden = _mm256_set1_ps(-INFINITY);
  __m256 top = hidden;
  for (; j + 8 <= seen; j += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), scale);
    if (m) {                                         // bools as bytes: seen where nonzero
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + j)));
      v = _mm256_blendv_ps(hidden, v, _mm256_castsi256_ps(
                                          _mm256_cmpgt_epi32(b, _mm256_setzero_si256())));
    }
    _mm256_storeu_ps(s + j, v);
    top = _mm256_max_ps(v, top);
  }
  float tops[8];
  _mm256_storeu_ps(tops, top);
  for (float t : tops) mx = std::max(mx, t);         // max is exact: any order, the same value
#endif
  for (; j < n; ++j) {
    s[j] = j >= last || (m && !m[j]) ? -INFINITY : s[j] * sc;
    mx = std::max(mx, s[j]);
  }
  return mx;
}

inline float exp_lanes(float* s, int64_t n, float mx, const bool* m = nullptr,
                       int64_t last = -1) {
  float lanes[kLanes] = {};
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 x = _mm256_set1_ps(mx);
  for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), x)));
#endif
  for (; t < n; ++t) s[t] = exp_one(s[t] - mx);
  t = 0;
  if (!m) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();   // lanes 0-7 and 8-15
    for (; t + kLanes <= n; t += kLanes) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(s + t));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(s + t + 8));
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
#endif
    for (; t < n; ++t) lanes[t % kLanes] += s[t];
    return lane_sum(lanes);
  }
  int64_t rank = 0;                  // as the AVX512 loop: lane i % 16 for the i-th seen column
  for (; t < n; ++t)
    if ((last < 0 || t < last) && m[t]) lanes[rank++ % kLanes] += s[t];
  return lane_sum(lanes);
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[j, d:d+8*DB] += p[j * ps + t] * v[t, d:d+8*DB] over t < S in increasing t, for the GN
// rows j (row stride D), in registers: `values_block`'s plan in 8 lanes, the same chain of
// fused multiply-adds a value, so the same bits. A position none of the GN rows weighs is
// skipped (`values_block`: so a never-written column's NaN cannot reach a row).
template <int GN, int DB>
inline void values8(const float* p, int64_t ps, int64_t S, const uint16_t* v, int64_t D,
                    int64_t d, float* acc, bool dense) {
  __m256 a[GN][DB];
  for (int j = 0; j < GN; ++j)
    for (int b = 0; b < DB; ++b) a[j][b] = _mm256_loadu_ps(acc + j * D + d + 8 * b);
  for (int64_t t = 0; t < S; ++t) {
    bool any = dense;
    for (int j = 0; j < GN && !any; ++j) any = p[j * ps + t] != 0.0f;
    if (!any) continue;
    __m256 vv[DB];
    for (int b = 0; b < DB; ++b) vv[b] = widen8(v + t * D + d + 8 * b);
    for (int j = 0; j < GN; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j * ps + t]);
      for (int b = 0; b < DB; ++b) a[j][b] = _mm256_fmadd_ps(pj, vv[b], a[j][b]);
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int b = 0; b < DB; ++b) _mm256_storeu_ps(acc + j * D + d + 8 * b, a[j][b]);
}
#endif

inline void weighted_values(int64_t R, const float* p, int64_t ps, int64_t S, const uint16_t* v,
                            int64_t D, float* acc, bool more = false,
                            bool dense = false) {
  if (!more) std::fill(acc, acc + R * D, 0.0f);
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {   // 8 registers of sums: four rows and 16 lanes of D at a time (a value
    int64_t r = 0;    // widened once for four rows), then two (or one) rows and 32 lanes
    for (; r + 4 <= R; r += 4)
      for (int64_t d = 0; d < D; d += 16) {
        if (D - d >= 16) values8<4, 2>(p + r * ps, ps, S, v, D, d, acc + r * D, dense);
        else values8<4, 1>(p + r * ps, ps, S, v, D, d, acc + r * D, dense);
      }
    for (; r < R; r += 2)
      for (int64_t d = 0; d < D; d += 32) {
        const float* pr = p + r * ps;
        float* ar = acc + r * D;
        const int64_t blocks = std::min<int64_t>(4, (D - d) / 8);
        auto rows = [&](auto gn) {
          constexpr int GN = decltype(gn)::value;
          switch (blocks) {
            case 1: values8<GN, 1>(pr, ps, S, v, D, d, ar, dense); break;
            case 2: values8<GN, 2>(pr, ps, S, v, D, d, ar, dense); break;
            case 3: values8<GN, 3>(pr, ps, S, v, D, d, ar, dense); break;
            default: values8<GN, 4>(pr, ps, S, v, D, d, ar, dense); break;
          }
        };
        if (R - r >= 2) rows(std::integral_constant<int, 2>());
        else rows(std::integral_constant<int, 1>());
      }
    return;
  }
#endif
  for (int64_t t = 0; t < S; ++t) {
    bool any = false;
    for (int64_t r = 0; r < R; ++r) any |= p[r * ps + t] != 0.0f;
    if (!any) continue;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d)
        acc[r * D + d] = std::fma(p[r * ps + t], bf16_to_float(v[t * D + d]), acc[r * D + d]);
  }
}
#endif

// Weight rows a `dot_rows` step takes for M rows of x: NB x M accumulators in zmm registers,
// their lanes summed eight at a time at the end. The step reads w's NB rows one after another,
// each to its end (every row of x against each weight chunk), so memory is one sequential
// stream, which the hardware prefetcher follows at the bandwidth a plain sum reads. Reading
// the NB rows side by side along k (one x load serving NB products) made NB streams 2K apart:
// on a 2-core AMD EPYC, one row of x then read weights from memory at 20 GB/s against 36-37
// (1,024 x 1,024), and in the decode of a 0.5 B MoE (`bench/decode.py`), one against the
// other alternated in one process, one row 65-69 % -> 83-84 % of the bandwidth bound, 2, 4
// and 8 rows 1.56x, 1.70x and 1.43x the tokens/s; the shipped 12.7 M model's 2-8 rows
// 1.10-1.13x. The bits do not depend on NB or on the order of rows.
template <int M>
constexpr int kBlock = M == 1 ? 8 : M == 2 ? 8 : M <= 4 ? 4 : M <= 6 ? 3 : 2;

// f(std::integral_constant<int, M>()) for a run-time row count M in 1..kRows (more: 8), so
// each kernel is compiled once per row count and chosen by one switch
template <class F>
void with_rows(int64_t M, F f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define APPRENTICE_AMX 1
// ---- the same products on AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later) -------
// One TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums: the
// weights are the first operand (16 of w's rows, read in place), x the second (its rows as
// columns, packed in pairs of k, the columns past M zero), so 8 rows cost what 1 row does
// and w is read once. Each output is its own dot product, accumulated over k in blocks of
// 32 in increasing k and rounded once: its bits depend only on x's row and w's row, not on
// M, N, the thread count or the split of N. Used for every row count and every matmul of
// this file (linear, experts, attention scores) whenever K is a multiple of 32 and Linux
// grants the tile state (`amx_ready`), so the Python path and the C++ step agree as before.
// Its fp32 sums run in another order than the AVX512 loop's above, so a result may differ
// from the loop's by one bf16 step (rounded once to bf16, they mostly agree).

// Whether environment variable `name` is "0" (a switch turned off), read by each caller once.
bool switched_off(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "0") == 0;
}

bool amx_ready() {
  static const bool ok = [] {
    if (switched_off("APPRENTICE_AMX")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline bool use_amx(int64_t K) { return K % 32 == 0 && amx_ready(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Outputs begin..end of y [M, N] = x [M, K] @ w [N, K]^T (+ b), M <= 16, K % 32 == 0.
template <class Out>
void amx_range(int64_t M, const uint16_t* x, const uint16_t* w, int64_t N, int64_t K,
               const float* bias, Out* y, int64_t begin, int64_t end) {
  thread_local std::vector<uint16_t> packed, spare;
  const int64_t chunks = K / 32;
  packed.assign(chunks * 512, 0);                    // chunk c: [16 pairs][16 columns][2]
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      packed[(k / 32) * 512 + (k % 32 / 2) * 32 + m * 2 + k % 2] = x[m * K + k];
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {                      // 0, 1: sums; 2, 3: weights; 4: x
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[2][16 * 16];
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                              10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  // sums [16 weight rows][16 columns of x]: column m is output row m's 16 values, biased in
  // fp32 and rounded once (to nearest even) as they are stored
  auto emit = [&](const float* sums, int64_t n, int64_t rows) {
    const __mmask16 live = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      __m512 v = _mm512_i32gather_ps(column, sums + m, 4);
      if (bias) v = _mm512_add_ps(v, b);
      if constexpr (std::is_same<Out, float>::value) {
        _mm512_mask_storeu_ps(y + m * N + n, live, v);
      } else {
        _mm256_mask_storeu_epi16(y + m * N + n, live, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  };
  const int64_t stride = K * 2;
  static const bool prefetch = !switched_off("APPRENTICE_PREFETCH");
  int64_t n = begin;
  for (; n + 32 <= end; n += 32) {                   // two blocks of 16 rows at a time
    const uint16_t* a = w + n * K;
    // the next 32 rows (contiguous: 64 * K bytes) are fetched while these are multiplied,
    // a 1 / chunks share of them per chunk: tile loads read 16 rows 2K bytes apart, a
    // pattern the hardware prefetchers follow poorly, so they waited on memory
    const char* ahead = reinterpret_cast<const char*>(a + 32 * K);
    const int64_t share = n + 64 <= end && prefetch ? 64 * K / chunks : 0;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < chunks; ++k) {
      for (int64_t b = k * share; b < (k + 1) * share; b += 64)
        _mm_prefetch(ahead + b, _MM_HINT_T0);
      _tile_loadd(4, packed.data() + k * 512, 64);
      _tile_loadd(2, a + k * 32, stride);
      _tile_loadd(3, a + 16 * K + k * 32, stride);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    emit(c[0], n, 16);
    emit(c[1], n + 16, 16);
  }
  for (; n < end; n += 16) {                         // the rest, a partial block padded
    const int64_t rows = std::min<int64_t>(16, end - n);
    const uint16_t* a = w + n * K;
    if (rows < 16) {
      spare.assign(16 * K, 0);
      std::memcpy(spare.data(), a, rows * K * sizeof(uint16_t));
      a = spare.data();
    }
    _tile_zero(0);
    for (int64_t k = 0; k < chunks; ++k) {
      _tile_loadd(4, packed.data() + k * 512, 64);
      _tile_loadd(2, a + k * 32, stride);
      _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, c[0], 64);
    emit(c[0], n, rows);
  }
  _tile_release();
}
#else
inline bool use_amx(int64_t) { return false; }
#endif

// x's rows as the dot products read them (XRow: bf16 as stored, or fp32), contiguous.
at::Tensor as_xrows(const at::Tensor& x) {
  return x.to(std::is_same<XRow, float>::value ? at::kFloat : at::kBFloat16).contiguous();
}

// Streams `row_streams` reads w in for M rows of x (1: one row after another, `dot_rows`):
// four for one row, two for two to four rows (the 0.5 B shape's decode of 2 and 4 sampled rows
// 1.47x and 1.18x a build with streams for one row only, 2026-12-07, the AVX2-only EPYC, the
// builds alternated in one process); five rows and more are bound by the multiply-adds.
template <int M>
constexpr int kStreams = M == 1 ? 4 : M <= 4 ? 2 : 1;

// The first rows of begin..end for M rows of x taken in `kStreams<M>` streams (`row_streams`,
// bf16 weights or int8 copies with their scales) where streams serve: AVX2 without AVX512,
// more than one stream, whole blocks of 16 along k and runs of 8 rows or more. Returns the
// first row left to the caller's loops (begin where streams do not serve).
template <int M, class X, class W, class Out>
inline int64_t streamed(const X* x, const W* w, int64_t K, const float* bias, Out* y, int64_t N,
                        int64_t begin, int64_t end, const float* scale = nullptr) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  constexpr int S = kStreams<M>;
  if constexpr (S > 1)
    if (K % kLanes == 0 && end - begin >= 8 * S)
      return row_streams<S, M>(x, w, K, bias, y, N, begin, end, scale);
#endif
  return begin;
}

// Outputs begin..end of y [M, N] = x [M, K] @ w [N, K]^T (+ b), on the calling thread.
// `Stream` as `dot_rows`': false for keys in cache (attention's scores).
template <int M, bool Stream = true, class Out>
void rows_range(const XRow* x, const uint16_t* w, int64_t N, int64_t K, const float* bias,
                Out* y, int64_t begin, int64_t end) {
#if defined(APPRENTICE_AMX)
  if (use_amx(K)) return amx_range(M, x, w, N, K, bias, y, begin, end);
#endif
  constexpr int NB = kBlock<M>;
  int64_t n = begin;
  if constexpr (Stream) n = streamed<M>(x, w, K, bias, y, N, begin, end);   // the rest below
  for (; n + NB <= end; n += NB) dot_rows<M, NB, Stream>(x, w, K, n, bias, y, N);
  for (; n < end; ++n) dot_rows<M, 1, Stream>(x, w, K, n, bias, y, N);
}

template <bool Stream = true, class Out>
void rows_range_any(int64_t M, const XRow* x, const uint16_t* w, int64_t N, int64_t K,
                    const float* bias, Out* y, int64_t begin, int64_t end) {
  with_rows(M, [&](auto m) {
    rows_range<decltype(m)::value, Stream>(x, w, N, K, bias, y, begin, end);
  });
}

// Multiply-adds a thread takes on at least: less stays on the calling thread, where waking
// the other costs more than it saves. Counted in multiply-adds (rows x weights), not weights:
// 8 rows through a 256 x 256 weight is 512k of them, ~7 us on one core.
constexpr int64_t kGrainMacs = int64_t{1} << 17;

template <int M>
void rows_kernel(const XRow* x, const uint16_t* w, int64_t N, int64_t K, const float* bias,
                 at::BFloat16* y) {
  const int64_t NB = use_amx(K) ? 32 : kBlock<M>;    // the rows a kernel step takes
  const int64_t grain = std::max<int64_t>(NB, kGrainMacs / (K * M) / NB * NB);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    rows_range<M>(x, w, N, K, bias, y, begin, end);
  });
}

// The parallel region of a grouped product: `span(g, lo, hi)` computes group g's outputs
// lo..hi; `step` is the output rows a kernel step takes, `rows` all groups' rows of x.
template <class Span>
void grouped_jobs(int64_t groups, int64_t rows, int64_t N, int64_t K, int64_t step, Span span) {
  const int64_t piece = std::max<int64_t>(step, (int64_t{1} << 16) / K / step * step);
  const int64_t pieces = (N + piece - 1) / piece;
  const int64_t jobs = groups * pieces;
  // as rows_kernel: at least kGrainMacs multiply-adds a thread (the groups' mean rows a job)
  const int64_t mean = std::max<int64_t>(1, rows / std::max<int64_t>(1, groups));
  const int64_t grain = std::max<int64_t>(1, kGrainMacs / (piece * K * mean));
  at::parallel_for(0, jobs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t lo = (j % pieces) * piece;
      span(j / pieces, lo, std::min(N, lo + piece));
    }
  });
}

// For each group g (an expert's rows of x, rows [start[g], start[g] + count[g]) of xs), its
// outputs y[rows] = xs[rows] @ ws[g]^T: the groups' output columns cut into pieces of about
// 64k weights and all pieces spread over the threads in one parallel region, so a few rows
// through several small matrices keep both cores busy and each matrix is read once.
void grouped_rows(const XRow* xp, const std::vector<const uint16_t*>& ws,
                  const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                  int64_t rows, int64_t N, int64_t K, at::BFloat16* yp) {
  grouped_jobs(static_cast<int64_t>(ws.size()), rows, N, K, use_amx(K) ? 32 : 4,
               [&](int64_t g, int64_t lo, int64_t hi) {
    rows_range_any(count[g], xp + start[g] * K, ws[g], N, K, nullptr, yp + start[g] * N, lo,
                   hi);
  });
}

// ---- packed weights: the same products for any number of rows, without horizontal sums ----
// A weight packed by `pack_weight` (for each block of 16 of its rows and each of its K / 2
// pairs of bf16, the 16 rows' pairs side by side, in the order the kernel reads them) is read
// 16 outputs a register: lane j of accumulator l takes pair l of each block of 32 of x and of
// w's row j, in increasing blocks, as lane l of `dot_rows`' accumulator does for row j (the
// same instruction on the same pairs), and the 16 accumulators are added by `lane_sum`'s
// tree, lane by lane. So every output has `rows_linear`'s bits, for any number of rows, while
// the sums across a register's lanes that cost `dot_rows` about as much as the products at
// K = 256 are gone, and a weight block (16 rows) serves 8 rows of x from cache. A prefill
// through it computes each product as a decode step does (`model.linear`). CPUs with AMX
// tiles keep their tiles (`packs`).
#if defined(__AVX512BF16__)
// A weight w [N, K] (K % 32 == 0) as `packed_block` reads it, in the order it reads it: for
// each block of 16 rows, for l = 0..7 and each block c of 32 columns, the 16 rows' pair
// 16c + l, then their pair 16c + l + 8 (rows past N zero), each 16 pairs side by side:
// out[((b * 8 + l) * C + c) * 2 + h) * 16 + j] is row 16b + j's pair 16c + l + 8h (C = K / 32).
void pack_weight_rows(const uint16_t* w, int64_t N, int64_t K, uint32_t* out) {
  const int64_t C = K / 32;
  for (int64_t b = 0; b < (N + 15) / 16; ++b)
    for (int64_t l = 0; l < 8; ++l)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t j = 0; j < 16; ++j) {
            uint32_t pair = 0;
            if (16 * b + j < N)
              std::memcpy(&pair, w + (16 * b + j) * K + 2 * (16 * c + l + 8 * h), sizeof pair);
            *out++ = pair;
          }
}

// y [MT, N] (rows of stride N, outputs n0..n0 + width of block kb) from x [MT, K] (K % 32 == 0)
template <int MT>
inline void packed_block(const uint16_t* x, int64_t K, const uint32_t* kb, int64_t n0,
                         int64_t width, const float* bias, at::BFloat16* y, int64_t N) {
  const int64_t C = K / 32;
  __m512 s8[8][MT];
  for (int l = 0; l < 8; ++l) {          // accumulators l and l + 8, added at once (the tree's
    __m512 a[MT], b[MT];                 // first level)
    for (int r = 0; r < MT; ++r) a[r] = b[r] = _mm512_setzero_ps();
    const uint32_t* wl = kb + l * C * 32;     // this pass's weights, in one stream
    for (int64_t c = 0; c < C; ++c) {
      const __m512bh wa = (__m512bh)_mm512_loadu_si512(wl + c * 32);
      const __m512bh wb = (__m512bh)_mm512_loadu_si512(wl + c * 32 + 16);
      for (int r = 0; r < MT; ++r) {
        const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + r * K) + 16 * c;
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[l])), wa);
        b[r] = _mm512_dpbf16_ps(b[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[l + 8])),
                                wb);
      }
    }
    for (int r = 0; r < MT; ++r) s8[l][r] = _mm512_add_ps(a[r], b[r]);
  }
  const __mmask16 mask = width == 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < MT; ++r) {
    __m512 s4[4];
    for (int l = 0; l < 4; ++l) s4[l] = _mm512_add_ps(s8[l][r], s8[l + 4][r]);
    __m512 t = _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]));
    if (bias) t = _mm512_add_ps(t, bv);   // as `store_rows`: the bias on the sum, one rounding
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y + r * N + n0), mask, bf16_round(t));
  }
}

// outputs begin..end (multiples of 16, or end = N) of y [M, N] = x [M, K] @ w^T (+ b), w
// packed (`wp`), on the calling thread: 8 rows of x at a time through each block of w
void packed_range(int64_t M, const uint16_t* x, const uint32_t* wp, int64_t N, int64_t K,
                  const float* bias, at::BFloat16* y, int64_t begin, int64_t end) {
  for (int64_t n0 = begin; n0 < end; n0 += 16) {
    const uint32_t* kb = wp + n0 * K / 2;
    const int64_t width = std::min<int64_t>(16, N - n0);
    int64_t r = 0;
    for (; r + kRows <= M; r += kRows)
      packed_block<kRows>(x + r * K, K, kb, n0, width, bias, y + r * N, N);
    if (r < M)
      with_rows(M - r, [&](auto m) {
        packed_block<decltype(m)::value>(x + r * K, K, kb, n0, width, bias, y + r * N, N);
      });
  }
}

// y = x @ w^T (+ b) for M rows with w packed, both cores over blocks of 16 outputs
void packed_kernel(int64_t M, const uint16_t* x, const uint32_t* wp, int64_t N, int64_t K,
                   const float* bias, at::BFloat16* y) {
  const int64_t blocks = (N + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, kGrainMacs / (16 * K * std::min(M, kRows)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    packed_range(M, x, wp, N, K, bias, y, 16 * begin, std::min(N, 16 * end));
  });
}

// `grouped_rows` with packed weights (ws[g] group g's packed matrix)
void grouped_packed(const uint16_t* xp, const std::vector<const uint32_t*>& ws,
                    const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                    int64_t rows, int64_t N, int64_t K, at::BFloat16* yp) {
  grouped_jobs(static_cast<int64_t>(ws.size()), rows, N, K, 16,
               [&](int64_t g, int64_t lo, int64_t hi) {
    packed_range(count[g], xp + start[g] * K, ws[g], N, K, nullptr, yp + start[g] * N, lo, hi);
  });
}
#endif

// Whether weights of width K are packed (`pack_weight`, `packed_linear`): AVX512-BF16 builds,
// K % 32 == 0, and not where AMX tiles serve `rows_linear` (their sums run in another order)
bool packs(int64_t K) {
#if defined(__AVX512BF16__)
  return K % 32 == 0 && K > 0 && !use_amx(K);
#else
  (void)K;
  return false;
#endif
}

// n bf16 values widened to fp32 (exactly) into buf
inline const float* widened(const uint16_t* x, int64_t n, std::vector<float>& buf) {
  buf.resize(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(x[i]);
  return buf.data();
}

// n bf16 values as x rows for the dot products: themselves (AVX512-BF16), else widened
inline const XRow* xrow_ptr(const uint16_t* x, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same<XRow, uint16_t>::value)
    return reinterpret_cast<const XRow*>(x);
  else
    return reinterpret_cast<const XRow*>(widened(x, n, buf));
}

// ---- int8 weight copies (`quantize`): y [M, N] = x [M, K] @ (q [N, K] * scale [N])^T (+ b) ---
// For at most kRows bf16 rows of x (decode steps). Each weight row is read once for all rows:
// 16 int8 at a time widened to fp32 in registers (sign-extended, converted exactly) and
// multiplied by every row of x (converted to fp32 once), one FMA each; the lanes summed by
// `lane_sum`'s tree, times the row's scale, plus the bias, rounded once to bf16. So an
// output's bits depend only on its row of x and of q, as `rows_linear`'s do, and the Python
// path (`quantize.int8_linear`) and the C++ step, calling this alike, agree bitwise. Half the
// bytes of bf16 a weight; it pays where decode reads weights from memory, not from cache.
template <int M, int NB>
inline void dot_rows_i8(const float* x, const int8_t* w, int64_t K, int64_t n,
                        const float* scale, const float* bias, at::BFloat16* y, int64_t N) {
#if defined(__AVX512F__)
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int j = 0; j < NB; ++j) {      // w's rows one after another, as `dot_rows` does
    const int8_t* wr = w + (n + j) * K;
    auto step = [&](int64_t k, __mmask16 mask) {
      const __m512 wv =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, wr + k)));
      for (int m = 0; m < M; ++m)
        acc[j][m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, acc[j][m]);
    };
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) step(k, __mmask16(0xFFFF));
    if (k < K) step(k, __mmask16((1u << (K - k)) - 1));
  }
#else
  float acc[NB][M][kLanes] = {};
  dot_lanes<M, NB>(x, w, K, n, acc);
#endif
  store_rows<M, NB>(acc, n, bias, y, N, scale);
}

// Outputs begin..end of `int8_rows`, on the calling thread.
template <int M>
void int8_span(const float* x, const int8_t* w, int64_t N, int64_t K, const float* scale,
               const float* bias, at::BFloat16* y, int64_t begin, int64_t end) {
  constexpr int NB = kBlock<M>;
  int64_t n = streamed<M>(x, w, K, bias, y, N, begin, end, scale);   // the rest below
  for (; n + NB <= end; n += NB) dot_rows_i8<M, NB>(x, w, K, n, scale, bias, y, N);
  for (; n < end; ++n) dot_rows_i8<M, 1>(x, w, K, n, scale, bias, y, N);
}

// `grouped_rows` for int8 weights (ws[g], its scales ss[g]): x's rows fp32, y bf16
void grouped_rows_i8(const float* xp, const std::vector<const int8_t*>& ws,
                     const std::vector<const float*>& ss, const std::vector<int64_t>& start,
                     const std::vector<int64_t>& count, int64_t rows, int64_t N, int64_t K,
                     at::BFloat16* yp) {
  grouped_jobs(static_cast<int64_t>(ws.size()), rows, N, K, 4,
               [&](int64_t g, int64_t lo, int64_t hi) {
    with_rows(count[g], [&](auto m) {
      int8_span<decltype(m)::value>(xp + start[g] * K, ws[g], N, K, ss[g], nullptr,
                                    yp + start[g] * N, lo, hi);
    });
  });
}

// `int8_rows` on pointers: y [M, N] bf16 = x [M, K] fp32 @ (q [N, K] * scale [N])^T (+ b [N])
void int8_kernel(int64_t M, const float* xp, const int8_t* wp, int64_t N, int64_t K,
                 const float* sp, const float* bp, at::BFloat16* yp) {
  with_rows(M, [&](auto m) {
    constexpr int R = decltype(m)::value;
    constexpr int64_t NB = kBlock<R>;
    const int64_t grain = std::max<int64_t>(NB, kGrainMacs / (K * R) / NB * NB);
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      int8_span<R>(xp, wp, N, K, sp, bp, yp, begin, end);
    });
  });
}

}  // namespace

// The routed experts of a few rows (a decode step: x [M, H] bf16, M <= 8; idx [M, k] long;
// w [M, k] bf16; gate_up [E, 2I, H], down [E, H, I] bf16) in five operations instead of
// about six per chosen expert. Bitwise what `Experts.forward` computes expert by expert with
// `rows_linear`: the same dot products (their bits depend only on the row and the weight
// row), `silu(g) * u` by the same ATen operations on rows of the same shape, each product
// with its gate weight rounded to bf16, and the sum in the same order and rounding (in fp32
// from +0 in ascending expert order, rounded once, as `index_add_` adds them; one row too, so
// a token decoded alone gets its prefill's bits).
namespace {
// The body of `moe_rows` (and of `moe_rows_i8`) on pointers: x [M, H] bf16, id [M, k] the
// experts, wp [M, k] their weights, out [M, H]. `products(xs, S, experts, start, count, which,
// y)` computes the grouped products of the S rows xs (bf16) with gate_up (which = 0, y [S, 2I])
// or down (1, y [S, H]).
template <class Products>
void moe_raw(const uint16_t* x, int64_t M, int64_t H, const int64_t* id, int64_t k,
             const at::BFloat16* wp, int64_t E, int64_t I, at::BFloat16* op,
             Products products) {
  TORCH_CHECK(M >= 1 && M <= kRows, "moe_rows: at most 8 rows");
  const int64_t S = M * k;
  std::vector<int64_t> order;                       // slots by expert, stable (argsort)
  std::vector<int64_t> start, count, experts;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t before = static_cast<int64_t>(order.size());
    for (int64_t s = 0; s < S; ++s)
      if (id[s] == e) order.push_back(s);
    const int64_t n = static_cast<int64_t>(order.size()) - before;
    if (n) {
      start.push_back(before);
      count.push_back(n);
      experts.push_back(e);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(order.size()) == S, "moe_rows: expert id out of range");
  std::vector<uint16_t> xs(S * H);                  // x's rows by expert ([S, H])
  for (int64_t p = 0; p < S; ++p)
    std::memcpy(xs.data() + p * H, x + order[p] / k * H, H * sizeof(uint16_t));
  auto gu = at::empty({S, 2 * I}, at::kBFloat16);
  products(xs.data(), S, experts, start, count, 0, gu.data_ptr<at::BFloat16>());
  // silu(g) * u of gu.chunk(2, -1): silu by ATen, the product as ATen multiplies bf16 (in
  // fp32, rounded once to nearest even)
  const auto sg = at::silu(gu.slice(1, 0, I)).contiguous();
  const at::BFloat16* sp = sg.data_ptr<at::BFloat16>();
  const at::BFloat16* up = gu.data_ptr<at::BFloat16>() + I;
  std::vector<at::BFloat16> h(S * I);
  for (int64_t r = 0; r < S; ++r)
    for (int64_t c = 0; c < I; ++c)
      h[r * I + c] = at::BFloat16(static_cast<float>(sp[r * I + c]) *
                                  static_cast<float>(up[r * 2 * I + c]));
  std::vector<at::BFloat16> ys(S * H);
  products(reinterpret_cast<const uint16_t*>(h.data()), S, experts, start, count, 1, ys.data());
  const at::BFloat16* yp = ys.data();
  std::vector<float> acc(M * H, 0.0f);             // index_add_ sums in fp32, rounds once
  for (int64_t p = 0; p < S; ++p) {
    const int64_t s = order[p], m = s / k;
    const float g = static_cast<float>(wp[s]);
    const at::BFloat16* y = yp + p * H;
    float* a = acc.data() + m * H;
    for (int64_t c = 0; c < H; ++c)
      a[c] += static_cast<float>(at::BFloat16(static_cast<float>(y[c]) * g));
  }
  for (int64_t i = 0; i < M * H; ++i) op[i] = at::BFloat16(acc[i]);
}

// `moe_raw` with bf16 experts (gate_up [E, 2I, H], down [E, H, I] as stored; or packed by
// `pack_weight` as [E * 2I, H] and [E * H, I], gpk and dpk, when 2I and H are multiples of 16)
void moe_bf16(const uint16_t* x, int64_t M, int64_t H, const int64_t* id, int64_t k,
              const at::BFloat16* wp, const uint16_t* gup, const uint16_t* dp, int64_t E,
              int64_t I, at::BFloat16* op, const uint32_t* gpk = nullptr,
              const uint32_t* dpk = nullptr) {
  moe_raw(x, M, H, id, k, wp, E, I, op, [&](const uint16_t* xs, int64_t S,
                                            const std::vector<int64_t>& experts,
                                            const std::vector<int64_t>& start,
                                            const std::vector<int64_t>& count, int which,
                                            at::BFloat16* y) {
#if defined(__AVX512BF16__)
    if (gpk && dpk) {
      std::vector<const uint32_t*> ws;
      for (int64_t e : experts) ws.push_back(which == 0 ? gpk + e * I * H : dpk + e * H * I / 2);
      if (which == 0) grouped_packed(xs, ws, start, count, S, 2 * I, H, y);
      else grouped_packed(xs, ws, start, count, S, H, I, y);
      return;
    }
#endif
    std::vector<const uint16_t*> ws;
    for (int64_t e : experts) ws.push_back(which == 0 ? gup + e * 2 * I * H : dp + e * H * I);
    std::vector<float> buf;
    if (which == 0) grouped_rows(xrow_ptr(xs, S * H, buf), ws, start, count, S, 2 * I, H, y);
    else grouped_rows(xrow_ptr(xs, S * I, buf), ws, start, count, S, H, I, y);
  });
}

// `moe_raw` with the experts' int8 copies (gq [E, 2I, H] and its fp32 scales gs [E, 2I], dq
// [E, H, I] and ds [E, H]), each expert's products by `int8_span` (`int8_rows`' kernel)
void moe_i8(const uint16_t* x, int64_t M, int64_t H, const int64_t* id, int64_t k,
            const at::BFloat16* wp, const int8_t* gq, const float* gs, const int8_t* dq,
            const float* ds, int64_t E, int64_t I, at::BFloat16* op) {
  moe_raw(x, M, H, id, k, wp, E, I, op, [&](const uint16_t* xs, int64_t S,
                                            const std::vector<int64_t>& experts,
                                            const std::vector<int64_t>& start,
                                            const std::vector<int64_t>& count, int which,
                                            at::BFloat16* y) {
    std::vector<const int8_t*> ws;
    std::vector<const float*> ss;
    for (int64_t e : experts) {
      ws.push_back(which == 0 ? gq + e * 2 * I * H : dq + e * H * I);
      ss.push_back(which == 0 ? gs + e * 2 * I : ds + e * H);
    }
    std::vector<float> buf;                        // x's rows in fp32
    const float* xf = widened(xs, S * (which == 0 ? H : I), buf);
    if (which == 0) grouped_rows_i8(xf, ws, ss, start, count, S, 2 * I, H, y);
    else grouped_rows_i8(xf, ws, ss, start, count, S, H, I, y);
  });
}

// moe_rows' and moe_rows_i8's checks of x, idx and w; their data as moe_raw reads it
struct MoeArgs {
  at::Tensor x, ids, w;
  int64_t M, H, k;
  MoeArgs(const at::Tensor& x_, const at::Tensor& idx, const at::Tensor& w_)
      : x(x_.contiguous()), ids(idx.to(at::kLong).contiguous()),
        w(w_.to(at::kBFloat16).contiguous()), M(x_.size(0)), H(x_.size(1)), k(idx.size(1)) {
    TORCH_CHECK(ids.size(0) == M && w.numel() == M * k, "moe_rows: idx and w [M, k]");
  }
  const uint16_t* xp() const { return reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()); }
};

}  // namespace

at::Tensor moe_rows(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                    const at::Tensor& gate_up, const at::Tensor& down) {
  RECORD_FUNCTION("apprentice::moe_rows", std::vector<c10::IValue>({x, idx}));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && gate_up.scalar_type() == at::kBFloat16 &&
              down.scalar_type() == at::kBFloat16 && x.dim() == 2 && idx.dim() == 2);
  const int64_t H = x.size(1), E = gate_up.size(0), I = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H);
  auto guc = gate_up.contiguous(), dc = down.contiguous();
  const MoeArgs a(x, idx, w);
  auto out = at::empty({a.M, H}, x.options());
  moe_bf16(a.xp(), a.M, H, a.ids.data_ptr<int64_t>(), a.k, a.w.data_ptr<at::BFloat16>(),
           reinterpret_cast<const uint16_t*>(guc.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(dc.data_ptr<at::BFloat16>()), E, I,
           out.data_ptr<at::BFloat16>());
  return out;
}

// `moe_rows` with the experts' int8 copies (`quantize`: gq [E, 2I, H] int8 and gs [E, 2I]
// its scales, dq [E, H, I] and ds [E, H]): bitwise what `Experts.forward` computes expert by
// expert with `int8_rows`.
at::Tensor moe_rows_i8(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                       const at::Tensor& gq, const at::Tensor& gs, const at::Tensor& dq,
                       const at::Tensor& ds) {
  RECORD_FUNCTION("apprentice::moe_rows_i8", std::vector<c10::IValue>({x, idx}));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && gq.scalar_type() == at::kChar &&
              dq.scalar_type() == at::kChar && x.dim() == 2 && idx.dim() == 2);
  const int64_t H = x.size(1), E = gq.size(0), I = dq.size(2);
  TORCH_CHECK(gq.size(1) == 2 * I && gq.size(2) == H && dq.size(1) == H &&
              gs.numel() == E * 2 * I && ds.numel() == E * H, "moe_rows_i8: shapes");
  auto gqc = gq.contiguous(), dqc = dq.contiguous();
  auto gsf = gs.to(at::kFloat).contiguous(), dsf = ds.to(at::kFloat).contiguous();
  const MoeArgs a(x, idx, w);
  auto out = at::empty({a.M, H}, x.options());
  moe_i8(a.xp(), a.M, H, a.ids.data_ptr<int64_t>(), a.k, a.w.data_ptr<at::BFloat16>(),
         gqc.data_ptr<int8_t>(), gsf.data_ptr<float>(), dqc.data_ptr<int8_t>(),
         dsf.data_ptr<float>(), E, I, out.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& b) {
  RECORD_FUNCTION("apprentice::int8_rows", std::vector<c10::IValue>({x, q}));
  const int64_t K = x.size(-1), N = q.size(0), M = x.numel() / std::max<int64_t>(K, 1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kChar && q.dim() == 2 &&
              q.size(1) == K && scale.numel() == N && M >= 1 && M <= kRows,
              "int8_rows: x [..., K] bf16 of at most 8 rows, q [N, K] int8, scale [N]");
  auto xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  auto qc = q.contiguous();
  auto sf = scale.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (b.has_value() && b->defined()) bf = b->to(at::kFloat).contiguous();
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qc.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  int8_kernel(M, xp, wp, N, K, sp, bp, y.data_ptr<at::BFloat16>());
  return y;
}

// x [..., K] and w [N, K] bf16 with at most kRows rows in x; b [N] or None.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  RECORD_FUNCTION("apprentice::rows_linear", std::vector<c10::IValue>({x, w}));
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && w.dim() == 2);
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(x.size(-1) == K && M >= 1 && M <= kRows, "rows_linear: at most 8 rows of width ", K);
  auto xr = as_xrows(x.reshape({M, K}));
  auto wc = w.contiguous();
  at::Tensor bf;
  if (b.has_value() && b->defined()) bf = b->to(at::kFloat).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const auto* xp = static_cast<const XRow*>(xr.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto m) { rows_kernel<decltype(m)::value>(xp, wp, N, K, bp, yp); });
  return y;
}

// The softmax's sum of one row of attention scores (fp32 [n], already scaled), the columns it
// sees given by mask (bool [n], or None: all) and last (columns past it unseen; -1: none):
// attention's `exp_lanes` after its max, for tests of where its bits may depend on.
double softmax_total(const at::Tensor& scores, const c10::optional<at::Tensor>& mask,
                     int64_t last) {
  auto s = scores.to(at::kFloat).contiguous().clone();
  const int64_t n = s.numel();
  at::Tensor m;
  if (mask.has_value() && mask->defined()) m = mask->to(at::kBool).contiguous();
  float* sp = s.data_ptr<float>();
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  const float mx = scale_visible(sp, n, last < 0 ? n : last, mp, 1.0f);
  return exp_lanes(sp, n, mx, mp, last);
}

// w [..., K] (bf16, rows flattened) in `packed_linear`'s layout: int32 [ceil(N / 16) * 16 * K / 2]
at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() >= 2 && packs(w.size(-1)),
              "pack_weight: bf16 rows of a width this build packs (`packs`)");
  const int64_t K = w.size(-1), N = w.numel() / K;
  auto wc = w.contiguous();
  auto out = at::empty({(N + 15) / 16 * 16 * K / 2}, w.options().dtype(at::kInt));
#if defined(__AVX512BF16__)
  pack_weight_rows(reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), N, K,
                   reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()));
#endif
  return out;
}

// x [..., K] bf16, any number of rows; wp: `pack_weight` of w [N, K]; b [N] or None. Bitwise
// `rows_linear(x, w, b)` row by row.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N,
                         const c10::optional<at::Tensor>& b) {
  RECORD_FUNCTION("apprentice::packed_linear", std::vector<c10::IValue>({x, wp}));
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packs(K) && wp.scalar_type() == at::kInt &&
              wp.is_contiguous() && wp.numel() == (N + 15) / 16 * 16 * K / 2,
              "packed_linear: bf16 x and a weight packed by pack_weight for ", N, " outputs");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  if (M == 0) return y;
  at::Tensor bf;
  if (b.has_value() && b->defined()) bf = b->to(at::kFloat).contiguous();
#if defined(__AVX512BF16__)
  auto xc = x.reshape({M, K}).contiguous();
  packed_kernel(M, reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint32_t*>(wp.data_ptr<int32_t>()), N, K,
                bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>());
#endif
  return y;
}

namespace {
#if defined(__AVX512BF16__)
// Keys as `packed_scores` reads them: for each block of 16 keys and each of the D / 2 pairs of
// bf16 (k = 2i, 2i + 1), the 16 keys' pairs side by side (keys past S zero):
// out[(block * D / 2 + i) * 16 + j] is key 16 * block + j's pair i.
void pack_keys(const uint16_t* k, int64_t S, int64_t D, uint32_t* out) {
  const int64_t P = D / 2;
  for (int64_t b = 0; b < (S + 15) / 16; ++b)
    for (int64_t i = 0; i < P; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        uint32_t pair = 0;
        if (16 * b + j < S) std::memcpy(&pair, k + (16 * b + j) * D + 2 * i, sizeof pair);
        out[(b * P + i) * 16 + j] = pair;
      }
}

// scores y [n, N] (row stride N) of n query rows x [n, D] (bf16, D % 32 == 0) against keys
// 0..N packed by `pack_keys`, 16 keys a register: lane j of accumulator l takes pair l of each
// block of 32 of x and of key j, in increasing blocks, as lane l of `dot_rows`' accumulator
// does for one key (the same instruction on the same pairs), and the 16 accumulators are
// added by `lane_sum`'s tree, lane by lane: the bits of `dot_rows`' scores, without adding
// lanes across a register for each score.
void packed_scores(int64_t n, const uint16_t* x, const uint32_t* kp, int64_t N, int64_t D,
                   float* y) {
  const int64_t P = D / 2;
  for (int64_t b = 0; b * 16 < N; ++b) {
    const uint32_t* kb = kp + b * P * 16;
    const int64_t width = std::min<int64_t>(16, N - 16 * b);
    const __mmask16 mask = width == 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* xr = x + r * D;
      __m512 a[16];
      for (int l = 0; l < 16; ++l) a[l] = _mm512_setzero_ps();
      for (int64_t c = 0; c < P / 16; ++c)
        for (int l = 0; l < 16; ++l) {
          uint32_t pair;
          std::memcpy(&pair, xr + 32 * c + 2 * l, sizeof pair);
          a[l] = _mm512_dpbf16_ps(a[l], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                                  (__m512bh)_mm512_loadu_si512(kb + (16 * c + l) * 16));
        }
      for (int l = 0; l < 8; ++l) a[l] = _mm512_add_ps(a[l], a[l + 8]);
      for (int l = 0; l < 4; ++l) a[l] = _mm512_add_ps(a[l], a[l + 4]);
      _mm512_mask_storeu_ps(y + r * N + 16 * b, mask,
                            _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
    }
  }
}
#endif

// `attention_rows` on pointers: q [B, KV, G x T, D] (x rows), key (value) position s of row b,
// kv head h at k + b * kb + h * kh + s * D (v likewise), the mask of (b, t) at m + (b * T + t)
// * ms (or none), out [B, KV, G x T, D]
void attention_raw(const XRow* qp, int64_t B, int64_t KV, int64_t G, int64_t T, int64_t D,
                   int64_t S, const uint16_t* kp, int64_t kb, int64_t kh, const uint16_t* vp,
                   int64_t vb, int64_t vh, const bool* mp, int64_t ms, bool causal, float sc,
                   at::BFloat16* op) {
  const int64_t past = S - T, R = G * T, blocks = (R + kRows - 1) / kRows;
  // jobs: (row, kv head, block of 8 of its G x T query rows); grain ~64k multiply-adds
  const int64_t work = std::max<int64_t>(1, 2 * std::min(kRows, R) * S * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work);
  // many query rows a kv head (a prefill): its keys packed once, 16 a register (`packed_scores`)
  std::vector<uint32_t> packed;
  const int64_t pstride = (S + 15) / 16 * 16 * D / 2;
#if defined(__AVX512BF16__)
  if (R >= kPackedRows && D % 32 == 0) {
    packed.resize(B * KV * pstride);
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh)
        pack_keys(kp + bh / KV * kb + bh % KV * kh, S, D, packed.data() + bh * pstride);
    });
  }
#endif
  at::parallel_for(0, B * KV * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kRows * S), acc(kRows * D), total(kRows);
    std::vector<int64_t> last(kRows);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t bh = job / blocks, r0 = (job % blocks) * kRows;     // bh: (b, h)
      const int64_t b = bh / KV, h = bh % KV, n = std::min(kRows, R - r0);
      int64_t seen = 0;                            // keys any row of the block sees: [0, seen)
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = (r0 + r) % T;
        last[r] = causal ? past + t + 1 : S;
        if (mp) {
          const bool* m = mp + (b * T + t) * ms;
          while (last[r] > 0 && !m[last[r] - 1]) --last[r];
        }
        seen = std::max(seen, last[r]);
      }
      const XRow* qr = qp + (bh * R + r0) * D;
#if defined(__AVX512BF16__)
      if (!packed.empty())
        packed_scores(n, qr, packed.data() + bh * pstride, seen, D, scores.data());
      else
#endif
        rows_range_any<false>(n, qr, kp + b * kb + h * kh, seen, D, nullptr, scores.data(), 0,
                              seen);
      for (int64_t r = 0; r < n; ++r) {                 // scores [n, seen]
        float* s = scores.data() + r * seen;
        const bool* m = mp ? mp + (b * T + (r0 + r) % T) * ms : nullptr;
        const float mx = scale_visible(s, seen, last[r], m, sc);
        total[r] = exp_lanes(s, seen, mx, m, last[r]);   // s[j] = exp(s[j] - mx), their sum
      }
      weighted_values(n, scores.data(), seen, seen, vp + b * vb + h * vh, D, acc.data(), false,
                      !mp);
      at::BFloat16* o = op + (bh * R + r0) * D;
      for (int64_t r = 0; r < n; ++r) {
        const float inv = 1.0f / total[r];
        for (int64_t d = 0; d < D; ++d) o[r * D + d] = at::BFloat16(acc[r * D + d] * inv);
      }
    }
  });
}
}  // namespace

// Attention in bf16 without autograd (decode steps and prefill), row by row: q [B, KV, G, T,
// D] (the G query heads that share kv head h, T new positions each), k and v [B, KV, S, D]
// (the cache's first S columns; the T new ones last), mask [B, T, S] (true: attend) or none,
// then causal (query t sees keys up to S - T + t) or not (all); out [B, KV, G, T, D]. For a
// block of up to 8 query rows, the scores are `rows_range`'s dot products (a query a row of
// x, a key a row of w) kept in fp32, times `scale`, over the keys its rows can see; the
// softmax is fp32 (the max subtracted, `exp_lanes`, summed by lanes and `lane_sum`'s tree);
// the values are summed in fp32 in increasing position (`weighted_values`), divided by the
// sum once and rounded once. A query row's bits depend only on that row, its keys, values
// and mask: not on B, T, the thread count or which rows share a block, so a prompt fed in
// pieces (the prefix cache) or one token at a time gets the bits of one fed whole. At these
// sizes (a few heads, a few hundred to a few thousand positions) the CPU kernel of
// `scaled_dot_product_attention` spent more on setup than on arithmetic at one new token
// and ran at a fraction of this CPU's bf16 rate with a mask.
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, bool causal, double scale) {
  RECORD_FUNCTION("apprentice::attention_rows", std::vector<c10::IValue>({q, k}));
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && q.dim() == 5 && k.dim() == 4 && v.dim() == 4,
              "attention_rows: q [B, KV, G, T, D], k and v [B, KV, S, D], bf16");
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), T = q.size(3), D = q.size(4);
  const int64_t S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == KV && k.size(3) == D && v.sizes() == k.sizes() &&
              S >= T && T >= 1, "attention_rows: k and v [B, KV, S >= T, D]");
  auto rows = [&](const at::Tensor& t) {     // each (row, kv head)'s positions: rows of D
    return t.stride(3) == 1 && (S == 1 || t.stride(2) == D) ? t : t.contiguous();
  };
  const at::Tensor kc = rows(k), vc = rows(v);
  auto qx = as_xrows(q);                                            // contiguous
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->numel() == B * T * S, "attention_rows: a mask of B x T x S");
    mc = mask->reshape({B, T, S}).to(at::kBool).contiguous();
  }
  auto out = at::empty({B, KV, G, T, D}, q.options());
  attention_raw(static_cast<const XRow*>(qx.data_ptr()), B, KV, G, T, D, S,
                reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>()), kc.stride(0),
                kc.stride(1), reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>()),
                vc.stride(0), vc.stride(1), mc.defined() ? mc.data_ptr<bool>() : nullptr, S,
                causal, static_cast<float>(scale), out.data_ptr<at::BFloat16>());
  return out;
}

namespace {
// `rms_norm_rows` on pointers: N rows of H (x, out), row i scaled by weight row i % W
void rms_rows(const uint16_t* xp, int64_t N, int64_t H, const uint16_t* wp, int64_t W,
              float e, at::BFloat16* op) {
  const float inv_h = 1.0f / static_cast<float>(H);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(H, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t* xi = xp + i * H;
      const uint16_t* wi = wp + (i % W) * H;
      at::BFloat16* oi = op + i * H;
#if defined(__AVX512F__)
      // the loop below 16 lanes at a time: the same fused multiply-adds and roundings
      auto load = [&](const uint16_t* p, int64_t c) {
        const int64_t n = std::min<int64_t>(kLanes, H - c);
        return widen_bf16(_mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p + c));
      };
      __m512 lanes = _mm512_setzero_ps();
      for (int64_t c = 0; c < H; c += kLanes) {
        const __m512 v = load(xi, c);
        lanes = _mm512_fmadd_ps(v, v, lanes);
      }
      const float r = 1.0f / std::sqrt(lane_sum(lanes) * inv_h + e);
      const __m512 rv = _mm512_set1_ps(r);
      for (int64_t c = 0; c < H; c += kLanes) {
        const __m512 n = bf16_rounded(_mm512_mul_ps(load(xi, c), rv));
        _mm256_mask_storeu_epi16(oi + c, __mmask16((1u << std::min<int64_t>(kLanes, H - c)) - 1),
                                 bf16_round(_mm512_mul_ps(load(wi, c), n)));
      }
#else
      float lanes[kLanes] = {};
      for (int64_t c = 0; c < H; c += kLanes)
        for (int l = 0; l < kLanes && c + l < H; ++l) {
          const float v = bf16_to_float(xi[c + l]);
          lanes[l] = std::fma(v, v, lanes[l]);
        }
      const float r = 1.0f / std::sqrt(lane_sum(lanes) * inv_h + e);
      for (int64_t c = 0; c < H; ++c) {
        const float n = static_cast<float>(at::BFloat16(bf16_to_float(xi[c]) * r));
        oi[c] = at::BFloat16(bf16_to_float(wi[c]) * n);
      }
#endif
    }
  });
}
}  // namespace

// weight[i % W] * bf16(x_i / rms(x_i)) for each row i of x [..., H] (bf16), weight [W, H] or
// [H] bf16: RMSNorm in bf16 without autograd, in one pass instead of eight operations. The
// sum of squares is fp32 (16 lanes in increasing position, `lane_sum`'s tree), the scale
// 1 / sqrt(sum / H + eps) in fp32, the normalized value rounded to bf16 and then multiplied
// by the weight and rounded again (HF's order). A row's bits depend only on that row.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("apprentice::rms_norm_rows", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rms_norm_rows: bf16 x and weight");
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  const int64_t W = weight.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(weight.size(-1) == H && W >= 1 && W * H == weight.numel(),
              "rms_norm_rows: weight [W, H]");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  rms_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), N, H,
           reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), W,
           static_cast<float>(eps), out.data_ptr<at::BFloat16>());
  return out;
}

namespace {
// `shared_attention` on pointers (q [B, KV, G, D] x rows; k, v, the mask and out as
// `attention_raw`'s with T = 1; f[b] row b's first shared column): false, with nothing written,
// when no column can be shared
bool shared_raw(const XRow* qp, int64_t B, int64_t KV, int64_t G, int64_t D, int64_t S,
                const uint16_t* kp, int64_t kb, int64_t kh, const uint16_t* vp, int64_t vb,
                int64_t vh, const bool* mp, int64_t ms, float sc, int64_t shared,
                const int64_t* f, at::BFloat16* op) {
  int64_t P = shared;
  for (int64_t b = 0; b < B && P > 0; ++b) {
    if (f[b] < 0 || (!mp && f[b] > 0)) P = 0;
    P = std::min(P, S - f[b]);
    for (int64_t j = 0; mp && j < f[b] && P > 0; ++j)
      if (mp[b * ms + j]) P = 0;                   // a column before the shared ones is seen
    for (int64_t j = 0; mp && j < P; ++j)
      if (!mp[b * ms + f[b] + j]) P = j;           // a shared column is hidden
  }
  if (P <= 0) return false;
  const int64_t R = B * G, blocks = (R + kRows - 1) / kRows;   // query rows of a kv head
  const int64_t work = std::max<int64_t>(1, 2 * std::min(kRows, R) * S * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work);
  at::parallel_for(0, KV * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kRows * S), common(kRows * P), acc(kRows * D), total(kRows);
    std::vector<XRow> qr(kRows * D);
    std::vector<int64_t> last(kRows), row(kRows);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / blocks, i0 = (job % blocks) * kRows, n = std::min(kRows, R - i0);
      int64_t seen = 0;
      for (int64_t r = 0; r < n; ++r) {             // query row i0 + r: row b, head g of h
        const int64_t b = row[r] = (i0 + r) / G, g = (i0 + r) % G;
        std::memcpy(qr.data() + r * D, qp + ((b * KV + h) * G + g) * D, D * sizeof(XRow));
        last[r] = S;
        if (mp)
          while (last[r] > f[b] + P && !mp[b * ms + last[r] - 1]) --last[r];
        seen = std::max(seen, last[r]);
      }
      // scores [n, seen]: the shared columns for all n rows at once (row 0's keys), placed in
      // each row's own columns, then each row's own columns after them
      rows_range_any<false>(n, qr.data(), kp + h * kh + f[0] * D, P, D, nullptr, common.data(),
                            0, P);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(scores.data() + r * seen + f[row[r]], common.data() + r * P, P * sizeof(float));
      for (int64_t r0 = 0, r1; r0 < n; r0 = r1) {   // runs of query rows of one row b
        const int64_t b = row[r0];
        for (r1 = r0 + 1; r1 < n && row[r1] == b; ++r1) {}
        rows_range_any<false>(r1 - r0, qr.data() + r0 * D, kp + b * kb + h * kh, seen, D,
                              nullptr, scores.data() + r0 * seen, f[b] + P, last[r0]);
      }
      for (int64_t r = 0; r < n; ++r) {
        float* s = scores.data() + r * seen;
        const bool* m = mp ? mp + row[r] * ms : nullptr;
        const float mx = scale_visible(s, seen, last[r], m, sc);   // before from[b]: masked
        total[r] = exp_lanes(s, seen, mx, m, last[r]);
        std::memcpy(common.data() + r * P, s + f[row[r]], P * sizeof(float));
      }
      weighted_values(n, common.data(), P, P, vp + h * vh + f[0] * D, D, acc.data(), false, !mp);
      for (int64_t r0 = 0, r1; r0 < n; r0 = r1) {
        const int64_t b = row[r0], own = f[b] + P;
        for (r1 = r0 + 1; r1 < n && row[r1] == b; ++r1) {}
        weighted_values(r1 - r0, scores.data() + r0 * seen + own, seen, last[r0] - own,
                        vp + b * vb + h * vh + own * D, D, acc.data() + r0 * D, true, !mp);
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t b = row[r], g = (i0 + r) % G;
        const float inv = 1.0f / total[r];
        at::BFloat16* o = op + ((b * KV + h) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = at::BFloat16(acc[r * D + d] * inv);
      }
    }
  });
  return true;
}
}  // namespace

// `attention_rows` of one new token per row when every row b holds the same `shared` keys
// and values in its columns from[b]...from[b] + shared (a group's common prompt, or the
// system prompt and task of a group's later calls, `KVCache.share`), and sees none of its
// columns before from[b]: the query rows of every row that share a kv head go through those
// columns together, up to 8 at a time, reading them once (row 0's) instead of once per row;
// each row's own columns follow. Each query row gets the bits `attention_rows` gives it: the
// same dot products as scores, in the same columns of its softmax (the same lanes), and its
// values summed in the same increasing columns (`weighted_values` going on from the shared
// columns' sums; the columns before from[b] have weight 0 in every row, which attention_rows
// skips too). What the mask contradicts (a shared column hidden, an earlier one seen) is
// not shared: the columns shrink, or the step takes `attention_rows`.
at::Tensor shared_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale,
                            int64_t shared, const at::Tensor& from) {
  RECORD_FUNCTION("apprentice::shared_attention", std::vector<c10::IValue>({q, k}));
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && k.dim() == 4 && k.size(0) == B &&
              k.size(1) == KV && k.size(3) == D && v.sizes() == k.sizes(),
              "shared_attention: q [B, KV, G, D], k and v [B, KV, S, D], bf16");
  TORCH_CHECK(from.numel() == B, "shared_attention: one first shared column per row");
  const auto fc = from.to(at::kLong).contiguous();
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->numel() == B * S, "shared_attention: a mask of B x S");
    mc = mask->reshape({B, S}).to(at::kBool).contiguous();
  }
  auto rows = [&](const at::Tensor& t) {
    return t.stride(3) == 1 && (S == 1 || t.stride(2) == D) ? t : t.contiguous();
  };
  const at::Tensor kc = rows(k), vc = rows(v);
  auto qx = as_xrows(q);
  auto out = at::empty({B, KV, G, D}, q.options());
  if (!shared_raw(static_cast<const XRow*>(qx.data_ptr()), B, KV, G, D, S,
                  reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>()), kc.stride(0),
                  kc.stride(1), reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>()),
                  vc.stride(0), vc.stride(1), mc.defined() ? mc.data_ptr<bool>() : nullptr, S,
                  static_cast<float>(scale), shared, fc.data_ptr<int64_t>(),
                  out.data_ptr<at::BFloat16>()))
    return attention_rows(q.unsqueeze(3), k, v, mask, false, scale).squeeze(3);
  return out;
}

namespace {
// one row of D (a head of one position) rotated: o = x * c + rotate_half(x) * s, each product
// and the sum rounded to bf16
inline void rope_row(const uint16_t* xi, const uint16_t* c, const uint16_t* s, int64_t D,
                     at::BFloat16* o) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  if (half % kLanes == 0) {           // the loop below 16 lanes at a time, the same roundings
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t d = 0; d < D; d += kLanes) {
      const __m512 r = d < half ? _mm512_xor_ps(load_bf16(xi + d + half), sign)
                                : load_bf16(xi + d - half);
      const __m512 a = bf16_rounded(_mm512_mul_ps(load_bf16(xi + d), load_bf16(c + d)));
      const __m512 e = bf16_rounded(_mm512_mul_ps(r, load_bf16(s + d)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), bf16_round(_mm512_add_ps(a, e)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) {
    const float v = bf16_to_float(xi[d]);
    const float r = d < half ? -bf16_to_float(xi[d + half]) : bf16_to_float(xi[d - half]);
    const float a = static_cast<float>(at::BFloat16(v * bf16_to_float(c[d])));
    const float e = static_cast<float>(at::BFloat16(r * bf16_to_float(s[d])));
    o[d] = at::BFloat16(a + e);
  }
}

// `rope_row`'s backward as autograd computes it: from g (d o, one row of D) d x = g * c +
// rotate_half's transpose of g * s (halves swapped, the first half negated), each product and
// the sum rounded to bf16
inline void rope_row_backward(const uint16_t* g, const uint16_t* c, const uint16_t* s,
                              int64_t D, at::BFloat16* o) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  if (half % kLanes == 0) {           // the loop below 16 lanes at a time, the same roundings
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t d = 0; d < D; d += kLanes) {
      const __m512 a = bf16_rounded(_mm512_mul_ps(load_bf16(g + d), load_bf16(c + d)));
      const int64_t j = d < half ? d + half : d - half;
      __m512 r = bf16_rounded(_mm512_mul_ps(load_bf16(g + j), load_bf16(s + j)));
      if (d >= half) r = _mm512_xor_ps(r, sign);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), bf16_round(_mm512_add_ps(a, r)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) {
    const float a = static_cast<float>(at::BFloat16(bf16_to_float(g[d]) * bf16_to_float(c[d])));
    const int64_t j = d < half ? d + half : d - half;
    float r = static_cast<float>(at::BFloat16(bf16_to_float(g[j]) * bf16_to_float(s[j])));
    if (d >= half) r = -r;
    o[d] = at::BFloat16(a + r);
  }
}
}  // namespace

namespace {
// What `rope_rows` and its backward share: cos and sin checked as [B, T, D] bf16 (D even),
// then row(bt, c, s) for each position bt = b * T + t, c and s its rows of cos and sin, the
// positions split over the threads
template <class Row>
void rope_positions(const char* name, int64_t B, int64_t T, int64_t N, int64_t D,
                    const at::Tensor& cos, const at::Tensor& sin, Row row) {
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
              D % 2 == 0 && cos.numel() == B * T * D && sin.numel() == B * T * D,
              name, ": cos and sin [B, T, D] bf16 with D even");
  const auto cc = cos.reshape({B, T, D}).contiguous(), sc = sin.reshape({B, T, D}).contiguous();
  const auto* cp = reinterpret_cast<const uint16_t*>(cc.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(N * D, 1));
  at::parallel_for(0, B * T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) row(bt, cp + bt * D, sp + bt * D);
  });
}
}  // namespace

// Rotary embedding of q and k in bf16 without autograd, in one pass instead of six
// operations: x [B, T, N, D] (the N = heads + kv heads of each position), cos and sin
// [B, T, D]; returns [B, N, T, D] = x * cos + rotate_half(x) * sin with each product and the
// sum rounded to bf16 as ATen rounds them (in fp32, to nearest even), so the bits are those of
// `qk * cos + rotate_half(qk) * sin` on the transposed x.
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  RECORD_FUNCTION("apprentice::rope_rows", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 4,
              "rope_rows: x [B, T, N, D], cos and sin [B, T, D], bf16");
  const int64_t B = x.size(0), T = x.size(1), N = x.size(2), D = x.size(3);
  auto xc = x.contiguous();
  auto out = at::empty({B, N, T, D}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  rope_positions("rope_rows", B, T, N, D, cos, sin,
                 [&](int64_t bt, const uint16_t* c, const uint16_t* s) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t n = 0; n < N; ++n)
      rope_row(xp + (bt * N + n) * D, c, s, D, op + ((b * N + n) * T + t) * D);
  });
  return out;
}

// A decode step's attention (one new token per row): q [B, KV, G, D], mask [B, S] or none;
// `shared` columns the same in every row from its column from[b] on (or 0; `shared_attention`).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale,
                            int64_t shared, const c10::optional<at::Tensor>& from) {
  TORCH_CHECK(q.dim() == 4, "decode_attention: q [B, KV, G, D]");
  if (shared > 0 && q.size(0) > 1)
    return shared_attention(q, k, v, mask, scale, shared,
                            from.has_value() && from->defined()
                                ? *from : at::zeros({q.size(0)}, q.options().dtype(at::kLong)));
  return attention_rows(q.unsqueeze(3), k, v, mask, false, scale).squeeze(3);
}

namespace {


struct Shape {
  int64_t heads, kv_heads, head_dim, top_k;
  bool norm_topk, upcast;  // upcast: half-precision matmuls of >= 5 rows run in fp32
  double eps, scale;
};

using Opt = c10::optional<at::Tensor>;

// `model.linear`: qw, qs the weight's int8 copy (`quantize`), used for at most kRows rows
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const Opt& b, const Shape& s,
                  const Opt& qw = c10::nullopt, const Opt& qs = c10::nullopt) {
  if (qw.has_value() && x.numel() > 0 && x.numel() <= kRows * x.size(-1))
    return int8_rows(x, *qw, *qs, b);
  bool half = w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf;
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 &&
      x.numel() <= kRows * x.size(-1))
    return rows_linear(x, w, b);
  if (s.upcast && half && x.numel() >= 5 * x.size(-1)) {
    auto bias = b.has_value() ? c10::optional<at::Tensor>(b->to(at::kFloat)) : c10::nullopt;
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), bias).to(x.scalar_type());
  }
  return at::linear(x, w, b);
}

at::Tensor rms_normalize(const at::Tensor& x, double eps) {
  auto xf = x.to(at::kFloat);
  return (xf * xf.pow(2).mean(-1, true).add_(eps).rsqrt_()).to(x.scalar_type());
}

// weight * rms_normalize(x): in one pass for bf16 (as `RMSNorm.forward` with the extension)
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16)
    return rms_norm_rows(x, weight, eps);
  return weight * rms_normalize(x, eps);
}

at::Tensor rotate_half(const at::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return at::cat({halves[1].neg(), halves[0]}, -1);
}

// q: the experts' int8 copies (gate_up's weight and scale, down's; None: no copy), or empty
using ExpertsQ = std::vector<Opt>;

at::Tensor expert(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                  const Shape& s, const ExpertsQ& q, int64_t e) {
  Opt gq, gs, dq, ds;
  if (!q.empty() && q[0].has_value()) gq = (*q[0])[e], gs = (*q[1])[e];
  if (!q.empty() && q[2].has_value()) dq = (*q[2])[e], ds = (*q[3])[e];
  auto gu = linear(x, gate_up, c10::nullopt, s, gq, gs).chunk(2, -1);
  return linear(at::silu(gu[0]) * gu[1], down, c10::nullopt, s, dq, ds);
}

// Experts.forward: top-k expert MLPs per row, weighted and summed.
at::Tensor experts(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                   const at::Tensor& gate_up, const at::Tensor& down, const Shape& s,
                   const ExpertsQ& quant) {
  int64_t N = idx.size(0), k = idx.size(1);
  const ExpertsQ none;
  const ExpertsQ& q = N <= kRows ? quant : none;   // the copies serve decode steps' rows
  if (N == 1) {     // in fp32 from +0 in ascending expert order, rounded once (index_add_'s)
    auto ids = idx.accessor<int64_t, 2>();
    auto wf = w.to(at::kDouble).contiguous();   // Tensor.tolist() gives Python floats (doubles)
    auto ws = wf.accessor<double, 2>();
    std::vector<std::pair<int64_t, double>> chosen;
    for (int64_t j = 0; j < k; ++j) chosen.emplace_back(ids[0][j], ws[0][j]);
    std::sort(chosen.begin(), chosen.end());
    auto out = at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    for (const auto& [e, we] : chosen)
      out += (expert(x, gate_up[e], down[e], s, q, e) * we).to(at::kFloat);
    return out.to(x.scalar_type());
  }
  auto flat = idx.reshape(-1);
  auto order = at::argsort(flat, true, 0, false);
  auto counts_t = at::bincount(flat, {}, gate_up.size(0));
  auto counts = counts_t.accessor<int64_t, 1>();
  auto token = at::floor_divide(order, k);
  auto xs = x.index({token});
  auto ys = at::empty_like(xs);
  int64_t start = 0;
  for (int64_t e = 0; e < gate_up.size(0); ++e) {
    int64_t n = counts[e];
    if (n) {
      ys.slice(0, start, start + n).copy_(
          expert(xs.slice(0, start, start + n), gate_up[e], down[e], s, q, e));
      start += n;
    }
  }
  ys = ys * w.reshape(-1).index({order}).unsqueeze(-1).to(ys.scalar_type());
  return at::zeros_like(x).index_add_(0, token, ys);
}

// `decode_step` for its common case, on pointers: every weight, the cache and the rotary
// tables bf16, at most 8 rows, q, k and v's weights in one (`qkv`), no biases; and the same
// with int8 copies (`quant`, fp32 scales) of every weight `quantize` copies (q, k, v, o, the
// experts', the output head's), read by `int8_rows`' and `moe_rows_i8`'s kernels as the
// step below reads them (q, k and v each its own product, so each row its own bits).
// The same kernels on the same values in the same order as the step below, so the same bits
// (`rows_linear`'s, `rms_norm_rows`', `rope_rows`', `decode_attention`'s, `moe_rows`' bodies;
// a bf16 sum is fp32 rounded once to nearest even, as ATen's), without the ~70 tensor
// operations a layer (views, slices, copies, allocations) that cost about as much as the
// arithmetic at these sizes: what stays is the router's softmax and top-k and the experts'
// silu, by ATen, as before. Returns nothing when the case is another.
std::vector<at::Tensor> decode_direct(
    const at::Tensor& tokens, int64_t past, at::Tensor& valid, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& embed, const at::Tensor& final_norm,
    const at::Tensor& lm_head, const std::vector<c10::optional<at::Tensor>>& layers,
    const std::vector<c10::optional<at::Tensor>>& biases,
    const std::vector<c10::optional<at::Tensor>>& qkv, const std::vector<at::Tensor>& k_cache,
    const std::vector<at::Tensor>& v_cache, int64_t heads, int64_t kv_heads, int64_t D,
    int64_t top_k, bool norm_topk, double eps, double scale, int64_t shared,
    const c10::optional<at::Tensor>& shared_from, const std::vector<at::Tensor>& packed,
    const std::vector<c10::optional<at::Tensor>>& quant) {
  const int64_t B = tokens.size(0), L = static_cast<int64_t>(k_cache.size());
  const int64_t H = embed.size(1), V = lm_head.size(0), G = heads / kv_heads;
  const int64_t NQ = heads * D, NK = kv_heads * D, NH = heads + kv_heads;
  auto bf = [](const c10::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() && t->scalar_type() == at::kBFloat16 &&
           t->is_contiguous();
  };
  auto none = [](const c10::optional<at::Tensor>& t) { return !t.has_value() || !t->defined(); };
  // quant[i] an int8 copy [N, K] (or [E, N, K]) and quant[i + 1] its fp32 scales
  auto copy = [&](int64_t i, std::initializer_list<int64_t> shape) {
    const c10::optional<at::Tensor> &q = quant[i], &s = quant[i + 1];
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return !none(q) && !none(s) && q->scalar_type() == at::kChar && q->is_contiguous() &&
           q->sizes().vec() == std::vector<int64_t>(shape) && s->scalar_type() == at::kFloat &&
           s->is_contiguous() && s->numel() * shape.end()[-1] == n;
  };
  const bool q8 = !quant.empty();
  if (q8 && static_cast<int64_t>(quant.size()) != 12 * L + 2) return {};
  if (B < 1 || B > kRows || tokens.dim() != 1 || tokens.scalar_type() != at::kLong ||
      valid.dim() != 2 || valid.scalar_type() != at::kBool || valid.stride(1) != 1 ||
      valid.size(0) != B || !bf(embed) || !bf(final_norm) || !bf(lm_head) || !bf(cos_table) ||
      !bf(sin_table) || cos_table.size(-1) != D || sin_table.size(-1) != D ||
      lm_head.size(1) != H || final_norm.numel() != H || static_cast<int64_t>(layers.size()) != 10 * L)
    return {};
  int64_t E = 0, I = 0;
  for (int64_t l = 0; l < L; ++l) {
    const c10::optional<at::Tensor>* p = &layers[10 * l];
    if (!bf(p[0]) || !bf(p[4]) || !bf(p[6]) || !bf(p[7]) || !bf(p[8]) || !bf(p[9]) ||
        !(none(p[5]) || bf(p[5])) || !(q8 || bf(qkv[2 * l])) || !none(qkv[2 * l + 1]))
      return {};
    for (int j = 0; j < 4; ++j)
      if (!none(biases[4 * l + j])) return {};
    const at::Tensor &k = k_cache[l], &v = v_cache[l], &gu = *p[8], &dn = *p[9];
    if (l == 0) E = gu.size(0), I = dn.size(2);
    if (k.scalar_type() != at::kBFloat16 || v.scalar_type() != at::kBFloat16 || k.dim() != 4 ||
        v.sizes() != k.sizes() || k.size(0) != B || k.size(1) != kv_heads || k.size(3) != D ||
        k.size(2) <= past || k.stride(3) != 1 || k.stride(2) != D || v.stride(3) != 1 ||
        v.stride(2) != D ||
        (!q8 && (qkv[2 * l]->size(0) != NQ + 2 * NK || qkv[2 * l]->size(1) != H)) ||
        p[4]->size(0) != H || p[4]->size(1) != NQ || p[0]->numel() != H || p[6]->numel() != H ||
        p[7]->size(0) != E || p[7]->size(1) != H || gu.size(0) != E || gu.size(1) != 2 * I ||
        gu.size(2) != H || dn.size(0) != E || dn.size(1) != H || dn.size(2) != I ||
        (bf(p[5]) && p[5]->numel() != NH * D))
      return {};
    const int64_t c = 12 * l;
    if (q8 && !(copy(c, {NQ, H}) && copy(c + 2, {NK, H}) && copy(c + 4, {NK, H}) &&
                copy(c + 6, {H, NQ}) && copy(c + 8, {E, 2 * I, H}) && copy(c + 10, {E, H, I})))
      return {};
  }
  if (q8 && !copy(12 * L, {V, H})) return {};
  auto u16 = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  };
  // the weights packed (`pack_weight`), 5 a layer (q/k/v, o, router, gate_up, down) and the
  // output head's: used when every one is there in the expected size, else none
  auto fits = [&](int64_t i, int64_t N, int64_t K) {   // packed[i] holds w [N, K] packed
    const at::Tensor& t = packed[i];
    return t.defined() && t.scalar_type() == at::kInt && t.is_contiguous() &&
           t.numel() == (N + 15) / 16 * 16 * K / 2;
  };
  bool use_packed = static_cast<int64_t>(packed.size()) == 5 * L + 1 && packs(H) &&
                    packs(NQ) && packs(I) && (2 * I) % 16 == 0 && H % 16 == 0 &&
                    fits(5 * L, V, H);
  for (int64_t l = 0; use_packed && l < L; ++l)
    use_packed = fits(5 * l, NQ + 2 * NK, H) && fits(5 * l + 1, H, NQ) &&
                 fits(5 * l + 2, E, H) && fits(5 * l + 3, E * 2 * I, H) &&
                 fits(5 * l + 4, E * H, I);
  auto u32 = [&](int64_t i) {
    return use_packed ? reinterpret_cast<const uint32_t*>(packed[i].data_ptr<int32_t>())
                      : nullptr;
  };
  auto raw = [](const std::vector<at::BFloat16>& b) {
    return reinterpret_cast<const uint16_t*>(b.data());
  };
  // the key padding: a column not yet valid in some row means left padding (positions count
  // a row's own tokens, and attention takes the mask)
  bool* vp = valid.data_ptr<bool>();
  const int64_t vs = valid.stride(0);
  bool padded = false;
  for (int64_t b = 0; b < B && !padded; ++b)
    for (int64_t j = 0; j < past && !padded; ++j) padded = !vp[b * vs + j];
  std::vector<int64_t> pos(B, past);
  for (int64_t b = 0; b < B; ++b) {
    vp[b * vs + past] = true;
    if (padded) {
      int64_t n = 0;
      for (int64_t j = 0; j <= past; ++j) n += vp[b * vs + j];
      pos[b] = std::max<int64_t>(n - 1, 0);
    }
    TORCH_CHECK(pos[b] < cos_table.size(0), "decode_step: position past the rotary table");
  }
  const auto tk = tokens.contiguous();
  const int64_t* tp = tk.data_ptr<int64_t>();
  std::vector<at::BFloat16> x(B * H), h(B * H), qkvo(B * (NQ + 2 * NK)), qk(B * NH * D),
      qn(B * NH * D), q(B * NQ), att(B * NQ), o(B * H), gate(B * E), y(B * H),
      wbf(B * top_k);
  std::vector<float> gatef(B * E);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(tp[b] >= 0 && tp[b] < embed.size(0), "decode_step: token id out of range");
    std::memcpy(x.data() + b * H, embed.data_ptr<at::BFloat16>() + tp[b] * H, H * 2);
  }
  std::vector<float> xbuf;
  auto matmul = [&](const std::vector<at::BFloat16>& in, const at::Tensor& w, at::BFloat16* out,
                    const uint32_t* wq) {
    const int64_t N = w.size(0), K = w.size(1);
#if defined(__AVX512BF16__)
    if (wq) return packed_kernel(B, raw(in), wq, N, K, nullptr, out);
#endif
    const XRow* xr = xrow_ptr(raw(in), B * K, xbuf);
    with_rows(B, [&](auto m) { rows_kernel<decltype(m)::value>(xr, u16(w), N, K, nullptr, out); });
  };
  std::vector<float> xf;
  auto matmul8 = [&](const float* in, int64_t i, at::BFloat16* out) {   // in: B rows, fp32
    const at::Tensor &qw = *quant[i], &qs = *quant[i + 1];    // the copy quant[i], [N, K]
    int8_kernel(B, in, qw.data_ptr<int8_t>(), qw.size(0), qw.size(1), qs.data_ptr<float>(),
                nullptr, out);
  };
  std::vector<at::BFloat16> part(q8 ? B * std::max(NQ, NK) : 0);
  auto add = [&](const std::vector<at::BFloat16>& r) {      // x = x + r, as ATen adds bf16
    for (int64_t i = 0; i < B * H; ++i)
      x[i] = at::BFloat16(static_cast<float>(x[i]) + static_cast<float>(r[i]));
  };
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  std::vector<int64_t> from(B, 0);
  if (shared > 0 && B > 1 && shared_from.has_value() && shared_from->defined()) {
    const auto fc = shared_from->to(at::kLong).contiguous();
    TORCH_CHECK(fc.numel() == B, "shared_attention: one first shared column per row");
    std::copy(fc.data_ptr<int64_t>(), fc.data_ptr<int64_t>() + B, from.begin());
  }
  auto routes = at::empty({B, 1, L, top_k}, tokens.options());
  int64_t* rp = routes.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l) {
    const c10::optional<at::Tensor>* p = &layers[10 * l];
    const at::Tensor &kc = k_cache[l], &vc = v_cache[l];
    rms_rows(raw(x), B, H, u16(*p[0]), 1, e, h.data());
    if (q8) {                                       // q, k and v, each into its columns
      const int64_t first[3] = {0, NQ, NQ + NK}, width[3] = {NQ, NK, NK};
      const float* hf = widened(raw(h), B * H, xf);    // once for the three
      for (int j = 0; j < 3; ++j) {
        matmul8(hf, 12 * l + 2 * j, part.data());
        for (int64_t b = 0; b < B; ++b)
          std::memcpy(qkvo.data() + b * (NQ + 2 * NK) + first[j], part.data() + b * width[j],
                      width[j] * 2);
      }
    } else {
      matmul(h, *qkv[2 * l], qkvo.data(), u32(5 * l));
    }
    for (int64_t b = 0; b < B; ++b)                 // q and k of each row: [NH, D]
      std::memcpy(qk.data() + b * NH * D, qkvo.data() + b * (NQ + 2 * NK), NH * D * 2);
    const uint16_t* qkr = raw(qk);
    if (bf(p[5])) {
      rms_rows(raw(qk), B * NH, D, u16(*p[5]), NH, e, qn.data());
      qkr = raw(qn);
    }
    auto* kp = reinterpret_cast<uint16_t*>(kc.data_ptr<at::BFloat16>());
    auto* vcp = reinterpret_cast<uint16_t*>(vc.data_ptr<at::BFloat16>());
    const int64_t kb = kc.stride(0), kh = kc.stride(1), vb = vc.stride(0), vh = vc.stride(1);
    for (int64_t b = 0; b < B; ++b) {
      const uint16_t* c = u16(cos_table) + pos[b] * D;
      const uint16_t* sn = u16(sin_table) + pos[b] * D;
      for (int64_t n = 0; n < NH; ++n)
        rope_row(qkr + (b * NH + n) * D, c, sn, D,
                 n < heads ? q.data() + (b * heads + n) * D
                           : reinterpret_cast<at::BFloat16*>(kp + b * kb + (n - heads) * kh +
                                                              past * D));
      for (int64_t j = 0; j < kv_heads; ++j)       // v into the cache
        std::memcpy(vcp + b * vb + j * vh + past * D,
                    qkvo.data() + b * (NQ + 2 * NK) + NQ + NK + j * D, D * 2);
    }
    std::vector<float> qbuf;
    const XRow* qx = xrow_ptr(raw(q), B * NQ, qbuf);
    const bool* mp = padded ? vp : nullptr;
    if (!(shared > 0 && B > 1 &&
          shared_raw(qx, B, kv_heads, G, D, past + 1, kp, kb, kh, vcp, vb, vh, mp, vs, sc,
                     shared, from.data(), att.data())))
      attention_raw(qx, B, kv_heads, G, 1, D, past + 1, kp, kb, kh, vcp, vb, vh, mp, vs, false,
                    sc, att.data());
    if (q8) matmul8(widened(raw(att), B * NQ, xf), 12 * l + 6, o.data());
    else matmul(att, *p[4], o.data(), u32(5 * l + 1));
    add(o);
    rms_rows(raw(x), B, H, u16(*p[6]), 1, e, h.data());
    matmul(h, *p[7], gate.data(), u32(5 * l + 2));
    for (int64_t i = 0; i < B * E; ++i) gatef[i] = static_cast<float>(gate[i]);
    const auto top = at::from_blob(gatef.data(), {B, E}, at::kFloat).softmax(-1).topk(top_k, -1);
    const auto idx = std::get<1>(top).contiguous();
    at::Tensor w = std::get<0>(top).contiguous();
    if (norm_topk && top_k == 2) {    // w / w.sum(-1, true): two weights' sum is one addition
      const float* wp = w.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        const float total = wp[2 * b] + wp[2 * b + 1];
        for (int j = 0; j < 2; ++j) wbf[2 * b + j] = at::BFloat16(wp[2 * b + j] / total);
      }
    } else {
      if (norm_topk) w = w / w.sum(-1, true);
      const auto wb = w.to(at::kBFloat16).contiguous();
      std::copy(wb.data_ptr<at::BFloat16>(), wb.data_ptr<at::BFloat16>() + B * top_k,
                wbf.begin());
    }
    if (q8)
      moe_i8(raw(h), B, H, idx.data_ptr<int64_t>(), top_k, wbf.data(),
             quant[12 * l + 8]->data_ptr<int8_t>(), quant[12 * l + 9]->data_ptr<float>(),
             quant[12 * l + 10]->data_ptr<int8_t>(), quant[12 * l + 11]->data_ptr<float>(), E, I,
             y.data());
    else
      moe_bf16(raw(h), B, H, idx.data_ptr<int64_t>(), top_k, wbf.data(), u16(*p[8]),
               u16(*p[9]), E, I, y.data(), u32(5 * l + 3), u32(5 * l + 4));
    add(y);
    for (int64_t b = 0; b < B; ++b)
      std::copy(idx.data_ptr<int64_t>() + b * top_k, idx.data_ptr<int64_t>() + (b + 1) * top_k,
                rp + (b * L + l) * top_k);
  }
  rms_rows(raw(x), B, H, u16(final_norm), 1, e, h.data());
  auto logits = at::empty({B, 1, V}, lm_head.options());
  if (q8) matmul8(widened(raw(h), B * H, xf), 12 * L, logits.data_ptr<at::BFloat16>());
  else matmul(h, lm_head, logits.data_ptr<at::BFloat16>(), u32(5 * L));
  return {logits, routes};
}

}  // namespace

// tokens [B] long; past: columns already in the cache; valid [B, max_len] bool (the cache's
// key padding, updated here); cos/sin [max_position, D] tables; layers: 10 tensors per layer
// (input norm, q, k, v, o, q/k-norm weight [h + kv, D] or undefined, post norm, router,
// gate_up, down); biases: 4 per layer (q, k, v, o; each may be None); qkv: 2 per layer, q, k
// and v's weights and biases concatenated (bf16; None: three matmuls); k_cache/v_cache: per
// layer [B, kv, max_len, D]; shared, shared_from: columns every row holds the same, from its
// column shared_from[b] on (`KVCache.share`; 0 and None when unknown); quant: empty, or the
// int8 copies (`quantize`) as (weight, scale) pairs, 6 per layer (q, k, v, o, gate_up, down;
// None: that layer's full weight), then the output head's pair; packed: empty, or the bf16
// weights packed by `pack_weight` for the direct step, 5 per layer (q/k/v as in qkv, o, the
// router, gate_up and down of all experts), then the output head's. Returns (logits
// [B, 1, V], routes [B, 1, L, k]).
std::vector<at::Tensor> decode_step(const at::Tensor& tokens, int64_t past, at::Tensor valid,
                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                    const at::Tensor& embed, const at::Tensor& final_norm,
                                    const at::Tensor& lm_head,
                                    const std::vector<c10::optional<at::Tensor>>& layers,
                                    const std::vector<c10::optional<at::Tensor>>& biases,
                                    const std::vector<c10::optional<at::Tensor>>& qkv,
                                    const std::vector<at::Tensor>& k_cache,
                                    const std::vector<at::Tensor>& v_cache, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, int64_t top_k,
                                    bool norm_topk, bool upcast, double eps, double scale,
                                    int64_t shared, const c10::optional<at::Tensor>& shared_from,
                                    const std::vector<c10::optional<at::Tensor>>& quant,
                                    bool direct, const std::vector<at::Tensor>& packed) {
  at::NoGradGuard no_grad;
  if (direct) {
    auto out = decode_direct(tokens, past, valid, cos_table, sin_table, embed, final_norm,
                             lm_head, layers, biases, qkv, k_cache, v_cache, heads, kv_heads,
                             head_dim, top_k, norm_topk, eps, scale, shared, shared_from, packed,
                             quant);
    if (!out.empty()) return out;
  }
  const Shape s{heads, kv_heads, head_dim, top_k, norm_topk, upcast, eps, scale};
  const int64_t B = tokens.size(0), D = head_dim, group = heads / kv_heads;
  const int64_t L = static_cast<int64_t>(k_cache.size());
  bool padded = past > 0 && !valid.slice(1, 0, past).all().item<bool>();
  valid.select(1, past).fill_(true);
  at::Tensor positions;
  if (padded) {
    positions = (valid.slice(1, 0, past + 1).to(at::kLong).cumsum(-1).slice(1, past) - 1).clamp_min(0);
  } else {
    positions = at::arange(past, past + 1, tokens.options()).expand({B, 1});
  }
  auto x = at::embedding(embed, tokens.view({B, 1}));
  auto cos = cos_table.index({positions}).unsqueeze(1);
  auto sin = sin_table.index({positions}).unsqueeze(1);
  c10::optional<at::Tensor> mask;
  if (padded) mask = valid.slice(1, 0, past + 1).unsqueeze(1).unsqueeze(1).contiguous();
  std::vector<at::Tensor> routes;
  for (int64_t l = 0; l < L; ++l) {
    const c10::optional<at::Tensor>* p = &layers[10 * l];
    const at::Tensor& in_norm = *p[0]; const at::Tensor& wq = *p[1]; const at::Tensor& wk = *p[2];
    const at::Tensor& wv = *p[3]; const at::Tensor& wo = *p[4]; const auto& qk_w = p[5];
    const at::Tensor& post_norm = *p[6]; const at::Tensor& router = *p[7];
    const at::Tensor& gate_up = *p[8]; const at::Tensor& down = *p[9];
    const auto& k_cache_l = k_cache[l];
    auto qw = [&](int64_t j) { return quant.empty() ? Opt() : quant[12 * l + 2 * j]; };
    auto qs = [&](int64_t j) { return quant.empty() ? Opt() : quant[12 * l + 2 * j + 1]; };
    auto h = norm(x, in_norm, eps);
    at::Tensor q, k, v;
    if (qkv[2 * l].has_value() && h.scalar_type() == at::kBFloat16 && B <= kRows) {
      // one pass over q, k and v's weights together: `rows_linear`'s outputs depend only on
      // their own weight rows, so the bits are the three calls'
      auto all = rows_linear(h, *qkv[2 * l], qkv[2 * l + 1]);
      q = all.slice(-1, 0, heads * D);
      k = all.slice(-1, heads * D, (heads + kv_heads) * D);
      v = all.slice(-1, (heads + kv_heads) * D, (heads + 2 * kv_heads) * D);
    } else {
      q = linear(h, wq, biases[4 * l], s, qw(0), qs(0));
      k = linear(h, wk, biases[4 * l + 1], s, qw(1), qs(1));
      v = linear(h, wv, biases[4 * l + 2], s, qw(2), qs(2));
    }
    auto qk = at::cat({q.view({B, 1, heads, D}), k.view({B, 1, kv_heads, D})}, 2);
    if (qk_w.has_value()) qk = norm(qk, *qk_w, eps);
    v = v.view({B, 1, kv_heads, D}).transpose(1, 2);
    if (qk.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16) {
      qk = rope_rows(qk, cos, sin);         // as `Attention.forward` with the extension
    } else {
      qk = qk.transpose(1, 2);
      qk = qk * cos + rotate_half(qk) * sin;
    }
    auto parts = qk.split_with_sizes({heads, kv_heads}, 1);
    auto dtype = k_cache_l.scalar_type();
    auto qd = parts[0].to(dtype), kd = parts[1].to(dtype), vd = v.to(dtype);
    k_cache_l.slice(2, past, past + 1).copy_(kd);
    v_cache[l].slice(2, past, past + 1).copy_(vd);
    auto keys = k_cache_l.slice(2, 0, past + 1), values = v_cache[l].slice(2, 0, past + 1);
    at::Tensor out;
    if (dtype == at::kBFloat16) {           // as `Attention.forward` with the extension built
      out = decode_attention(qd.reshape({B, kv_heads, group, D}), keys, values, mask, scale,
                             shared, shared_from)
                .reshape({B, 1, -1});
    } else if (group > 1) {
      out = at::scaled_dot_product_attention(qd.reshape({B, kv_heads, group, D}), keys, values,
                                             mask, 0.0, false, scale);
      out = out.reshape({B, 1, -1});
    } else {
      out = at::scaled_dot_product_attention(qd, keys, values, mask, 0.0, false, scale, false);
      out = out.transpose(1, 2).reshape({B, 1, -1});
    }
    x = x + linear(out.to(x.scalar_type()), wo, biases[4 * l + 3], s, qw(3), qs(3));
    h = norm(x, post_norm, eps);
    auto flat = h.reshape({-1, h.size(-1)});
    auto probs = linear(flat, router, c10::nullopt, s).to(at::kFloat).softmax(-1);
    auto top = probs.topk(top_k, -1);
    auto w = std::get<0>(top);
    auto idx = std::get<1>(top);
    if (norm_topk) w = w / w.sum(-1, true);
    ExpertsQ eq;
    if (qw(4).has_value() || qw(5).has_value()) eq = {qw(4), qs(4), qw(5), qs(5)};
    const bool rows = flat.scalar_type() == at::kBFloat16 &&
                      gate_up.scalar_type() == at::kBFloat16 && flat.size(0) <= kRows;
    auto y = rows && eq.empty()
                 ? moe_rows(flat, idx, w.to(flat.scalar_type()), gate_up, down)
             : rows && eq[0].has_value() && eq[2].has_value()
                 ? moe_rows_i8(flat, idx, w.to(flat.scalar_type()), *eq[0], *eq[1], *eq[2],
                               *eq[3])
                 : experts(flat, idx, w.to(flat.scalar_type()), gate_up, down, s, eq);
    x = x + y.view({B, 1, -1});
    routes.push_back(idx.view({B, 1, -1}));
  }
  Opt hq, hs;
  if (!quant.empty()) hq = quant[12 * L], hs = quant[12 * L + 1];
  auto logits = linear(norm(x, final_norm, eps), lm_head, c10::nullopt, s, hq, hs);
  return {logits, at::stack(routes, 2)};
}

// ---- the next token of each row: `generate.sample` without top-k / top-p, in one pass ------
// logits [B, V] (fp32 or bf16); temperature <= 0: greedy, the first index of the largest
// logit (`argmax`); else s = logits / temperature, and the token is the first index whose
// running sum of exp(s - max) exceeds u[b] (uniform in [0, 1)) times their total, clamped to
// the last index with mass (`generate._draw` on `log_softmax(s).exp()`). The logprob is
// s[token] - max - log(total) (`log_softmax(s)[token]`): the same distribution and the same
// uniform number per row as the tensor path, in 3 passes over V instead of ~11 operations
// that each write [B, V]. Measured on a 2-core AMD EPYC (the default model's vocabulary of
// 8,192, temperature 0.6, 10th percentile of 400 calls): 8 us against 42 for one row, 44
// against 652 for a group's 8 rows, where a decode step of the 8 takes ~1.5 ms. The running
// sum is in double, as ATen's cumsum of floats; the total in fp32 (`exp_ps`, ~1 ulp). So a
// logprob may differ from `log_softmax`'s in its last bits, and a draw only when u falls
// within rounding of a token's edge. Returns (tokens [B] long, logprobs [B] fp32).
std::vector<at::Tensor> sample_rows(const at::Tensor& logits, double temperature,
                                    const c10::optional<at::Tensor>& u) {
  RECORD_FUNCTION("apprentice::sample_rows", std::vector<c10::IValue>({logits}));
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "sample_rows: logits [B, V]");
  const bool greedy = temperature <= 0;
  TORCH_CHECK(greedy || (u.has_value() && u->numel() == logits.size(0)),
              "sample_rows: one uniform number per row to sample");
  const auto x = logits.to(at::kFloat).contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor uf;
  if (!greedy) uf = u->to(at::kFloat).contiguous();
  auto tok = at::empty({B}, x.options().dtype(at::kLong));
  auto lp = at::empty({B}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* up = greedy ? nullptr : uf.data_ptr<float>();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  const float t = greedy ? 1.0f : static_cast<float>(temperature);   // s = logits / t
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / V);   // 8 rows of 8,192: 2 threads
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    for (int64_t b = begin; b < end; ++b) {
      const float* r = xp + b * V;
      float mx = -INFINITY, total;
      int64_t arg = -1;
#if defined(__AVX512F__)
      const __m512 it = _mm512_set1_ps(t);
      __m512 top = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;                           // a NaN anywhere refuses the row, as the
      for (int64_t i = 0; i < V; i += kLanes) {    // scalar loop's exp does
        const __mmask16 k = V - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
        const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(k, r + i), it);
        nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, k, top, v);
      }
      mx = nan ? NAN : _mm512_reduce_max_ps(top);
      const __m512 m = _mm512_set1_ps(mx);
      for (int64_t i = 0; greedy && i < V && arg < 0; i += kLanes) {   // the first holding it
        const __mmask16 k = V - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(
            k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, r + i), it), m, _CMP_EQ_OQ);
        if (hit) arg = i + __builtin_ctz(hit);
      }
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < V; i += kLanes) {
        const __mmask16 k = V - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
        const __m512 v = exp_ps(_mm512_sub_ps(
            _mm512_div_ps(_mm512_mask_loadu_ps(m, k, r + i), it), m));
        _mm512_mask_storeu_ps(e.data() + i, k, v);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, v));
      }
      total = lane_sum(sum);
#elif defined(__AVX2__) && defined(__FMA__)
      // the AVX512 loops' values in two halves of 8 lanes (`exp8_ps` has `exp_ps`'s bits;
      // lanes 0-7 and 8-15 of each block of 16 summed apart, then `lane_sum`'s tree), the
      // last partial block one value at a time (`exp_one`): the same token and logprob bits
      // as an AVX512 CPU, where the scalar loop below took ~80 us a row of 8,192 (libm's exp)
      const __m256 it = _mm256_set1_ps(t);
      const bool one = t == 1.0f;                  // x / 1 is x: no division (greedy too)
      auto scaled = [&](const float* p) {
        return one ? _mm256_loadu_ps(p) : _mm256_div_ps(_mm256_loadu_ps(p), it);
      };
      const int64_t whole = V / kLanes * kLanes;
      __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
      for (int64_t i = 0; i + 8 <= V; i += 8) {
        const __m256 v = scaled(r + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
      }
      float tops[8];
      _mm256_storeu_ps(tops, top);
      for (float v : tops) mx = std::max(mx, v);
      bool bad = _mm256_movemask_ps(nan) != 0;     // a NaN anywhere refuses the row, as the
      for (int64_t i = V / 8 * 8; i < V; ++i) {    // scalar loop's exp does
        bad |= std::isnan(r[i]);
        mx = std::max(mx, r[i] / t);
      }
      if (bad) mx = NAN;
      for (int64_t i = 0; greedy && i < V; ++i)    // the first holding it
        if (r[i] / t == mx) { arg = i; break; }
      const __m256 m = _mm256_set1_ps(mx);
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t i = 0; i < whole; i += kLanes) {
        const __m256 a = exp8_ps(_mm256_sub_ps(scaled(r + i), m));
        const __m256 b = exp8_ps(_mm256_sub_ps(scaled(r + i + 8), m));
        _mm256_storeu_ps(e.data() + i, a);
        _mm256_storeu_ps(e.data() + i + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
      }
      float lanes[kLanes];
      _mm256_storeu_ps(lanes, lo);
      _mm256_storeu_ps(lanes + 8, hi);
      for (int64_t i = whole; i < V; ++i) {
        e[i] = exp_one(r[i] / t - mx);
        lanes[i - whole] += e[i];
      }
      total = lane_sum(lanes);
#else
      for (int64_t i = 0; i < V; ++i)
        if (r[i] / t > mx) mx = r[i] / t, arg = i;
      float lanes[kLanes] = {};
      for (int64_t i = 0; i < V; ++i) {
        e[i] = std::exp(r[i] / t - mx);
        lanes[i % kLanes] += e[i];
      }
      total = lane_sum(lanes);
#endif
      TORCH_CHECK((arg >= 0 || !greedy) && std::isfinite(mx) && std::isfinite(total),
                  "sample_rows: a row of logits with no finite maximum (NaN or all -inf)");
      int64_t pick = arg;
      if (!greedy) {                               // the first running sum above u * total
        const double target = static_cast<double>(up[b]) * total;
        double run = 0.0;                          // in double, as ATen's cumsum of floats
        int64_t last = 0;
        pick = -1;
        for (int64_t i = 0; i < V; ++i) {
          if (e[i] > 0.0f) last = i;
          run += e[i];
          if (run > target) { pick = i; break; }
        }
        if (pick < 0) pick = last;                 // u * total rounded above the sum
      }
      tp[b] = pick;
      lpp[b] = r[pick] / t - mx - std::log(total);
    }
  });
  return {tok, lp};
}

// ---- causal attention for training: forward with its log-sum-exp, and backward -----------
// What `scaled_dot_product_attention(q, k, v, is_causal=True, scale=, enable_gqa=True)` and
// its backward compute for bf16 q [B, H, S, D] and k, v [B, KV, S, D] (D % 32 == 0), on AMX
// tiles. PyTorch's CPU flash kernel spent ~5x its forward's time in its backward here (the
// GRPO trainer: 38 % of a step in attention, 32 % in its backward alone). Flash attention's
// plan: per (row, kv head), the G query heads' rows of one block of 64 positions as the
// tiles' rows (M = 64 G), scored against the keys they see (causal, so the block's last
// position bounds them); the probabilities are recomputed in the backward from the saved
// log-sum-exp instead of stored. Each product's right operand is packed once per (row, kv
// head) in the pairs layout TDPBF16PS takes (keys and values, both ways), so the tiles' sums
// land row-major. Softmax in fp32 (`scale_visible`, `exp_lanes`), probabilities rounded to
// bf16 before they meet the values (as a bf16 math path does); gradients accumulated in fp32.
// CPUs with AVX512-BF16 and no AMX (AMD Zen 4) run the same plan with `dp_mm` in place of the
// tiles: PyTorch's kernel there spent 45 % of a GRPO training step in attention.
#if defined(APPRENTICE_AMX) || defined(__AVX512BF16__)
#define APPRENTICE_TRAIN_ATTENTION 1
namespace {

constexpr int64_t kQBlock = 64;                      // positions per query block

#if !defined(APPRENTICE_AMX)
inline bool amx_ready() { return false; }
#endif

inline int64_t up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The pairs layout of x [R, C] (row stride ld) as the right operand of a product over its
// rows: out[(r / 2) * 2 C' + 2 c + r % 2] = x[r, c] (C' = `cols`, zero past C and R; rows
// padded to `rows`, even).
void pack_rows(const uint16_t* x, int64_t R, int64_t C, int64_t ld, int64_t rows, int64_t cols,
               uint16_t* out) {
  if (C % 32 || cols != C) {
    std::fill(out, out + rows * cols, uint16_t{0});
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) out[(r / 2) * 2 * cols + 2 * c + r % 2] = x[r * ld + c];
    return;
  }
  static const auto order = [] {                     // lanes of two rows' 32 values, paired
    std::array<std::array<uint16_t, 32>, 2> idx{};
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < 32; ++i) idx[half][i] = (i % 2) * 32 + half * 16 + i / 2;
    return idx;
  }();
  const __m512i lo = _mm512_loadu_si512(order[0].data()), hi = _mm512_loadu_si512(order[1].data());
  for (int64_t r = 0; r < rows; r += 2) {
    uint16_t* o = out + r * C;
    for (int64_t c = 0; c < C; c += 32) {
      const __m512i a = r < R ? _mm512_loadu_si512(x + r * ld + c) : _mm512_setzero_si512();
      const __m512i b = r + 1 < R ? _mm512_loadu_si512(x + (r + 1) * ld + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// The pairs layout of x^T, x [R, C] (row stride ld): the right operand of a product over x's
// columns, out[(c / 2) * 2 R' + 2 r + c % 2] = x[r, c] (R' = `rows`, zero past R; C even).
void pack_cols(const uint16_t* x, int64_t R, int64_t C, int64_t ld, int64_t rows, uint16_t* out) {
  std::fill(out, out + rows * C, uint16_t{0});
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) out[(c / 2) * 2 * rows + 2 * r + c % 2] = x[r * ld + c];
}

// `tile_mm` without tiles, for R <= 8 rows of a and 16 NV columns: each output a chain of
// AVX512-BF16 dot products over the pairs of k in increasing order (one fp32 lane; VDPBF16PS
// adds a pair's two products to it), a's pair of k broadcast to every lane, b's packed pairs
// of 16 columns read as they lie. R x NV accumulators stay in registers over all of K.
template <int R, int NV>
void dp_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t width,
              int64_t K, float* c, int64_t ldc, bool add) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* bk = b + (k / 2) * 2 * ldb;
    __m512bh w[NV];
    for (int j = 0; j < NV; ++j) w[j] = (__m512bh)_mm512_loadu_si512(bk + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + k, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const int64_t live = std::min<int64_t>(16, width - 16 * j);
    if (live <= 0) break;
    const __mmask16 keep = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    for (int r = 0; r < R; ++r) {
      float* out = c + r * ldc + 16 * j;
      __m512 v = acc[r][j];
      if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, out));
      _mm512_mask_storeu_ps(out, keep, v);
    }
  }
}

void dp_mm(int64_t M, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
           int64_t N, int64_t K, float* c, int64_t ldc, bool add) {
  for (int64_t m = 0; m < M; m += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, M - m);
    for (int64_t n = 0; n < N; n += 32) {
      const uint16_t* bn = b + 2 * n;
      float* cn = c + m * ldc + n;
      const uint16_t* am = a + m * lda;
      with_rows(rows, [&](auto r) {
        if (n + 16 < N) dp_block<decltype(r)::value, 2>(am, lda, bn, ldb, N - n, K, cn, ldc, add);
        else dp_block<decltype(r)::value, 1>(am, lda, bn, ldb, N - n, K, cn, ldc, add);
      });
    }
  }
}

// c [M, N] (row stride ldc, fp32) = a [M, K] (bf16, row stride lda) @ b, where b [K, N] is
// packed by pairs of its rows (row stride of the packing: 2 * ldb elements, N <= ldb, both
// multiples of 16; K % 32 == 0), or c += that product with `add`. M may be any: a's last
// rows are padded. On AMX tiles where Linux grants them, else `dp_mm`.
void tile_mm(int64_t M, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
             int64_t N, int64_t K, float* c, int64_t ldc, bool add) {
  if (!amx_ready()) {
    dp_mm(M, a, lda, b, ldb, N, K, c, ldc, add);
    return;
  }
#if defined(APPRENTICE_AMX)
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  thread_local std::vector<uint16_t> spare;
  alignas(64) float tmp[2][16 * 16];
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m);
    const uint16_t* ar = a + m * lda;
    int64_t la = lda;
    if (rows < 16) {                                 // the last rows, padded with zeros
      spare.assign(16 * K, 0);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(&spare[r * K], ar + r * lda, K * 2);
      ar = spare.data();
      la = K;
    }
    for (int64_t n = 0; n < N; n += 32) {
      const bool two = n + 16 < N;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(2, ar + k, la * 2);
        _tile_loadd(4, b + (k / 2) * 2 * ldb + 2 * n, ldb * 4);
        _tile_dpbf16ps(0, 2, 4);
        if (two) {
          _tile_loadd(5, b + (k / 2) * 2 * ldb + 2 * (n + 16), ldb * 4);
          _tile_dpbf16ps(1, 2, 5);
        }
      }
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t n0 = n + 16 * h, width = std::min<int64_t>(16, N - n0);
        if (!add && rows == 16 && width == 16) {       // straight into c
          if (h == 0) _tile_stored(0, c + m * ldc + n0, ldc * 4);
          else _tile_stored(1, c + m * ldc + n0, ldc * 4);
          continue;
        }
        if (h == 0) _tile_stored(0, tmp[0], 64);
        else _tile_stored(1, tmp[1], 64);
        const __mmask16 live = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
        for (int64_t r = 0; r < rows; ++r) {
          float* out = c + (m + r) * ldc + n0;
          __m512 v = _mm512_loadu_ps(tmp[h] + r * 16);
          if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, out));
          _mm512_mask_storeu_ps(out, live, v);
        }
      }
    }
  }
  _tile_release();
#endif
}

// out[j] = bf16(x[j] * f) for j < n, 0 for n <= j < width (width % 16 == 0)
inline void to_bf16_row(const float* x, int64_t n, int64_t width, uint16_t* out, float f = 1.0f) {
  const __m512 by = _mm512_set1_ps(f);
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t live = std::max<int64_t>(0, std::min<int64_t>(16, n - j));
    const __mmask16 keep = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(
                                                                 _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, x + j), by)));
  }
}

struct Heads {                                      // one (row, kv head)'s tensors as rows
  int64_t B, H, KV, G, S, D;
  const uint16_t* q(const at::Tensor& t, int64_t b, int64_t hq) const {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()) + ((b * H + hq) * S) * D;
  }
  const uint16_t* kv(const at::Tensor& t, int64_t b, int64_t h) const {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()) + ((b * KV + h) * S) * D;
  }
};

Heads heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* name) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && q.dim() == 4 && k.dim() == 4 &&
              k.sizes() == v.sizes(), name, ": bf16 q [B, H, S, D], k and v [B, KV, S, D]");
  Heads x{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), q.size(3)};
  TORCH_CHECK(k.size(0) == x.B && k.size(2) == x.S && k.size(3) == x.D && x.H % x.KV == 0 &&
              x.D % 32 == 0, name, ": shapes that do not fit");
  return x;
}

// The G heads' rows of positions [r0, r0 + n) of t [B, H, S, D] as one block [G n, D].
void gather_block(const Heads& x, const at::Tensor& t, int64_t b, int64_t h, int64_t r0,
                  int64_t n, uint16_t* out) {
  for (int64_t g = 0; g < x.G; ++g)
    std::memcpy(out + g * n * x.D, x.q(t, b, h * x.G + g) + r0 * x.D, n * x.D * 2);
}

}  // namespace

// The query positions [first, end) of each row b attention must compute (`spans` [B, 2]
// int64: a packed prefix tree's path, whose other positions another path computes, and whose
// padding nobody reads), or all of them. The query blocks from the one holding `first` run
// (so dk and dv sum the blocks' products as the whole computation does: the same bits when
// the other positions' gradient is 0); the positions before that block and from `end` on get
// 0 as output, log-sum-exp and dq.
at::Tensor query_spans(const c10::optional<at::Tensor>& spans, int64_t B, int64_t S,
                       const char* name) {
  if (!spans.has_value() || !spans->defined()) {
    auto all = at::empty({B, 2}, at::kLong);
    all.select(1, 0).fill_(0);
    all.select(1, 1).fill_(S);
    return all;
  }
  TORCH_CHECK(spans->dim() == 2 && spans->size(0) == B && spans->size(1) == 2, name,
              ": spans [B, 2]");
  auto c = spans->to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= p[2 * b] && p[2 * b] <= p[2 * b + 1] && p[2 * b + 1] <= S, name,
                ": a span within [0, S]");
  return c;
}

std::vector<at::Tensor> attention_train(const at::Tensor& q_, const at::Tensor& k_,
                                        const at::Tensor& v_, double scale,
                                        const c10::optional<at::Tensor>& spans_) {
  RECORD_FUNCTION("apprentice::attention_train", std::vector<c10::IValue>({q_, k_}));
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const Heads x = heads(q, k, v, "attention_train");
  const int64_t S = x.S, D = x.D, Sp = up(S, 32);
  const bool partial = spans_.has_value() && spans_->defined();
  const at::Tensor spans = query_spans(spans_, x.B, S, "attention_train");
  const int64_t* span = spans.data_ptr<int64_t>();
  auto out = partial ? at::zeros({x.B, x.H, S, D}, q.options())
                     : at::empty({x.B, x.H, S, D}, q.options());
  auto lse = partial ? at::zeros({x.B, x.H, S}, q.options().dtype(at::kFloat))
                     : at::empty({x.B, x.H, S}, q.options().dtype(at::kFloat));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, x.B * x.KV, 1, [&](int64_t begin, int64_t end) {
    const int64_t M = x.G * kQBlock;
    std::vector<uint16_t> kt(D * Sp), vp(Sp * D), a(M * D), p(M * Sp);
    std::vector<float> s(M * Sp), o(M * D);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / x.KV, h = job % x.KV;
      const int64_t end = span[2 * b + 1];
      pack_cols(x.kv(k, b, h), end, D, D, Sp, kt.data());  // k^T: [D, S] by pairs of D
      pack_rows(x.kv(v, b, h), end, D, D, Sp, D, vp.data());  // v: [S, D] by pairs of positions
      for (int64_t r0 = span[2 * b] / kQBlock * kQBlock; r0 < end; r0 += kQBlock) {
        const int64_t n = std::min(kQBlock, end - r0), L = r0 + n, Lp = up(L, 32), rows = x.G * n;
        gather_block(x, q, b, h, r0, n, a.data());
        tile_mm(rows, a.data(), D, kt.data(), Sp, L, D, s.data(), Lp, false);  // [rows, L]
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t g = m / n, t = r0 + m % n;
          float* sr = s.data() + m * Lp;
          const float mx = scale_visible(sr, L, t + 1, nullptr, sc);
          const float total = exp_lanes(sr, L, mx);
          lp[(b * x.H + h * x.G + g) * S + t] = mx + std::log(total);
          to_bf16_row(sr, L, Lp, p.data() + m * Lp, 1.0f / total);
        }
        tile_mm(rows, p.data(), Lp, vp.data(), D, D, Lp, o.data(), D, false);  // [rows, D]
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t g = m / n, t = r0 + m % n;
          to_bf16_row(o.data() + m * D, D, D, op + ((b * x.H + h * x.G + g) * S + t) * D);
        }
      }
    }
  });
  return {out, lse};
}

std::vector<at::Tensor> attention_train_backward(const at::Tensor& dout_, const at::Tensor& q_,
                                                 const at::Tensor& k_, const at::Tensor& v_,
                                                 const at::Tensor& out_, const at::Tensor& lse_,
                                                 double scale,
                                                 const c10::optional<at::Tensor>& spans_) {
  RECORD_FUNCTION("apprentice::attention_train_backward", std::vector<c10::IValue>({q_, k_}));
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor dout = dout_.to(at::kBFloat16).contiguous(), out = out_.contiguous();
  const at::Tensor lse = lse_.contiguous();
  const Heads x = heads(q, k, v, "attention_train_backward");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "attention_train_backward: dout and out shaped as q");
  const int64_t S = x.S, D = x.D, Sp = up(S, 32);
  const bool partial = spans_.has_value() && spans_->defined();
  const at::Tensor spans = query_spans(spans_, x.B, S, "attention_train_backward");
  const int64_t* span = spans.data_ptr<int64_t>();
  auto dq = partial ? at::zeros_like(q) : at::empty_like(q);
  auto dk = at::empty_like(k), dv = at::empty_like(v);
  const float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto rows_of = [](at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  uint16_t *dqp = rows_of(dq), *dkp = rows_of(dk), *dvp = rows_of(dv);
  at::parallel_for(0, x.B * x.KV, 1, [&](int64_t begin, int64_t end) {
    const int64_t M = x.G * kQBlock, Mp = up(M, 32);
    std::vector<uint16_t> kt(D * Sp), kn(Sp * D), vt(D * Sp), a(M * D), da(M * D), p(M * Sp),
        ds(M * Sp), at_(D * Mp), dat(D * Mp), pp(Mp * Sp);
    std::vector<float> s(M * Sp), dp(M * Sp), di(M), dqa(M * D), dkt(D * Sp), dvt(D * Sp);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / x.KV, h = job % x.KV, end = span[2 * b + 1];
      pack_cols(x.kv(k, b, h), end, D, D, Sp, kt.data());  // k^T by pairs of D (scores)
      pack_rows(x.kv(k, b, h), end, D, D, Sp, D, kn.data());  // k by pairs of positions (dq)
      pack_cols(x.kv(v, b, h), end, D, D, Sp, vt.data());  // v^T by pairs of D (dp)
      std::fill(dkt.begin(), dkt.end(), 0.0f);
      std::fill(dvt.begin(), dvt.end(), 0.0f);
      for (int64_t r0 = span[2 * b] / kQBlock * kQBlock; r0 < end; r0 += kQBlock) {
        const int64_t n = std::min(kQBlock, end - r0), L = r0 + n, Lp = up(L, 32), rows = x.G * n;
        const int64_t rp = up(rows, 32);
        gather_block(x, q, b, h, r0, n, a.data());
        gather_block(x, dout, b, h, r0, n, da.data());
        for (int64_t m = 0; m < rows; ++m) {           // D_i = dout_i . out_i
          const uint16_t* o = x.q(out, b, h * x.G + m / n) + (r0 + m % n) * D;
          const uint16_t* d = da.data() + m * D;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < D; j += 16)
            acc = _mm512_fmadd_ps(load_bf16(o + j), load_bf16(d + j), acc);
          di[m] = _mm512_reduce_add_ps(acc);
        }
        tile_mm(rows, a.data(), D, kt.data(), Sp, L, D, s.data(), Lp, false);     // scores
        tile_mm(rows, da.data(), D, vt.data(), Sp, L, D, dp.data(), Lp, false);   // dout v^T
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t g = m / n, t = r0 + m % n;
          float* sr = s.data() + m * Lp;
          float* dr = dp.data() + m * Lp;
          const __m512 l = _mm512_set1_ps(lp[(b * x.H + h * x.G + g) * S + t]);
          const __m512 scv = _mm512_set1_ps(sc), dim = _mm512_set1_ps(di[m]);
          uint16_t* pb = p.data() + m * Lp;
          uint16_t* db = ds.data() + m * Lp;
          for (int64_t j = 0; j < Lp; j += 16) {         // p = exp(s sc - lse); ds = p (dp - D_i) sc
            const int64_t live = std::max<int64_t>(0, std::min<int64_t>(16, t + 1 - j));
            const __mmask16 keep = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
            const __m512 pr = _mm512_maskz_mov_ps(keep, exp_ps(_mm512_sub_ps(
                                  _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, sr + j), scv), l)));
            const __m512 dv = _mm512_mul_ps(_mm512_mul_ps(pr, _mm512_sub_ps(
                                  _mm512_maskz_loadu_ps(keep, dr + j), dim)), scv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)_mm512_cvtneps_pbh(pr));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(db + j), (__m256i)_mm512_cvtneps_pbh(dv));
          }
        }
        // dq = ds k (rows x D), written to the G heads' rows
        tile_mm(rows, ds.data(), Lp, kn.data(), D, D, Lp, dqa.data(), D, false);
        for (int64_t m = 0; m < rows; ++m)
          to_bf16_row(dqa.data() + m * D, D, D,
                      dqp + ((b * x.H + h * x.G + m / n) * S + r0 + m % n) * D);
        // dv^T += dout^T p and dk^T += q^T ds: [D, L], over the block's rows
        for (int64_t d = 0; d < D; ++d)                      // dout^T, q^T as [D, rows]
          for (int64_t m = 0; m < rp; ++m) {
            dat[d * rp + m] = m < rows ? da[m * D + d] : 0;
            at_[d * rp + m] = m < rows ? a[m * D + d] : 0;
          }
        pack_rows(p.data(), rows, Lp, Lp, rp, Lp, pp.data());
        tile_mm(D, dat.data(), rp, pp.data(), Lp, L, rp, dvt.data(), Sp, true);
        pack_rows(ds.data(), rows, Lp, Lp, rp, Lp, pp.data());
        tile_mm(D, at_.data(), rp, pp.data(), Lp, L, rp, dkt.data(), Sp, true);
      }
      uint16_t* dko = dkp + ((b * x.KV + h) * S) * D;
      uint16_t* dvo = dvp + ((b * x.KV + h) * S) * D;
      for (int64_t t = 0; t < S; ++t)
        for (int64_t d = 0; d < D; ++d) {
          dko[t * D + d] = at::BFloat16(dkt[d * Sp + t]).x;
          dvo[t * D + d] = at::BFloat16(dvt[d * Sp + t]).x;
        }
    }
  });
  return {dq, dk, dv};
}
#else
std::vector<at::Tensor> attention_train(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        double, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "attention_train: built without AMX or AVX512-BF16");
}
std::vector<at::Tensor> attention_train_backward(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, double,
                                                 const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "attention_train_backward: built without AMX or AVX512-BF16");
}
#endif

// ---- training: the loss's token log-probabilities, the rotary embedding's and RMSNorm's backward
namespace {
// out[i] = exp(z[i] - shift) for i < n (every z[i] <= shift), returns their sum. A training
// loss's sum: its lanes are added in any order (no decode step compares with these bits).
inline float exp_shifted(const float* z, int64_t n, float shift, float* out) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 sh = _mm512_set1_ps(shift);
  for (; i < n; i += kLanes) {
    const __mmask16 m = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, z + i), sh));
    if (out) _mm512_mask_storeu_ps(out + i, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#else
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(z + i), sh));
    if (out) _mm256_storeu_ps(out + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float l : lanes) total += l;
#endif
  for (; i < n; ++i) {
    const float e = exp_one(z[i] - shift);
    if (out) out[i] = e;
    total += e;
  }
#endif
  return total;
}

// row x [V] (bf16 or fp32) divided by t, in fp32
template <class T>
inline void scaled_row(const T* x, int64_t V, float t, float* z) {
  for (int64_t v = 0; v < V; ++v) z[v] = static_cast<float>(x[v]) / t;
}
}  // namespace

// log p(target[n]) under softmax(logits[n] / temps[n]) for each row n, in fp32, and the rows'
// log-sum-exp of logits / temps (what the backward needs): logits [N, V] bf16 or fp32. One
// pass over each row instead of PyTorch's float copy, division, log_softmax and gather, each a
// pass over [N, V] in fp32 (in a GRPO training step of the default model, ~1,100 scored tokens
// a micro-batch: 36 MB each).
std::vector<at::Tensor> token_logprobs(const at::Tensor& logits_, const at::Tensor& target_,
                                       const at::Tensor& temps_) {
  RECORD_FUNCTION("apprentice::token_logprobs", std::vector<c10::IValue>({logits_}));
  TORCH_CHECK(logits_.dim() == 2 && (logits_.scalar_type() == at::kBFloat16 ||
                                     logits_.scalar_type() == at::kFloat),
              "token_logprobs: logits [N, V], bf16 or fp32");
  const int64_t N = logits_.size(0), V = logits_.size(1);
  TORCH_CHECK(target_.numel() == N && temps_.numel() == N,
              "token_logprobs: one target and one temperature per row");
  const at::Tensor logits = logits_.contiguous(), target = target_.to(at::kLong).contiguous();
  const at::Tensor temps = temps_.to(at::kFloat).contiguous();
  auto lp = at::empty({N}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({N}, logits.options().dtype(at::kFloat));
  const int64_t* tp = target.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(tp[n] >= 0 && tp[n] < V, "token_logprobs: target id out of range");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "token_logprobs", [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    const float* tt = temps.data_ptr<float>();
    float* lpp = lp.data_ptr<float>();
    float* lsp = lse.data_ptr<float>();
    at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 15) / V), [&](int64_t b, int64_t e) {
      std::vector<float> z(V);
      for (int64_t n = b; n < e; ++n) {
        scaled_row(xp + n * V, V, tt[n], z.data());
        const float mx = *std::max_element(z.begin(), z.end());
        lsp[n] = mx + std::log(exp_shifted(z.data(), V, mx, nullptr));
        lpp[n] = z[tp[n]] - lsp[n];
      }
    });
  });
  return {lp, lse};
}

// The gradient of `token_logprobs`' logits: grad[n] * (onehot(target[n]) - softmax(logits[n] /
// temps[n])) / temps[n], in the logits' dtype (rounded once from fp32)
at::Tensor token_logprobs_backward(const at::Tensor& grad_, const at::Tensor& logits_,
                                   const at::Tensor& target_, const at::Tensor& temps_,
                                   const at::Tensor& lse_) {
  RECORD_FUNCTION("apprentice::token_logprobs_backward", std::vector<c10::IValue>({logits_}));
  const int64_t N = logits_.size(0), V = logits_.size(1);
  const at::Tensor logits = logits_.contiguous(), target = target_.to(at::kLong).contiguous();
  const at::Tensor temps = temps_.to(at::kFloat).contiguous(), lse = lse_.contiguous();
  const at::Tensor grad = grad_.to(at::kFloat).contiguous();
  TORCH_CHECK(grad.numel() == N && lse.numel() == N && target.numel() == N &&
              temps.numel() == N, "token_logprobs_backward: one value per row");
  auto out = at::empty({N, V}, logits.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "token_logprobs_bwd", [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float *tt = temps.data_ptr<float>(), *gp = grad.data_ptr<float>();
    const float* lsp = lse.data_ptr<float>();
    const int64_t* tp = target.data_ptr<int64_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 15) / V), [&](int64_t b, int64_t e) {
      std::vector<float> z(V);
      for (int64_t n = b; n < e; ++n) {
        scaled_row(xp + n * V, V, tt[n], z.data());
        exp_shifted(z.data(), V, lsp[n], z.data());           // z = softmax
        const float g = gp[n] / tt[n];
        z[tp[n]] -= 1.0f;
        scalar_t* o = op + n * V;
        int64_t v = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          const __m512 gv = _mm512_set1_ps(-g);
          for (; v + kLanes <= V; v += kLanes)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + v),
                                bf16_round(_mm512_mul_ps(_mm512_loadu_ps(z.data() + v), gv)));
        }
#endif
        for (; v < V; ++v) o[v] = static_cast<scalar_t>(-g * z[v]);
      }
    });
  });
  return out;
}

// The gradient of `rope_rows`' x from grad [B, N, T, D] of its output and the same cos and sin:
// d x [B, T, N, D] as autograd computes it for `qk * cos + rotate_half(qk) * sin` in bf16 (on
// qk = x transposed): grad * cos and grad * sin each rounded to bf16, rotate_half's transpose
// of the second (halves swapped, the first half negated), and the two summed and rounded once,
// so a training step gets the bits of the Python path's backward.
at::Tensor rope_rows_backward(const at::Tensor& grad, const at::Tensor& cos,
                              const at::Tensor& sin) {
  RECORD_FUNCTION("apprentice::rope_rows_backward", std::vector<c10::IValue>({grad}));
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && grad.dim() == 4,
              "rope_rows_backward: grad [B, N, T, D], cos and sin [B, T, D], bf16");
  const int64_t B = grad.size(0), N = grad.size(1), T = grad.size(2), D = grad.size(3);
  const auto gc = grad.contiguous();
  auto out = at::empty({B, T, N, D}, grad.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  rope_positions("rope_rows_backward", B, T, N, D, cos, sin,
                 [&](int64_t bt, const uint16_t* c, const uint16_t* s) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t n = 0; n < N; ++n)
      rope_row_backward(gp + ((b * N + n) * T + t) * D, c, s, D, op + (bt * N + n) * D);
  });
  return out;
}

// The gradients of `rms_norm_rows`' x and weight from grad (x's shape) of its output: what
// autograd computes for `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(bf16)`, in
// fp32 with one rounding at the end (not its bits: autograd rounds grad * weight and each
// grad * normalized product to bf16 before summing). The weight's gradient sums fixed blocks
// of rows in a fixed order, so it does not depend on the thread count. Returns (d x bf16,
// d weight [W, H] fp32).
std::vector<at::Tensor> rms_norm_rows_backward(const at::Tensor& grad, const at::Tensor& x,
                                               const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("apprentice::rms_norm_rows_backward", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              grad.sizes() == x.sizes(), "rms_norm_rows_backward: bf16 x and weight, grad of x's shape");
  const int64_t H = x.size(-1), N = x.numel() / std::max<int64_t>(H, 1);
  const int64_t W = weight.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(weight.size(-1) == H && W >= 1 && W * H == weight.numel(),
              "rms_norm_rows_backward: weight [W, H]");
  const auto xc = x.contiguous(), wc = weight.contiguous(), gc = grad.to(at::kBFloat16).contiguous();
  auto dx = at::empty_like(xc);
  constexpr int64_t kBlockRows = 256;
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  std::vector<float> partial(blocks * W * H, 0.0f);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  const auto* gp = reinterpret_cast<const uint16_t*>(gc.data_ptr<at::BFloat16>());
  auto* op = dx.data_ptr<at::BFloat16>();
  const float e = static_cast<float>(eps), inv_h = 1.0f / static_cast<float>(H);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> gn(H);
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* gw = partial.data() + blk * W * H;
      for (int64_t i = blk * kBlockRows; i < std::min(N, (blk + 1) * kBlockRows); ++i) {
        const uint16_t *xi = xp + i * H, *gi = gp + i * H, *wi = wp + (i % W) * H;
        float* gwr = gw + (i % W) * H;
#if defined(__AVX512F__)
        if (H % kLanes == 0) {            // the loops below 16 lanes at a time
          __m512 sv = _mm512_setzero_ps(), dv = _mm512_setzero_ps();
          for (int64_t c = 0; c < H; c += kLanes) {
            const __m512 xf = load_bf16(xi + c);
            sv = _mm512_fmadd_ps(xf, xf, sv);
          }
          const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(sv) * inv_h + e);
          const __m512 rv = _mm512_set1_ps(r);
          for (int64_t c = 0; c < H; c += kLanes) {
            const __m512 xf = load_bf16(xi + c), g = load_bf16(gi + c);
            const __m512 n = bf16_rounded(_mm512_mul_ps(xf, rv));
            _mm512_storeu_ps(gwr + c, _mm512_fmadd_ps(g, n, _mm512_loadu_ps(gwr + c)));
            const __m512 gnv = bf16_rounded(_mm512_mul_ps(g, load_bf16(wi + c)));
            _mm512_storeu_ps(gn.data() + c, gnv);
            dv = _mm512_fmadd_ps(gnv, xf, dv);
          }
          const __m512 kv = _mm512_set1_ps(r * r * r * _mm512_reduce_add_ps(dv) * inv_h);
          for (int64_t c = 0; c < H; c += kLanes) {       // gn * r - x * k
            const __m512 d = _mm512_fnmadd_ps(load_bf16(xi + c), kv,
                                              _mm512_mul_ps(_mm512_loadu_ps(gn.data() + c), rv));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + i * H + c), bf16_round(d));
          }
          continue;
        }
#endif
        float ss = 0.0f;
        for (int64_t c = 0; c < H; ++c) ss += bf16_to_float(xi[c]) * bf16_to_float(xi[c]);
        const float r = 1.0f / std::sqrt(ss * inv_h + e);
        float dot = 0.0f;
        for (int64_t c = 0; c < H; ++c) {
          const float xf = bf16_to_float(xi[c]), g = bf16_to_float(gi[c]);
          const float n = static_cast<float>(at::BFloat16(xf * r));
          gwr[c] += g * n;
          gn[c] = static_cast<float>(at::BFloat16(g * bf16_to_float(wi[c])));
          dot += gn[c] * xf;
        }
        const float k = r * r * r * dot * inv_h;
        for (int64_t c = 0; c < H; ++c)
          op[i * H + c] = at::BFloat16(gn[c] * r - bf16_to_float(xi[c]) * k);
      }
    }
  });
  auto dw = at::zeros({W, H}, x.options().dtype(at::kFloat));
  float* dwp = dw.data_ptr<float>();
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t j = 0; j < W * H; ++j) dwp[j] += partial[blk * W * H + j];
  return {dx, dw};
}

bool has_train_attention() {
#if defined(APPRENTICE_TRAIN_ATTENTION)
  return true;
#else
  return false;
#endif
}

bool has_amx() {
#if defined(APPRENTICE_AMX)
  return amx_ready();
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "one decode step of MoEModel");
  m.def("rows_linear", &rows_linear, "x @ w.T (+ b) for at most 8 rows of bf16");
  m.def("softmax_total", &softmax_total, "attention's softmax sum of one row of scores",
        py::arg("scores"), py::arg("mask") = py::none(), py::arg("last") = -1);
  m.def("packs", &packs, "whether weights of this width are packed (AVX512-BF16, no AMX)");
  m.def("pack_weight", &pack_weight, "bf16 weight rows in packed_linear's layout");
  m.def("packed_linear", &packed_linear, "x @ w.T (+ b), w packed: rows_linear's bits, any rows",
        py::arg("x"), py::arg("wp"), py::arg("n"), py::arg("b") = py::none());
  m.def("moe_rows", &moe_rows, "the routed experts of at most 8 rows of bf16");
  m.def("moe_rows_i8", &moe_rows_i8, "the routed experts of at most 8 rows, int8 copies");
  m.def("int8_rows", &int8_rows, "x @ (q * scale).T (+ b) for at most 8 rows of bf16, q int8");
  m.def("decode_attention", &decode_attention, "one new token's attention per row, bf16",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
        py::arg("shared") = 0, py::arg("from") = py::none());
  m.def("attention_rows", &attention_rows, "bf16 attention without autograd, row by row");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of bf16 rows without autograd");
  m.def("rope_rows", &rope_rows, "rotary embedding of bf16 q and k without autograd");
  m.def("attention_train", &attention_train,
        "causal bf16 attention and its log-sum-exp (AMX tiles, else AVX512-BF16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("spans") = py::none());
  m.def("attention_train_backward", &attention_train_backward, "its backward: dq, dk, dv",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("scale"), py::arg("spans") = py::none());
  m.def("sample_rows", &sample_rows, "next token and its logprob per row (greedy or sampled)",
        py::arg("logits"), py::arg("temperature"), py::arg("u") = py::none());
  m.def("rms_norm_rows_backward", &rms_norm_rows_backward,
        "rms_norm_rows' backward: d x (bf16) and d weight (fp32)");
  m.def("rope_rows_backward", &rope_rows_backward, "rope_rows' backward: d x from d out");
  m.def("token_logprobs", &token_logprobs,
        "log p(target) of each row of logits / temps, and each row's log-sum-exp");
  m.def("token_logprobs_backward", &token_logprobs_backward, "token_logprobs' d logits");
  m.def("has_amx", &has_amx, "whether AMX tiles serve (built with them, granted by Linux)");
  m.def("has_train_attention", &has_train_attention,
        "whether attention_train serves (AMX tiles or AVX512-BF16)");
}
