// Attention on the CPU for decode steps and prompts: each query row against the cached keys/values of its row's
// slot, for XLA:CPU, which runs it as single-threaded batched reductions far below the memory bandwidth
// (benchmarks/README.md). A prompt's consecutive query rows of one slot are computed together: each key and value
// vector is read once for all of them and all the kv head's query heads, so that a prompt's attention runs on the
// FMA units instead of waiting on the cache (one query at a time read every key once per query). Each query's
// arithmetic is the same in whatever group it is computed, so its result does not depend on what shares its call.
// An XLA FFI handler (`ffi.h`); `decode_attention.py` calls it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "ffi.h"
#include "vec.h"

namespace {

constexpr int64_t kMinShared = 1024;  // (row, kv head) pairs x cache length below which one thread does it all

struct Shape {
  int64_t rows, slots, kv, groups, dim, length;
};

// The cache's element types: float32, float16 or bfloat16 (their bits), each read as floats.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(Half x) { return jaxllama::HalfToFloat(x.bits); }
inline float ToFloat(BFloat16 x) {
  const uint32_t bits = uint32_t{x.bits} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

using jaxllama::kRegLanes;
using jaxllama::Reg;

// Query vectors whose sums are kept in registers together (2 vectors of kRegLanes positions or dims each, plus the
// key or value vectors and a broadcast): a prompt's rows x a kv head's query heads. AVX-512: 24 of 32 registers;
// AVX: 12 of 16.
#if defined(JAXLLAMA_WIDE)
constexpr int kQueriesAtOnce = 12;
#else
constexpr int kQueriesAtOnce = 6;
#endif

// kRegLanes of the cache's elements from p, as floats.
inline Reg LoadReg(const float* p) {
  Reg v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Reg LoadReg(const Half* p) {  // a Half is its 16 bits: vec.h's loader widens them
  static_assert(sizeof(Half) == sizeof(uint16_t));
  return jaxllama::LoadHalves(reinterpret_cast<const uint16_t*>(p));
}

inline Reg LoadReg(const BFloat16* p) {  // a bfloat16 is a float32's high half
  typedef uint16_t Halves __attribute__((vector_size(sizeof(Reg) / 2)));
  typedef uint32_t Bits __attribute__((vector_size(sizeof(Reg))));
  Halves h;
  std::memcpy(&h, p, sizeof(h));
  const Bits bits = __builtin_convertvector(h, Bits) << 16;
  Reg v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// scores[j, t0..t0 + kV x kRegLanes) = q[j] . keys[:, t0..] x scale for kG query vectors: each key vector is read
// once for all of them, and the sums stay in registers. Keys are [dim, length]: a block reads up to 128 bytes of
// each dim's row, and fetches the next block's ahead (many rows far apart defeat the hardware's prefetch).
template <int kG, int kV, typename C>
void ScoreBlock(const float* q, const C* keys, int64_t hd, int64_t n, int64_t t0, float scale, float* scores) {
  Reg acc[kG][kV] = {};
  for (int64_t d = 0; d < hd; ++d) {
    const C* k = keys + d * n + t0;
    __builtin_prefetch(k + kV * kRegLanes);
    Reg key[kV];
    for (int h = 0; h < kV; ++h) key[h] = LoadReg(k + h * kRegLanes);
    for (int j = 0; j < kG; ++j) {
      const Reg w = jaxllama::Splat<Reg>(q[j * hd + d]);
      for (int h = 0; h < kV; ++h) acc[j][h] = jaxllama::Fma(w, key[h], acc[j][h]);
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h) {
      const Reg s = acc[j][h] * scale;
      std::memcpy(scores + j * n + t0 + h * kRegLanes, &s, sizeof(Reg));
    }
}

// out[j, e0..e0 + kV x kRegLanes) = sum over t < visible of p[j, t] x values[t, e0..] for kG query vectors.
template <int kG, int kV, typename C>
void WeighBlock(const float* p, const C* values, int64_t hd, int64_t n, int64_t visible, int64_t e0, float* out) {
  Reg acc[kG][kV] = {};
  for (int64_t t = 0; t < visible; ++t) {
    __builtin_prefetch(values + (t + 4) * hd + e0);
    Reg value[kV];
    for (int h = 0; h < kV; ++h) value[h] = LoadReg(values + t * hd + e0 + h * kRegLanes);
    for (int j = 0; j < kG; ++j) {
      const Reg w = jaxllama::Splat<Reg>(p[j * n + t]);
      for (int h = 0; h < kV; ++h) acc[j][h] = jaxllama::Fma(w, value[h], acc[j][h]);
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h) std::memcpy(out + j * hd + e0 + h * kRegLanes, &acc[j][h], sizeof(Reg));
}

// kG query vectors' scores (`scoring`: positions [0, visible), 2 or 1 x kRegLanes at a time where the cache's length
// allows, the rest one by one) or weighted values (2 or 1 x kRegLanes dims at a time, the rest one by one). The rest
// are summed by explicit FMAs: a contraction left to the compiler may differ between kG's, and a query's result
// would then depend on what shares its call.
template <int kG, typename C>
void Heads(const float* q, const C* keys, const C* values, int64_t visible, int64_t hd, int64_t n,
           float scale, float* out, float* scores, bool scoring) {
  if (scoring) {
    int64_t t0 = 0;
    for (; t0 < visible && t0 + 2 * kRegLanes <= n; t0 += 2 * kRegLanes)
      ScoreBlock<kG, 2, C>(q, keys, hd, n, t0, scale, scores);
    for (; t0 < visible && t0 + kRegLanes <= n; t0 += kRegLanes)
      ScoreBlock<kG, 1, C>(q, keys, hd, n, t0, scale, scores);
    for (int64_t t = t0; t < visible; ++t) {
      for (int j = 0; j < kG; ++j) {
        float sum = 0.0f;
        for (int64_t d = 0; d < hd; ++d) sum = std::fma(q[j * hd + d], ToFloat(keys[d * n + t]), sum);
        scores[j * n + t] = sum * scale;
      }
    }
  } else {
    int64_t e0 = 0;
    for (; e0 + 2 * kRegLanes <= hd; e0 += 2 * kRegLanes) WeighBlock<kG, 2, C>(scores, values, hd, n, visible, e0, out);
    for (; e0 + kRegLanes <= hd; e0 += kRegLanes) WeighBlock<kG, 1, C>(scores, values, hd, n, visible, e0, out);
    for (int64_t e = e0; e < hd; ++e) {
      for (int j = 0; j < kG; ++j) {
        float sum = 0.0f;
        for (int64_t t = 0; t < visible; ++t) sum = std::fma(scores[j * n + t], ToFloat(values[t * hd + e]), sum);
        out[j * hd + e] = sum;
      }
    }
  }
}

// The query vectors q [m, dim] kQueriesAtOnce at a time: scores (`scoring`, positions [0, visible)) or the weighted
// values.
template <typename C, size_t... G>
void Groups(const float* q, const C* keys, const C* values, int64_t visible, int64_t m, int64_t hd, int64_t n,
            float scale, float* out, float* scores, bool scoring, std::index_sequence<G...>) {
  using Fn = void (*)(const float*, const C*, const C*, int64_t, int64_t, int64_t, float, float*, float*, bool);
  static constexpr Fn kHeads[] = {Heads<G + 1, C>...};
  for (int64_t j = 0; j < m; j += kQueriesAtOnce)
    kHeads[std::min<int64_t>(kQueriesAtOnce, m - j) - 1](q + j * hd, keys, values, visible, hd, n, scale,
                                                          out + j * hd, scores + j * n, scoring);
}

// The largest of scores[0, n), n >= 1, kRegLanes at a time (a loop of std::max waits on each comparison in turn).
inline float Max(const float* scores, int64_t n) {
  Reg tops = jaxllama::Splat<Reg>(scores[0]);
  int64_t t = 0;
  for (; t + kRegLanes <= n; t += kRegLanes) {
    const Reg v = LoadReg(scores + t);
    tops = v > tops ? v : tops;
  }
  float top = scores[0];
  for (int i = 0; i < kRegLanes; ++i) top = std::max(top, tops[i]);
  for (; t < n; ++t) top = std::max(top, scores[t]);
  return top;
}

// scores[0, seen) as e^(score - top) <= 1, kRegLanes at a time by `vec.h`'s Exp, the last of them padded with
// -inf (whose e^ is 0): every position's weight from the same arithmetic. Returns 1 / their total.
inline float Exps(float* sc, int64_t seen) {
  const float top = Max(sc, seen);
  Reg sums = {};
  int64_t t = 0;
  for (; t + kRegLanes <= seen; t += kRegLanes) {
    const Reg e = jaxllama::Exp(LoadReg(sc + t) - top);
    std::memcpy(sc + t, &e, sizeof(e));
    sums += e;
  }
  if (t < seen) {
    float rest[kRegLanes];
    std::fill(rest + (seen - t), rest + kRegLanes, -std::numeric_limits<float>::infinity());
    std::copy_n(sc + t, seen - t, rest);
    const Reg e = jaxllama::Exp(LoadReg(rest) - top);
    std::memcpy(rest, &e, sizeof(e));
    std::copy_n(rest, seen - t, sc + t);
    sums += e;
  }
  float total = 0.0f;
  for (int i = 0; i < kRegLanes; ++i) total += sums[i];
  return 1.0f / total;
}

// scores[0, seen) as softmax weights, zeros in [seen, until).
inline void Softmax(float* sc, int64_t seen, int64_t until) {
  const float inv = Exps(sc, seen);
  for (int64_t t = 0; t < seen; ++t) sc[t] *= inv;
  std::fill(sc + seen, sc + until, 0.0f);
}

#if defined(__AVX512BF16__)
// A bfloat16 cache on a CPU with AVX-512 BF16: q.k and p.v as vdpbf16ps products of bfloat16 pairs, summed in
// float32, at twice the rate of float32 FMAs. The queries and the softmax's weights are rounded to bfloat16 as the
// cache's keys and values already are; each 32-bit lane multiplies a pair of dims (scores) or of positions
// (weighted values) and adds both products to its sum. Every query, position and dim goes through the same
// instructions in the same order whatever its group, block or call, so a query's result depends on nothing else.
constexpr bool kPairDots = true;

// Interleaves two rows of 16-bit elements, a's and b's lane p becoming pair p: the low 16 pairs (kLow) or the high.
template <bool kLow>
inline __m512i Interleave(__m512i a, __m512i b) {
  alignas(64) static constexpr uint16_t kIndex[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  return _mm512_permutex2var_epi16(a, _mm512_load_si512(kIndex[kLow ? 0 : 1]), b);
}

// acc + the products of pairs' bfloat16 pairs and the pair at `broadcast`, both of each lane's. The sums are Regs,
// not __m512s: GCC keeps an array of those (which may alias anything) in memory, stored at every step.
inline Reg DotPairs(Reg acc, __m512i pairs, const uint32_t* broadcast) {
  return reinterpret_cast<Reg>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(pairs),
                                                reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(*broadcast)))));
}

// 16 x kV 16-bit elements from p (kV 1: in the low half), or the first of them that `read` names (kPart). Whole
// rows are plain loads: with masked ones in its loop, GCC stores every sum to the stack at each step.
template <int kV, bool kPart = false>
inline __m512i Load(const uint16_t* p, __mmask32 read = 0) {
  if constexpr (kPart) return _mm512_maskz_loadu_epi16(read, p);
  if constexpr (kV == 2) return _mm512_loadu_si512(p);
  return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// scores[j, t0..t0 + 16 x kV) = q[j] . keys[:, t0..] x scale for kG query vectors (bfloat16 pairs of dims, `qb`
// [kG, hd / 2]). `count` < 16 x kV: only the first `count` positions are read and written (the cache's end).
template <int kG, int kV, bool kPart = false>
void ScorePairs(const uint32_t* qb, const uint16_t* keys, int64_t hd, int64_t n, int64_t t0, int64_t count,
                float scale, float* scores) {
  static_assert(kV == 1 || !kPart);
  const __mmask32 read = kPart ? (__mmask32{1} << count) - 1 : ~__mmask32{0} >> (32 - 16 * kV);
  Reg acc[kG][kV] = {};
  for (int64_t i = 0; i < hd / 2; ++i) {
    const uint16_t* k = keys + 2 * i * n + t0;
    __builtin_prefetch(k + 2 * n + 32);
    __builtin_prefetch(k + 3 * n + 32);
    const __m512i a = Load<kV, kPart>(k, read), b = Load<kV, kPart>(k + n, read);
    __m512i pairs[kV];
    pairs[0] = Interleave<true>(a, b);
    if constexpr (kV == 2) pairs[1] = Interleave<false>(a, b);
    for (int j = 0; j < kG; ++j)
      for (int h = 0; h < kV; ++h) acc[j][h] = DotPairs(acc[j][h], pairs[h], qb + j * hd / 2 + i);
  }
  __mmask16 write[kV];
  for (int h = 0; h < kV; ++h) write[h] = static_cast<__mmask16>(read >> (16 * h));
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h)
      _mm512_mask_storeu_ps(scores + j * n + t0 + 16 * h, write[h], reinterpret_cast<__m512>(acc[j][h] * scale));
}

// out[j, e0..e0 + 16 x kV) = sum over t < 2 x pairs of p[j, t] x values[t, e0..] for kG query vectors (bfloat16
// pairs of positions, `pb` [kG, stride]); the last pair's second row is `odd`'s zeros when only its first is
// visible.
template <int kG, int kV>
void WeighPairs(const uint32_t* pb, int64_t stride, const uint16_t* values, int64_t hd, int64_t pairs, bool odd,
                int64_t e0, float* out) {
  Reg acc[kG][kV] = {};
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* v = values + 2 * i * hd + e0;
    __builtin_prefetch(v + 8 * hd);
    const bool last_alone = odd && i == pairs - 1;
    const __m512i a = Load<kV>(v), b = last_alone ? _mm512_setzero_si512() : Load<kV>(v + hd);
    __m512i both[kV];
    both[0] = Interleave<true>(a, b);
    if constexpr (kV == 2) both[1] = Interleave<false>(a, b);
    for (int j = 0; j < kG; ++j)
      for (int h = 0; h < kV; ++h) acc[j][h] = DotPairs(acc[j][h], both[h], pb + j * stride + i);
  }
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h) std::memcpy(out + j * hd + e0 + 16 * h, &acc[j][h], sizeof(Reg));
}

// `count` floats from `from`, times `times` and rounded to bfloat16 (to nearest, even), to `to`; the rest of
// `padded` zeros.
inline void ToPairs(const float* from, int64_t count, int64_t padded, uint16_t* to, float times = 1.0f) {
  const __m512 by = _mm512_set1_ps(times);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                                                 _mm512_mul_ps(_mm512_loadu_ps(from + i), by))));
  if (i < count) {
    const __mmask16 left = static_cast<__mmask16>((1u << (count - i)) - 1);
    _mm256_mask_storeu_epi16(to + i, left, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                               _mm512_mul_ps(_mm512_maskz_loadu_ps(left, from + i), by))));
  }
  std::memset(to + count, 0, (padded - count) * sizeof(uint16_t));  // bytes: `to` may be 32-bit words
}

template <int kG>
void HeadsPairs(const uint32_t* qb, const uint32_t* pb, int64_t stride, const uint16_t* keys, const uint16_t* values,
                int64_t visible, int64_t hd, int64_t n, float scale, float* out, float* scores, bool scoring) {
  if (scoring) {
    int64_t t0 = 0;
    for (; t0 < visible && t0 + 32 <= n; t0 += 32) ScorePairs<kG, 2>(qb, keys, hd, n, t0, 32, scale, scores);
    for (; t0 < visible && t0 + 16 <= n; t0 += 16) ScorePairs<kG, 1>(qb, keys, hd, n, t0, 16, scale, scores);
    if (t0 < visible) ScorePairs<kG, 1, true>(qb, keys, hd, n, t0, n - t0, scale, scores);
  } else {
    const int64_t pairs = (visible + 1) / 2;
    int64_t e0 = 0;
    for (; e0 + 32 <= hd; e0 += 32) WeighPairs<kG, 2>(pb, stride, values, hd, pairs, visible % 2, e0, out);
    for (; e0 < hd; e0 += 16) WeighPairs<kG, 1>(pb, stride, values, hd, pairs, visible % 2, e0, out);
  }
}

// Attend's work over a bfloat16 cache whose head dims are a multiple of 16, on vdpbf16ps (above).
void AttendPairs(const float* q, const uint16_t* keys, const uint16_t* values, const int64_t* visible, int64_t m,
                 int64_t hd, int64_t n, float* out, float* scores) {
  // Pairs of bfloat16, read as 32-bit words: stored as uint32_t and written through 16-bit pointers.
  thread_local std::vector<uint32_t> qb, pb;
  const int64_t most = *std::max_element(visible, visible + m), stride = (most + 1) / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  qb.resize(m * hd / 2);
  pb.resize(m * stride);
  auto* q16 = reinterpret_cast<uint16_t*>(qb.data());
  auto* p16 = reinterpret_cast<uint16_t*>(pb.data());
  for (int64_t j = 0; j < m; ++j) ToPairs(q + j * hd, hd, hd, q16 + j * hd);
  using Fn = void (*)(const uint32_t*, const uint32_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t,
                      int64_t, float, float*, float*, bool);
  static constexpr Fn kHeads[] = {HeadsPairs<1>, HeadsPairs<2>, HeadsPairs<3>, HeadsPairs<4>,
                                  HeadsPairs<5>, HeadsPairs<6>, HeadsPairs<7>, HeadsPairs<8>,
                                  HeadsPairs<9>, HeadsPairs<10>, HeadsPairs<11>, HeadsPairs<12>};
  static_assert(sizeof(kHeads) / sizeof(Fn) == kQueriesAtOnce);
  const uint32_t *q32 = qb.data(), *p32 = pb.data();
  for (int64_t j = 0; j < m; j += kQueriesAtOnce)
    kHeads[std::min<int64_t>(kQueriesAtOnce, m - j) - 1](q32 + j * hd / 2, p32 + j * stride, stride, keys, values,
                                                         most, hd, n, scale, out + j * hd, scores + j * n, true);
  for (int64_t j = 0; j < m; ++j) {
    float* sc = scores + j * n;
    ToPairs(sc, visible[j], 2 * stride, p16 + j * 2 * stride, Exps(sc, visible[j]));
  }
  for (int64_t j = 0; j < m; j += kQueriesAtOnce)
    kHeads[std::min<int64_t>(kQueriesAtOnce, m - j) - 1](q32 + j * hd / 2, p32 + j * stride, stride, keys, values,
                                                         most, hd, n, scale, out + j * hd, scores + j * n, false);
}
#else
constexpr bool kPairDots = false;
void AttendPairs(const float*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t, int64_t, float*,
                 float*) {}
#endif

// Whether AttendPairs computes a bfloat16 cache's heads of `hd` dims (16 dims to a vector of pairs), else float32.
inline bool PairDots(int64_t hd) { return kPairDots && hd % 16 == 0; }

// m query vectors of one slot and kv head: q [m, dim], query i seeing positions [0, visible[i]); keys [dim, length];
// values [length, dim]; out [m, dim]; scores [m, length] is scratch. Scores and weighted values run over the most
// positions any of them sees, `Groups` of them at a time, their sums in registers (`Heads`): each key and value
// vector is read once for the group, and no score or output is read and written back per dim or position. A query's
// weights past its own positions are 0, which leaves its sums as they were.
template <typename C>
void Attend(const float* q, const C* keys, const C* values, const int64_t* visible, int64_t m, const Shape& s,
            float* out, float* scores) {
  const int64_t hd = s.dim, n = s.length;
  if constexpr (std::is_same_v<C, BFloat16>) {
    if (PairDots(hd)) {
      static_assert(sizeof(BFloat16) == sizeof(uint16_t));
      AttendPairs(q, reinterpret_cast<const uint16_t*>(keys), reinterpret_cast<const uint16_t*>(values), visible, m,
                  hd, n, out, scores);
      return;
    }
  }
  const int64_t most = *std::max_element(visible, visible + m);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const auto groups = std::make_index_sequence<kQueriesAtOnce>{};
  Groups(q, keys, values, most, m, hd, n, scale, out, scores, true, groups);
  for (int64_t j = 0; j < m; ++j) Softmax(scores + j * n, visible[j], most);
  Groups(q, keys, values, most, m, hd, n, scale, out, scores, false, groups);
}

// The work in units of (a run of query rows, kv head): a run is up to `per_run` consecutive rows of one slot (a
// prompt's), or one row.
template <typename C>
struct Attention : jaxllama::Job {
  Attention(int64_t chunks, int64_t per_chunk) : Job(chunks), per_chunk(per_chunk) {}
  const float* q;
  const C *keys, *values;
  const int32_t *slot_of, *positions;  // per query row: its cache row, its position
  float* out;
  Shape s;
  std::vector<int64_t> runs;  // each run's first row, then the rows' count
  const int64_t per_chunk;

  void Run(int64_t c) override {
    thread_local std::vector<float> scores, queries, outs;
    thread_local std::vector<int64_t> visible;  // per query vector: a run's rows x query heads, or a row's heads
    const int64_t gd = s.groups * s.dim, units = (static_cast<int64_t>(runs.size()) - 1) * s.kv;
    for (int64_t i = c * per_chunk, end = std::min((c + 1) * per_chunk, units); i < end; ++i) {
      const int64_t r = i / s.kv, h = i % s.kv, b0 = runs[r], rows = runs[r + 1] - b0, m = rows * s.groups;
      const int64_t slot = slot_of[b0];
      visible.resize(m);  // a row of more query heads than kQueriesAtOnce runs alone: m may exceed it
      if (slot < 0 || slot >= s.slots || positions[b0] < 0) {  // a padding row
        float* o = out + (b0 * s.kv + h) * gd;
        std::fill(o, o + gd, 0.0f);
        continue;
      }
      const int64_t cell = (slot * s.kv + h) * s.dim * s.length;
      if (rows == 1) {  // a decode row: its query heads and result in place
        std::fill_n(visible.data(), s.groups, std::min<int64_t>(int64_t{positions[b0]} + 1, s.length));
        scores.resize(s.groups * s.length);
        Attend(q + (b0 * s.kv + h) * gd, keys + cell, values + cell, visible.data(), s.groups, s,
               out + (b0 * s.kv + h) * gd, scores.data());
        continue;
      }
      queries.resize(m * s.dim);
      outs.resize(m * s.dim);
      scores.resize(m * s.length);
      for (int64_t b = 0; b < rows; ++b) {
        std::copy_n(q + ((b0 + b) * s.kv + h) * gd, gd, queries.data() + b * gd);
        std::fill_n(visible.data() + b * s.groups, s.groups,
                    std::min<int64_t>(int64_t{positions[b0 + b]} + 1, s.length));
      }
      Attend(queries.data(), keys + cell, values + cell, visible.data(), m, s, outs.data(), scores.data());
      for (int64_t b = 0; b < rows; ++b) std::copy_n(outs.data() + b * gd, gd, out + ((b0 + b) * s.kv + h) * gd);
    }
  }
};

template <typename C>
XLA_FFI_Error* Run(XLA_FFI_CallFrame* frame, XLA_FFI_Buffer* const* in, XLA_FFI_Buffer* result, const Shape& s) {
  const auto* slot_of = static_cast<const int32_t*>(in[3]->data);
  const auto* positions = static_cast<const int32_t*>(in[4]->data);
  // Runs of consecutive rows of one slot at consecutive positions (a prompt's), as many as fill kQueriesAtOnce
  // query vectors; a row of more query heads than that runs alone.
  const int64_t per_run = std::max<int64_t>(1, kQueriesAtOnce / s.groups);
  std::vector<int64_t> runs;
  for (int64_t b = 0; b < s.rows; ++b) {
    const bool follows = !runs.empty() && b - runs.back() < per_run && slot_of[b] == slot_of[b - 1] &&
                         positions[b] == positions[b - 1] + 1 && slot_of[b] >= 0 && slot_of[b] < s.slots;
    if (!follows) runs.push_back(b);
  }
  runs.push_back(s.rows);
  const int64_t units = (static_cast<int64_t>(runs.size()) - 1) * s.kv, per_chunk = std::max<int64_t>(1, units / 32);
  Attention<C> job((units + per_chunk - 1) / per_chunk, per_chunk);
  job.runs = std::move(runs);
  job.q = static_cast<const float*>(in[0]->data);
  job.keys = static_cast<const C*>(in[1]->data);
  job.values = static_cast<const C*>(in[2]->data);
  job.slot_of = slot_of;
  job.positions = positions;
  job.out = static_cast<float*>(result->data);
  job.s = s;
  // Small calls run on this thread alone: handing work to the pool costs more than it saves.
  jaxllama::RunJob(frame, job, s.rows * s.kv * s.length >= kMinShared);
  return nullptr;
}

}  // namespace

// Whether a bfloat16 cache's q.k and p.v run as bfloat16 products (AttendPairs) in this build, for heads of
// `head_dim` dims.
extern "C" int JaxllamaAttendsInBfloat16(int64_t head_dim) { return PairDots(head_dim) ? 1 : 0; }

// Arguments: q [rows, kv, groups, dim] f32; keys [slots, kv, dim, length] and values [slots, kv, length, dim], both
// f32, f16 or bf16 (or u16: bf16's bits); slots [rows] s32 (the cache row of each query row; out of range: a padding
// row, whose output is zeros); positions [rows] s32 (the query's position: it sees positions 0..position). Result:
// [rows, kv, groups, dim] f32.
extern "C" XLA_FFI_Error* JaxllamaDecodeAttention(XLA_FFI_CallFrame* frame) {
  using jaxllama::Fail;
  const XLA_FFI_Api* api = frame->api;
  if (jaxllama::NotExecuting(frame)) return nullptr;
  if (frame->args.size != 5 || frame->rets.size != 1) return Fail(api, "decode_attention: 5 arguments, 1 result");
  XLA_FFI_Buffer* in[5];
  for (int i = 0; i < 5; ++i)
    if (!(in[i] = jaxllama::Arg(frame, i))) return Fail(api, "decode_attention: buffers expected");
  XLA_FFI_Buffer* result = jaxllama::Result(frame, 0);
  if (!result) return Fail(api, "decode_attention: a buffer result expected");
  const XLA_FFI_Buffer *q = in[0], *keys = in[1], *values = in[2], *slots = in[3], *positions = in[4];
  const XLA_FFI_Buffer* arrays[] = {q, keys, values, result};
  for (const XLA_FFI_Buffer* b : arrays)
    if (b->rank != 4) return Fail(api, "decode_attention: q, keys, values and the result [.,.,.,.]");
  const XLA_FFI_DataType cache = keys->dtype;
  if (q->dtype != XLA_FFI_DataType_F32 || result->dtype != XLA_FFI_DataType_F32 || values->dtype != cache ||
      !(cache == XLA_FFI_DataType_F32 || cache == XLA_FFI_DataType_F16 || cache == XLA_FFI_DataType_BF16 ||
        cache == XLA_FFI_DataType_U16))
    return Fail(api, "decode_attention: f32 q and result, keys and values both f32, f16, bf16 or u16 (bf16's bits)");
  if (slots->dtype != XLA_FFI_DataType_S32 || positions->dtype != XLA_FFI_DataType_S32 || slots->rank != 1 ||
      positions->rank != 1)
    return Fail(api, "decode_attention: s32 [rows] slots and positions");
  const int64_t *qd = q->dims, *kd = keys->dims, *vd = values->dims;
  if (kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[3] || vd[3] != kd[2] ||
      slots->dims[0] != qd[0] || positions->dims[0] != qd[0])
    return Fail(api, "decode_attention: shapes disagree");

  const Shape shape{qd[0], kd[0], qd[1], qd[2], qd[3], kd[3]};
  if (cache == XLA_FFI_DataType_F16) return Run<Half>(frame, in, result, shape);
  if (cache == XLA_FFI_DataType_BF16 || cache == XLA_FFI_DataType_U16) return Run<BFloat16>(frame, in, result, shape);
  return Run<float>(frame, in, result, shape);
}
