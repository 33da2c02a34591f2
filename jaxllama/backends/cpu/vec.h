// Vectors of eight floats and the little math the kernels do on them: GCC/Clang vector extensions, compiled to AVX,
// NEON or scalar code per target, and AVX-512's vectors of sixteen where the CPU has them (`Wide`).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace jaxllama {

typedef float Vec __attribute__((vector_size(32)));
typedef int32_t Ints __attribute__((vector_size(32)));
typedef uint32_t UInts __attribute__((vector_size(32)));
typedef int16_t Shorts __attribute__((vector_size(32)));
constexpr int kLanes = 8;

// 2 x kLanes int8 from p, as int16 lanes.
inline Shorts LoadBytes(const int8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<Shorts>(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Shorts v;
  for (int i = 0; i < 2 * kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

// acc + the products of a's and b's int16 lanes (`a` given as Ints), each pair of lanes summed: AVX2's pmaddwd.
inline Ints MultiplyAddPairs(Ints acc, Ints a, Shorts b) {
#if defined(__AVX2__)
  return acc + reinterpret_cast<Ints>(_mm256_madd_epi16(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
#else
  const Shorts s = reinterpret_cast<Shorts>(a);
  for (int i = 0; i < kLanes; ++i) acc[i] += int32_t{s[2 * i]} * b[2 * i] + int32_t{s[2 * i + 1]} * b[2 * i + 1];
  return acc;
#endif
}

// DotBytes (below) in plain vector code: each byte shifted out (the unsigned ones masked, the signed ones
// sign-extended), multiplied and added.
template <typename V>
inline V DotBytesByShifts(V acc, V u, V s) {
  for (int shift = 0; shift < 32; shift += 8) acc += ((u >> shift) & 0xff) * ((s << (24 - shift)) >> 24);
  return acc;
}

// acc + in each int32 lane the sum of the products of u's 4 unsigned bytes and s's 4 signed bytes: AVX-VNNI's
// vpdpbusd where the CPU has it.
inline Ints DotBytes(Ints acc, Ints u, Ints s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return reinterpret_cast<Ints>(
      _mm256_dpbusd_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
#elif defined(__AVXVNNI__)
  return reinterpret_cast<Ints>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(u),
                                                        reinterpret_cast<__m256i>(s)));
#else
  return DotBytesByShifts(acc, u, s);
#endif
}

// The widest vectors: AVX-512's, where the CPU has them (with its byte and word instructions).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXLLAMA_WIDE 1
typedef float Wide __attribute__((vector_size(64)));
typedef int32_t WideInts __attribute__((vector_size(64)));
typedef int16_t WideShorts __attribute__((vector_size(64)));

// 2 x 16 int8 from p, as int16 lanes.
inline WideShorts LoadWideBytes(const int8_t* p) {
  return reinterpret_cast<WideShorts>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// acc + the products of a's and b's int16 lanes, each pair summed: VNNI's vpdpwssd, else vpmaddwd and an add.
inline WideInts MultiplyAddPairs(WideInts acc, WideInts a, WideShorts b) {
#if defined(__AVX512VNNI__)
  return reinterpret_cast<WideInts>(
      _mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b)));
#else
  const __m512i products = _mm512_madd_epi16(reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b));
  return acc + reinterpret_cast<WideInts>(products);
#endif
}

// acc + in each int32 lane the sum of the products of u's 4 unsigned bytes and s's 4 signed bytes: VNNI's vpdpbusd.
inline WideInts DotBytes(WideInts acc, WideInts u, WideInts s) {
#if defined(__AVX512VNNI__)
  return reinterpret_cast<WideInts>(
      _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)));
#else
  return DotBytesByShifts(acc, u, s);
#endif
}
#endif

// The vectors the kernels compute in where width pays: AVX-512's where the CPU has them, else Vec's eight floats.
#if defined(JAXLLAMA_WIDE)
using Reg = Wide;
using RegInts = WideInts;
using RegShorts = WideShorts;
#else
using Reg = Vec;
using RegInts = Ints;
using RegShorts = Shorts;
#endif
constexpr int kRegLanes = sizeof(Reg) / sizeof(float);

// acc + a x b rounded once, by an FMA instruction wherever the CPU has one: a contraction left to the compiler
// (-ffp-contract=fast) is its choice per function, and a kernel's instantiations for different group sizes must
// round alike for a query's result not to depend on what shares its call.
inline Reg Fma(Reg a, Reg b, Reg acc) {
#if defined(JAXLLAMA_WIDE)
  return reinterpret_cast<Reg>(
      _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__)
  return reinterpret_cast<Reg>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(acc)));
#else
  Reg out;
  for (int i = 0; i < kRegLanes; ++i) out[i] = std::fma(a[i], b[i], acc[i]);
  return out;
#endif
}

// w8a8's quads (`matmul.cc`'s Quads): acc + in each int32 lane the sum of the products of 4 weights, stored as
// unsigned bytes (the int8 weight + 128), and 4 signed input bytes. With VNNI, vpdpbusd multiplies them as they are
// and the sum counts 128 x the inputs' sum too, which the tile takes off (kSignedQuads false). On AVX2 without it,
// pmaddubsw would saturate on such products (2 x 255 x 127 > 2^15), so the weights are made signed again and
// multiplied as llama.cpp's AVX2 Q8_0 products do: |w| (unsigned) by the inputs given w's sign, pairs summed in
// int16 (at most 2 x 128 x 127: no saturation), then pairs of those in int32 by pmaddwd: the sum of w x s itself.
#if !defined(JAXLLAMA_WIDE) && defined(__AVX2__) && !((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
constexpr bool kSignedQuads = true;
inline RegInts DotQuads(RegInts acc, RegInts u, RegInts s) {
  const __m256i w = _mm256_xor_si256(reinterpret_cast<__m256i>(u), _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i magnitudes = _mm256_sign_epi8(w, w);
  const __m256i signed_inputs = _mm256_sign_epi8(reinterpret_cast<__m256i>(s), w);
  const __m256i pairs = _mm256_maddubs_epi16(magnitudes, signed_inputs);
  return acc + reinterpret_cast<RegInts>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
constexpr bool kSignedQuads = false;
inline RegInts DotQuads(RegInts acc, RegInts u, RegInts s) { return DotBytes(acc, u, s); }
#endif

// float16 <-> float32 for one value, by F16C where the CPU has it (x86 since 2012), else bit by bit (round to
// nearest, even; without `_Float16`, which older compilers lack on x86).
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa x 2^-24
    const float f = static_cast<float>(mantissa) * 5.9604645e-8f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline uint16_t FloatToHalf(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to or past 65520: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half, |f| / 2^-24 rounded to nearest, even
    float m;
    std::memcpy(&m, &magnitude, sizeof(m));
    return sign | static_cast<uint16_t>(std::nearbyint(m * 16777216.0f));
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);  // to nearest, even, at bit 13
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
#endif
}

// kRegLanes float16 values from p as floats: F16C's (or AVX-512's) vcvtph2ps where the CPU has it.
inline Reg LoadHalves(const uint16_t* p) {
#if defined(JAXLLAMA_WIDE)
  return reinterpret_cast<Reg>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<Reg>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Reg v;
  for (int i = 0; i < kRegLanes; ++i) v[i] = HalfToFloat(p[i]);
  return v;
#endif
}

// A block's sums of products of unsigned bytes of at most 15 (Q4_0's q + 8) by signed ones (x quantized to int8),
// each RegInts lane summing its 4 bytes' products: `AddByteDots` over the block's inputs, then `BlockTotals`.
// VNNI's vpdpbusd sums them in int32 lanes; without it pmaddubsw sums pairs into int16 lanes, which cannot
// saturate over one block (16 products of at most 15 x 127: 30480 < 2^15), widened to int32 once per block.
#if defined(JAXLLAMA_WIDE) && defined(__AVX512VNNI__)
using BlockSums = RegInts;
inline BlockSums AddByteDots(BlockSums acc, RegInts u, RegInts s) { return DotBytes(acc, u, s); }
inline RegInts BlockTotals(BlockSums acc) { return acc; }
#elif defined(JAXLLAMA_WIDE)
using BlockSums = RegShorts;
inline BlockSums AddByteDots(BlockSums acc, RegInts u, RegInts s) {
  return acc + reinterpret_cast<RegShorts>(_mm512_maddubs_epi16(reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)));
}
inline RegInts BlockTotals(BlockSums acc) {
  return reinterpret_cast<RegInts>(_mm512_madd_epi16(reinterpret_cast<__m512i>(acc), _mm512_set1_epi16(1)));
}
#elif (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__) || !defined(__AVX2__)
using BlockSums = RegInts;
inline BlockSums AddByteDots(BlockSums acc, RegInts u, RegInts s) { return DotBytes(acc, u, s); }
inline RegInts BlockTotals(BlockSums acc) { return acc; }
#else
using BlockSums = RegShorts;
inline BlockSums AddByteDots(BlockSums acc, RegInts u, RegInts s) {
  return acc + reinterpret_cast<RegShorts>(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
}
inline RegInts BlockTotals(BlockSums acc) {
  return reinterpret_cast<RegInts>(_mm256_madd_epi16(reinterpret_cast<__m256i>(acc), _mm256_set1_epi16(1)));
}
#endif

// A vector of V's type with every lane s: one broadcast (`V{} + s` would also add a zero).
template <typename V, typename S>
inline V Splat(S s) {
  if constexpr (sizeof(V) / sizeof(S) == 16) {
    return V{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
  } else {
    static_assert(sizeof(V) / sizeof(S) == 8);
    return V{s, s, s, s, s, s, s, s};
  }
}

// e^x for x <= 0, lane by lane (V: Vec or Reg): 2^n x e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error below 2.2e-7); below -87.3 (e^-87.3 ~ 1e-38, the smallest normal float),
// 0. Each lane's arithmetic is the same at either width.
template <typename V>
inline V Exp(V x) {
  using I = decltype(x < x);  // int32 lanes, as many as V's
  const V lo = V{} - 87.3f;
  const I tiny = x < lo;
  x = tiny ? lo : x;  // keeps n, and 2^n's exponent bits, in range
  const V n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f), I), V);
  const V r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 in two parts, for an exact reduction
  V p = V{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;  // 2^n: n + 127 in [1, 254]
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? V{} : p * scale;
}

// silu(g) x u = g / (1 + e^-g) x u, lane by lane, through e^-|g| (which `Exp` takes): for g < 0 the sigmoid is
// e^g / (1 + e^g), which neither overflows nor loses the small values.
template <typename V>
inline V SiluTimes(V g, V u) {
  const V t = Exp(g < 0 ? g : -g);
  return g * (g < 0 ? t : V{} + 1.0f) / (1.0f + t) * u;
}

}  // namespace jaxllama
