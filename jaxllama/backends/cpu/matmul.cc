// Matrix products x @ w on the CPU against weights packed once, at load, into panels of kPanel output columns
// ([panels, in, kPanel], `matmul.py`'s `pack`), as llama.cpp and BLAS libraries lay them out. XLA:CPU runs each of a
// decode step's small products (32-64 rows) on one thread, through a library that repacks the weight on every
// call; this kernel reads each panel as one contiguous stream and shares every product between XLA's threads.
// A gated product (an MLP's gate and up projections, `pack_gated`) holds in each panel 8 gate columns and the 8 up
// columns of the same outputs, and stores silu(gate) x up: no separate pass over the two outputs.
// Quantized weights (`matmul.py`'s `quantize`: int8, a float32 scale per column per block of kQBlock inputs, as
// llama.cpp's Q8_0) take 1.125 bytes a weight instead of 4, the bytes that bound a one-row product. Their products
// quantize each row of x per block (a scale per row and block) and sum each block exactly in int32, then add it in
// float times the two scales: "q8_0" quantizes x to int16 and sums by pmaddwd (16 multiply-adds an AVX2
// instruction, 32 with AVX-512 VNNI's vpdpwssd); "w8a8" quantizes x to int8 as Q8_0 (as llama.cpp's products do)
// and sums by vpdpbusd (64 multiply-adds an AVX-512 VNNI instruction, four times a float FMA's). As in float32,
// each row is computed on its own, in the same order, whatever rows share its call. XLA FFI handlers (`ffi.h`).
// On CPUs with AVX-512 the tiles compute in its 16-float registers, and a float32 tile of 8 rows x 2 panels keeps
// 16 of the 32 as accumulators.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <sched.h>

#include "ffi.h"
#include "vec.h"

namespace {

using jaxllama::kLanes;
using jaxllama::Vec;

// A tile computes in `vec.h`'s Reg vectors (AVX-512's where the CPU has them); a panel's row is kParts of them.
using jaxllama::kRegLanes;
using jaxllama::Reg;
using jaxllama::RegInts;
using jaxllama::RegShorts;

// kRegLanes pairs of int8 from p, as int16 lanes.
inline RegShorts LoadPairs(const int8_t* p) {
#if defined(JAXLLAMA_WIDE)
  return jaxllama::LoadWideBytes(p);
#else
  return jaxllama::LoadBytes(p);
#endif
}

constexpr int64_t kPanel = 2 * kLanes;  // output columns per panel; a gated one: kLanes gate and kLanes up columns
constexpr int64_t kParts = kPanel / kRegLanes;  // vectors per row of a panel
// A tile: kTile rows x kTilePanels panels of accumulators, the most that leave registers for the weights and a
// broadcast (AVX-512: 16 of 32 registers; AVX: 8 of 16). A quantized tile keeps an int32 and a float32 accumulator
// for each: kQTile rows where each weight vector is widened before use (int16 pairs, Q4_0's nibbles), so that a
// widening serves more rows (AVX-512: the float32 sums then wait in memory for each block's end, 5-20% faster at 64
// and 512 rows than 4 rows), kQuadTile where it is used as loaded (w8a8's quads: 8 rows were no faster).
#if defined(JAXLLAMA_WIDE)
constexpr int64_t kTile = 8, kTilePanels = 2, kQTile = 8, kQuadTile = 4, kQTilePanels = 2;
#else
constexpr int64_t kTile = 4, kTilePanels = 1, kQTile = 4, kQuadTile = 4, kQTilePanels = 1;
#endif
// Rows whose inputs stay in cache (L2) while every panel streams past them: each block of rows reads the whole
// weight again, from memory where it outgrows the caches, so as many rows as fit kRowBytes of inputs, at least
// kMinRows (448 rows of int8 inputs over 576, or 128 over 2048, ran 5-10% faster on one core than blocks of 48, and
// 1B's products then read their weights a quarter as often).
constexpr int64_t kRowBytes = 256 << 10, kMinRows = 48, kMaxRows = 512;
inline int64_t RowBlock(int64_t row_bytes) {
  return std::clamp<int64_t>(kRowBytes / std::max<int64_t>(1, row_bytes) / 8 * 8, kMinRows, kMaxRows);
}
constexpr int64_t kMinShared = 1 << 16;  // rows x in x panel columns below which one thread does it all
constexpr int64_t kQBlock = 32;  // inputs per scale of a quantized weight
constexpr int64_t kAhead = 1024;  // bytes of a panel fetched ahead of the tile: one thread's stream from memory
                                  // is bound by latency (a one-row quantized product: 6.2 -> 8.7 G weights/s)

// The columns of an output n columns wide (out_per_panel in each panel) in panel p.
inline int64_t Width(int64_t n, int64_t out_per_panel, int64_t p) {
  return std::max<int64_t>(0, std::min(out_per_panel, n - p * out_per_panel));
}

// A row of `width` <= kOut outputs from `row`, a whole one by a fixed-size copy, which compiles to vector stores (a
// copy of `width` floats calls the C library's memmove, which took 11-14% of a quantized product's time at 512 rows).
template <int64_t kOut>
inline void StoreRow(const float* row, float* out, int64_t width) {
  if (width == kOut) {
    std::memcpy(out, row, kOut * sizeof(float));
  } else {
    for (int64_t i = 0; i < width; ++i) out[i] = row[i];
  }
}

#if defined(JAXLLAMA_WIDE)
// Two rows of a gated panel, each accumulator a row's kLanes gate then kLanes up columns: silu(gate) x up of both,
// their gates gathered in one vector and their ups in another, so that one SiluTimes of kRegLanes serves both rows.
inline void StoreGatedRows(Reg a, Reg b, float* out_a, float* out_b, int64_t width) {
  const __m512 x = reinterpret_cast<__m512>(a), y = reinterpret_cast<__m512>(b);
  const Reg gate = reinterpret_cast<Reg>(_mm512_shuffle_f32x4(x, y, 0x44));  // a's and b's low halves
  const Reg up = reinterpret_cast<Reg>(_mm512_shuffle_f32x4(x, y, 0xee));  // their high halves
  float both[kRegLanes];
  const Reg silu = jaxllama::SiluTimes(gate, up);
  std::memcpy(both, &silu, sizeof(silu));
  StoreRow<kLanes>(both, out_a, width);
  StoreRow<kLanes>(both + kLanes, out_b, width);
}
#endif

// A tile's outputs from its accumulators acc[kRows][kPanels x kParts], panel j's at out + j x kOut (row stride ldo),
// of an output n columns wide from panel p: each panel's row as is, or (kGated) silu(its first kLanes columns) x
// its last kLanes. Always inlined after the tile's loop, so the reference leaves the accumulators in registers
// through it; a call out of line that took their address would keep them in memory.
template <bool kGated, int kRows, int kPanels>
[[gnu::always_inline]] inline void StoreTile(const Reg (&acc)[kRows][kPanels * kParts], float* out, int64_t ldo,
                                             int64_t n, int64_t p) {
  static_assert(kParts == 1 || kParts == 2);
  constexpr int64_t kOut = kGated ? kLanes : kPanel;
  for (int j = 0; j < kPanels; ++j) {
    const int64_t width = Width(n, kOut, p + j);
    float* o = out + j * kOut;
#if defined(JAXLLAMA_WIDE)
    if constexpr (kGated) {  // rows in pairs; an odd last row with itself
      for (int r = 0; r < kRows; r += 2) {
        const int r2 = r + 1 < kRows ? r + 1 : r;
        StoreGatedRows(acc[r][j], acc[r2][j], o + r * ldo, o + r2 * ldo, width);
      }
      continue;
    }
#endif
    for (int r = 0; r < kRows; ++r) {
      float row[kPanel];
      std::memcpy(row, &acc[r][j * kParts], sizeof(Reg));
      if (kParts == 2) std::memcpy(row + kRegLanes, &acc[r][j * kParts + 1], sizeof(Reg));
      if (kGated) {
        Vec gate, up;
        std::memcpy(&gate, row, sizeof(Vec));
        std::memcpy(&up, row + kLanes, sizeof(Vec));
        const Vec y = jaxllama::SiluTimes(gate, up);
        std::memcpy(row, &y, sizeof(Vec));
      }
      StoreRow<kOut>(row, o + r * ldo, width);
    }
  }
}

// out[rows, kPanels x kOut] (stride ldo) = x[rows, k] (stride ldx) @ kPanels panels [k, kPanel] (stride k x kPanel)
// from panel p of an output n columns wide; kGated: silu(each panel's first kLanes columns) x its last kLanes.
template <int kRows, int kPanels, bool kGated>
void Tile(const float* x, int64_t ldx, const void* w_data, int64_t k, float* out, int64_t ldo, int64_t n, int64_t p) {
  const auto* w = static_cast<const float*>(w_data);
  Reg acc[kRows][kPanels * kParts] = {};
  for (int64_t i = 0; i < k; ++i) {
    Reg panel[kPanels * kParts];
    for (int j = 0; j < kPanels; ++j) {
      const float* row = w + j * k * kPanel + i * kPanel;
      __builtin_prefetch(row + kAhead / sizeof(float));
      for (int h = 0; h < kParts; ++h) std::memcpy(&panel[j * kParts + h], row + h * kRegLanes, sizeof(Reg));
    }
    for (int r = 0; r < kRows; ++r) {
      const Reg a = jaxllama::Splat<Reg>(x[r * ldx + i]);
      for (int j = 0; j < kPanels * kParts; ++j) acc[r][j] += a * panel[j];
    }
  }
  StoreTile<kGated, kRows, kPanels>(acc, out, ldo, n, p);
}

// Tile for bfloat16 panels ([k2 / 2, kPanel, 2]: each column's inputs in pairs, k2 = k rounded up to even; stride
// k2 x kPanel): a 32-bit lane holds a column's inputs i and i + 1, which become floats by a shift (input i) and a
// mask (input i + 1), in registers and without shuffles; x and the sums stay float32.
template <int kRows, int kPanels, bool kGated>
void Bf16Tile(const float* x, int64_t ldx, const void* w_data, int64_t k, float* out, int64_t ldo, int64_t n,
              int64_t p) {
  const auto* w = static_cast<const uint16_t*>(w_data);
  const int64_t k2 = (k + 1) / 2 * 2;
  Reg acc[kRows][kPanels * kParts] = {};
  auto step = [&](int64_t i, bool pair) {
    Reg even[kPanels * kParts], odd[kPanels * kParts];
    for (int j = 0; j < kPanels; ++j) {
      const uint16_t* row = w + j * k2 * kPanel + i * kPanel;
      __builtin_prefetch(row + kAhead / sizeof(uint16_t));
      for (int h = 0; h < kParts; ++h) {
        RegInts v;
        std::memcpy(&v, row + h * 2 * kRegLanes, sizeof(v));
        even[j * kParts + h] = reinterpret_cast<Reg>(v << 16);
        odd[j * kParts + h] = reinterpret_cast<Reg>(v & static_cast<int32_t>(0xffff0000u));
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const Reg a = jaxllama::Splat<Reg>(x[r * ldx + i]);
      if (pair) {
        const Reg b = jaxllama::Splat<Reg>(x[r * ldx + i + 1]);
        for (int j = 0; j < kPanels * kParts; ++j) acc[r][j] += a * even[j] + b * odd[j];
      } else {
        for (int j = 0; j < kPanels * kParts; ++j) acc[r][j] += a * even[j];
      }
    }
  };
  for (int64_t i = 0; i + 1 < k; i += 2) step(i, true);
  if (k % 2) step(k - 1, false);  // an odd input count: the last pair's second weight is padding
  StoreTile<kGated, kRows, kPanels>(acc, out, ldo, n, p);
}

// The two int8 weight formats. Pairs (`quantize(w, "q8_0")`): each column's inputs in pairs of int8, x as int16,
// summed by pmaddwd (or VNNI's vpdpwssd). Quads (`"w8a8"`): each column's inputs in fours of unsigned bytes (the
// int8 weight + 128), x as int8, summed by VNNI's vpdpbusd, which multiplies unsigned by signed bytes: a block's
// sum then counts 128 x the sum of x's block too (kOffset), which is taken off; on AVX2 without VNNI, by pmaddubsw
// on the weights made signed again, which sums w x x itself (`vec.h`'s DotQuads).
struct Pairs {
  using Input = int16_t;
  using Weights = RegShorts;
  static constexpr int64_t kStep = 2;
  static constexpr int32_t kOffset = 0;
  static Weights Load(const int8_t* p) { return LoadPairs(p); }
  static RegInts Dot(RegInts acc, RegInts x, Weights w) { return jaxllama::MultiplyAddPairs(acc, x, w); }
};
struct Quads {
  using Input = int8_t;
  using Weights = RegInts;
  static constexpr int64_t kStep = 4;
  static constexpr int32_t kOffset = jaxllama::kSignedQuads ? 0 : 128;  // `vec.h`'s DotQuads
  static Weights Load(const int8_t* p) {
    Weights w;
    std::memcpy(&w, p, sizeof(w));
    return w;
  }
  static RegInts Dot(RegInts acc, RegInts x, Weights w) { return jaxllama::DotQuads(acc, w, x); }
};

// Tile for quantized panels: x given as xq[rows, kp] (F::Input, stride kp) times each block's xs[rows, kp /
// kQBlock] (and, for Quads, each block's sum xsum[rows, kp / kQBlock]); each panel as q[kp / kStep, kPanel, kStep]
// (its inputs in groups of kStep, column by column; stride kp x kPanel) times each block's scales[kp / kQBlock,
// kPanel]. kp: the inputs padded to whole blocks.
template <typename F, int kRows, int kPanels, bool kGated>
void QuantizedTile(const void* xq_data, const float* xs, const int32_t* xsum, int64_t kp, const void* q_data,
                   const void* scales_data, float* out, int64_t ldo, int64_t n, int64_t p) {
  const auto* q = static_cast<const int8_t*>(q_data);
  const auto* scales = static_cast<const float*>(scales_data);
  const auto* xq = static_cast<const typename F::Input*>(xq_data);
  const int64_t blocks = kp / kQBlock;
  Reg acc[kRows][kPanels * kParts] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    // Each block's sums start at what F's offset adds to them (Quads: 128 x the sum of x's block), which they then
    // lose: no subtraction per block and accumulator.
    RegInts part[kRows][kPanels * kParts];
    for (int r = 0; r < kRows; ++r) {
      const RegInts start = jaxllama::Splat<RegInts>(F::kOffset ? -F::kOffset * xsum[r * blocks + b] : 0);
      for (int j = 0; j < kPanels * kParts; ++j) part[r][j] = start;
    }
    for (int64_t i = b * kQBlock; i < (b + 1) * kQBlock; i += F::kStep) {
      typename F::Weights panel[kPanels * kParts];
      for (int j = 0; j < kPanels; ++j) {
        const int8_t* group = q + j * kp * kPanel + i * kPanel;
        __builtin_prefetch(group + kAhead);
        for (int h = 0; h < kParts; ++h) panel[j * kParts + h] = F::Load(group + h * F::kStep * kRegLanes);
      }
      for (int r = 0; r < kRows; ++r) {
        int32_t group;  // x's inputs i .. i + kStep, in every lane
        std::memcpy(&group, xq + r * kp + i, sizeof(group));
        const RegInts a = jaxllama::Splat<RegInts>(group);
        for (int j = 0; j < kPanels * kParts; ++j) part[r][j] = F::Dot(part[r][j], a, panel[j]);
      }
    }
    Reg scale[kPanels * kParts];
    for (int j = 0; j < kPanels; ++j)
      for (int h = 0; h < kParts; ++h)
        std::memcpy(&scale[j * kParts + h], scales + (j * blocks + b) * kPanel + h * kRegLanes, sizeof(Reg));
    for (int r = 0; r < kRows; ++r) {
      const float x_scale = xs[r * blocks + b];
      for (int j = 0; j < kPanels * kParts; ++j) acc[r][j] += __builtin_convertvector(part[r][j], Reg) * (scale[j] * x_scale);
    }
  }
  StoreTile<kGated, kRows, kPanels>(acc, out, ldo, n, p);
}

// Tile for Q4_0 panels, x quantized to int8 as Q8_0 (llama.cpp's `ggml_vec_dot_q4_0_q8_0`): each panel as
// q[kp / 8, kPanel, 4] bytes (stride kp / 2 x kPanel): for each 8 inputs i .. i + 8 of a column, 4 bytes whose low
// nibbles hold q + 8 of inputs i .. i + 4 and whose high ones those of i + 4 .. i + 8, so that a mask and a shift
// give two vectors of unsigned bytes in vpdpbusd's (or pmaddubsw's) layout; its float16 scales [kp / kQBlock,
// kPanel]. A block's sum counts 8 x the sum of x's block too, which is taken off.
template <int kRows, int kPanels, bool kGated>
void NibbleTile(const void* xq_data, const float* xs, const int32_t* xsum, int64_t kp, const void* q_data,
                const void* scales_data, float* out, int64_t ldo, int64_t n, int64_t p) {
  const auto* xq = static_cast<const int8_t*>(xq_data);
  const auto* q = static_cast<const uint8_t*>(q_data);
  const auto* scales = static_cast<const uint16_t*>(scales_data);
  const int64_t blocks = kp / kQBlock;
  const RegInts low_nibbles = jaxllama::Splat<RegInts>(0x0f0f0f0f);
  Reg acc[kRows][kPanels * kParts] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    jaxllama::BlockSums part[kRows][kPanels * kParts] = {};
    for (int64_t i = b * kQBlock; i < (b + 1) * kQBlock; i += 8) {
      RegInts low[kPanels * kParts], high[kPanels * kParts];
      for (int j = 0; j < kPanels; ++j) {
        const uint8_t* group = q + j * (kp / 2) * kPanel + (i / 2) * kPanel;
        __builtin_prefetch(group + kAhead);
        for (int h = 0; h < kParts; ++h) {
          RegInts v;
          std::memcpy(&v, group + h * 4 * kRegLanes, sizeof(v));
          low[j * kParts + h] = v & low_nibbles;
          high[j * kParts + h] = (v >> 4) & low_nibbles;
        }
      }
      for (int r = 0; r < kRows; ++r) {
        int32_t first, second;  // x's inputs i .. i + 4 and i + 4 .. i + 8
        std::memcpy(&first, xq + r * kp + i, sizeof(first));
        std::memcpy(&second, xq + r * kp + i + 4, sizeof(second));
        const RegInts a = jaxllama::Splat<RegInts>(first), c = jaxllama::Splat<RegInts>(second);
        for (int j = 0; j < kPanels * kParts; ++j)
          part[r][j] = jaxllama::AddByteDots(jaxllama::AddByteDots(part[r][j], low[j], a), high[j], c);
      }
    }
    Reg scale[kPanels * kParts];
    for (int j = 0; j < kPanels; ++j)
      for (int h = 0; h < kParts; ++h)
        scale[j * kParts + h] = jaxllama::LoadHalves(scales + (j * blocks + b) * kPanel + h * kRegLanes);
    for (int r = 0; r < kRows; ++r) {
      const float x_scale = xs[r * blocks + b];
      const int32_t offset = 8 * xsum[r * blocks + b];
      for (int j = 0; j < kPanels * kParts; ++j)
        acc[r][j] += __builtin_convertvector(jaxllama::BlockTotals(part[r][j]) - offset, Reg) * (scale[j] * x_scale);
    }
  }
  StoreTile<kGated, kRows, kPanels>(acc, out, ldo, n, p);
}

// A block of x's inputs as vectors: kQBlock inputs from `x`, the first `n` of them read, 0 past them. The branch
// picks where to read from, not the vectors: with a copy on each side, GCC joined them through the stack, and each
// block's loads then waited on the stores of its halves (AVX-512 on Zen 4: a third of the quantization's time).
constexpr int64_t kBlockRegs = kQBlock / kRegLanes;
using Block = std::array<Reg, kBlockRegs>;
inline Block LoadBlock(const float* x, int64_t n) {
  float padded[kQBlock];
  if (n < kQBlock) {
    for (int64_t i = 0; i < kQBlock; ++i) padded[i] = i < n ? x[i] : 0.0f;
    x = padded;
  }
  Block v;
  for (int64_t h = 0; h < kBlockRegs; ++h) std::memcpy(&v[h], x + h * kRegLanes, sizeof(Reg));
  return v;
}

// A vector's low and high halves, as vectors half its size: by shuffles in registers where the compiler has
// __builtin_shufflevector (GCC 12, Clang), else by copies, which GCC compiles to a store of the whole vector and loads
// of its halves that wait for it.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define JAXLLAMA_SHUFFLE 1
#endif
#endif
template <typename Half, typename V, size_t... I>
inline std::pair<Half, Half> HalvesOf(const V& v, std::index_sequence<I...>) {
  static_assert(2 * sizeof(Half) == sizeof(V));
#if defined(JAXLLAMA_SHUFFLE)
  return {__builtin_shufflevector(v, v, I...), __builtin_shufflevector(v, v, (I + sizeof...(I))...)};
#else
  Half low, high;
  std::memcpy(&low, &v, sizeof(Half));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
  return {low, high};
#endif
}
template <typename Half, typename V>
inline std::pair<Half, Half> Halves(const V& v) {
  return HalvesOf<Half>(v, std::make_index_sequence<sizeof(V) / sizeof(v[0]) / 2>{});
}

typedef int32_t FourInts __attribute__((vector_size(16)));
typedef int32_t TwoInts __attribute__((vector_size(8)));

// The larger of a and b lane by lane.
template <typename V>
inline V Larger(V a, V b) {
  return a > b ? a : b;
}

// The largest |v| of a block, or NaN where one is NaN: the bits of |v| compared as integers, which order
// non-negative floats as their values and put every NaN above infinity, so that one integer max (no NaN tests) takes
// each step; lanes folded in halves, in vector steps. (One lane at a time from a vector, the maximum took more time
// than the block's quantization.)
inline float AbsMax(const Block& v) {
  RegInts top = {};
  for (const Reg& x : v) top = Larger((RegInts)x & 0x7fffffff, top);  // a cast between vectors keeps the bits
#if defined(JAXLLAMA_WIDE)
  const auto [low16, high16] = Halves<jaxllama::Ints>(top);
  const jaxllama::Ints eight = Larger(low16, high16);
#else
  const jaxllama::Ints eight = top;
#endif
  const auto [low8, high8] = Halves<FourInts>(eight);
  const auto [low4, high4] = Halves<TwoInts>(Larger(low8, high8));
  const int32_t bits = std::max(low4[0], std::max(low4[1], std::max(high4[0], high4[1])));
  float largest;
  std::memcpy(&largest, &bits, sizeof(largest));
  return largest;
}

// The sum of v's lanes, halves folded into each other.
inline int32_t SumLanes(RegInts v) {
#if defined(JAXLLAMA_WIDE)
  const auto [low16, high16] = Halves<jaxllama::Ints>(v);
  const jaxllama::Ints eight = low16 + high16;
#else
  const jaxllama::Ints eight = v;
#endif
  const auto [low8, high8] = Halves<FourInts>(eight);
  const FourInts four = low8 + high8;
  return four[0] + four[1] + four[2] + four[3];
}

constexpr float kRound = 12582912.0f;  // 1.5 x 2^23: (v + kRound) - kRound rounds |v| < 2^22 to nearest, even
typedef int16_t RegHalfShorts __attribute__((vector_size(sizeof(Reg) / 2)));  // kRegLanes int16
typedef int8_t RegQuarterBytes __attribute__((vector_size(sizeof(Reg) / 4)));  // kRegLanes int8

// v's lanes, each within int16's (or int8's) range, as int16 (int8): AVX-512's vpmovdw (vpmovdb), AVX2's saturating
// packs (the compiler's own narrowing there moves one lane at a time through a general register).
inline RegHalfShorts ToShorts(RegInts v) {
#if !defined(JAXLLAMA_WIDE) && defined(__AVX2__)
  const __m256i x = reinterpret_cast<__m256i>(v);
  return reinterpret_cast<RegHalfShorts>(_mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
#else
  return __builtin_convertvector(v, RegHalfShorts);
#endif
}
inline RegQuarterBytes ToBytes(RegInts v) {
#if !defined(JAXLLAMA_WIDE) && defined(__AVX2__)
  const __m128i shorts = reinterpret_cast<__m128i>(ToShorts(v));
  return reinterpret_cast<RegQuarterBytes>(_mm_cvtsi128_si64(_mm_packs_epi16(shorts, shorts)));
#else
  return __builtin_convertvector(v, RegQuarterBytes);
#endif
}

// xq[rows, kp] and xs[rows, kp / kQBlock] for x[rows, k] (`QuantizedTile`): per row and block, scale = max |x| /
// 32767 and xq = x x (1 / scale) rounded to nearest; 0 past k. A NaN or infinite input makes its block's scale NaN or
// infinite, and its row's outputs NaN. A row at a time in three passes: its blocks' maxima, then their scales (whose
// divisions the compiler vectorizes over blocks: a block's two divisions in a row cost more than its other work),
// then its values in vector steps.
void QuantizeRows(const float* x, int64_t rows, int64_t k, int64_t kp, int16_t* xq, float* xs) {
  const int64_t blocks = kp / kQBlock;
  thread_local std::vector<float> inverses;
  inverses.resize(blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    float* scale = xs + r * blocks;
    for (int64_t b = 0; b < blocks; ++b)
      scale[b] = AbsMax(LoadBlock(row + b * kQBlock, std::min(k - b * kQBlock, kQBlock)));  // NaN where an input is
    for (int64_t b = 0; b < blocks; ++b) {
      scale[b] /= 32767.0f;
      // Else (0, subnormal, NaN or inf, whose inverse is not finite) the inputs count as 0.
      const bool usable = scale[b] >= std::numeric_limits<float>::min() && scale[b] <= 3.4e38f;
      inverses[b] = usable ? 1.0f / scale[b] : 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kQBlock;
      const Block v = LoadBlock(row + start, std::min(k - start, kQBlock));
      const float inverse = inverses[b];
      for (int64_t h = 0; h < kBlockRegs; ++h) {
        Reg q = inverse != 0.0f ? (v[h] * inverse + kRound) - kRound : Reg{};
        q = q < -32767.0f ? -32767.0f : q;
        q = q > 32767.0f ? 32767.0f : q;
        const RegHalfShorts shorts = ToShorts(__builtin_convertvector(q, RegInts));
        std::memcpy(xq + r * kp + start + h * kRegLanes, &shorts, sizeof(shorts));
      }
    }
  }
}

// xq[rows, kp], xs and xsum[rows, kp / kQBlock] for x[rows, k] as ggml's Q8_0 quantizes a row (`quantize_row_q8_0`,
// to the bit): per block, d = max |x| / 127, xq = x x (1 / d) rounded half away from zero, xs = d rounded to
// float16 (as Q8_0 stores it), xsum = the sum of the block's xq; 0 past k. A NaN or infinite input makes its row's
// outputs NaN. In three passes, as `QuantizeRows`.
void QuantizeRowsToBytes(const float* x, int64_t rows, int64_t k, int64_t kp, int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t blocks = kp / kQBlock;
  thread_local std::vector<float> inverses;
  inverses.resize(blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    float* scale = xs + r * blocks;
    for (int64_t b = 0; b < blocks; ++b)
      scale[b] = AbsMax(LoadBlock(row + b * kQBlock, std::min(k - b * kQBlock, kQBlock)));
    for (int64_t b = 0; b < blocks; ++b) {
      const float top = scale[b], d = top / 127.0f;
      inverses[b] = d != 0.0f && top <= 3.4028235e38f ? 1.0f / d : 0.0f;  // NaN or inf: counts as 0 ...
      scale[b] = top <= 3.4028235e38f ? jaxllama::HalfToFloat(jaxllama::FloatToHalf(d)) : std::nanf("");  // ... x NaN
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kQBlock;
      const Block v = LoadBlock(row + start, std::min(k - start, kQBlock));
      const float inverse = inverses[b];
      RegInts sums = {};
      for (int64_t h = 0; h < kBlockRegs; ++h) {  // roundf(v x inverse) as plain arithmetic
        const Reg scaled = inverse != 0.0f ? v[h] * inverse : Reg{}, s = scaled < 0 ? -scaled : scaled;
        const Reg even = (s + kRound) - kRound;
        const Reg away = even + (s - even == 0.5f ? 1.0f : 0.0f);  // a tie that went to even goes up
        const RegInts q = __builtin_convertvector(v[h] < 0.0f ? -away : away, RegInts);
        const RegQuarterBytes bytes = ToBytes(q);
        std::memcpy(xq + r * kp + start + h * kRegLanes, &bytes, sizeof(bytes));
        sums += q;
      }
      xsum[r * blocks + b] = SumLanes(sums);
    }
  }
}

// Each tile shape's function: [one panel or kTilePanels][rows - 1].
using TileFn = void (*)(const float*, int64_t, const void*, int64_t, float*, int64_t, int64_t, int64_t);
using QuantizedTileFn = void (*)(const void*, const float*, const int32_t*, int64_t, const void*, const void*, float*,
                                 int64_t, int64_t, int64_t);
// The float tiles: float32 (kBf16 false) or bfloat16 weights.
template <bool kBf16, bool kGated, int kPanels, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> Tiles(std::index_sequence<R...>) {
  if constexpr (kBf16) {
    return {Bf16Tile<R + 1, kPanels, kGated>...};
  } else {
    return {Tile<R + 1, kPanels, kGated>...};
  }
}
// The quantized tiles: F is Pairs, Quads or Nibbles (Q4_0, `NibbleTile`).
struct Nibbles {};
template <typename F, bool kGated, int kPanels, size_t... R>
constexpr std::array<QuantizedTileFn, sizeof...(R)> QuantizedTiles(std::index_sequence<R...>) {
  if constexpr (std::is_same_v<F, Nibbles>) {
    return {NibbleTile<R + 1, kPanels, kGated>...};
  } else {
    return {QuantizedTile<F, R + 1, kPanels, kGated>...};
  }
}
template <bool kBf16, bool kGated>
constexpr std::array<TileFn, kTile> kTiles[2] = {Tiles<kBf16, kGated, 1>(std::make_index_sequence<kTile>{}),
                                                 Tiles<kBf16, kGated, kTilePanels>(std::make_index_sequence<kTile>{})};
template <typename F, bool kGated>
constexpr std::array<QuantizedTileFn, kQTile> kQuantizedTiles[2] = {
    QuantizedTiles<F, kGated, 1>(std::make_index_sequence<kQTile>{}),
    QuantizedTiles<F, kGated, kQTilePanels>(std::make_index_sequence<kQTile>{})};

// What a product's panels hold (`matmul.py`'s Packed): float32, bfloat16, or int8 blocks as Pairs or Quads
// (`quantize`'s "q8_0" and "w8a8") or Q4_0's nibbles.
enum class Kind { kFloat, kBf16, kPairs, kQuads, kNibbles };

// Chunks: for quantized panels first `quantizing` chunks that quantize x's rows (which the product's chunks wait
// for: every thread then quantizes a share of them), then blocks of `block` rows (`RowBlock`) x groups of panels.
template <bool kGated>
struct Product : jaxllama::Job {
  static constexpr int64_t kOut = kGated ? kLanes : kPanel;  // output columns per panel
  Product(int64_t quantizing, int64_t block, int64_t products, int64_t groups, int64_t per_group)
      : Job(quantizing + products), quantizing(quantizing), block(block), groups(groups), per_group(per_group) {}
  Kind kind = Kind::kFloat;
  const float* x;
  const void* w;  // the panels, and for quantized ones:
  const void* scales = nullptr;  // their scales (float32; Nibbles: float16),
  void* xq = nullptr;  // x quantized (`QuantizeRows`: int16; `QuantizeRowsToBytes`: int8), its scales xs and
  float* xs = nullptr;  // (int8) its block sums xsum
  int32_t* xsum = nullptr;
  float* out;
  int64_t rows, k, n, panels;
  int64_t kp = 0;  // a quantized panel's inputs: k padded to whole blocks
  const int64_t quantizing, block, groups, per_group;
  std::atomic<int64_t> quantized{0};  // quantizing chunks done

  void Run(int64_t c) override {
    const int64_t blocks = kp / kQBlock;
    if (c < quantizing) {
      const int64_t per = (rows + quantizing - 1) / quantizing, r0 = c * per, r1 = std::min(rows, r0 + per);
      if (r0 < r1 && kind != Kind::kPairs) {
        QuantizeRowsToBytes(x + r0 * k, r1 - r0, k, kp, static_cast<int8_t*>(xq) + r0 * kp, xs + r0 * blocks,
                            xsum + r0 * blocks);
      } else if (r0 < r1) {
        QuantizeRows(x + r0 * k, r1 - r0, k, kp, static_cast<int16_t*>(xq) + r0 * kp, xs + r0 * blocks);
      }
      quantized.fetch_add(1, std::memory_order_release);
      return;
    }
    while (quantized.load(std::memory_order_acquire) < quantizing) sched_yield();  // claimed, so being done
    c -= quantizing;
    const int64_t r0 = (c / groups) * block, r1 = std::min(rows, r0 + block);
    const int64_t p0 = (c % groups) * per_group, p1 = std::min(panels, p0 + per_group);
    const bool quantized = kind != Kind::kFloat && kind != Kind::kBf16;
    const int64_t step = quantized ? kQTilePanels : kTilePanels;
    const int64_t tile_rows = !quantized ? kTile : kind == Kind::kQuads ? kQuadTile : kQTile;
    const auto* bytes = static_cast<const char*>(w);
    for (int64_t p = p0; p < p1;) {
      const bool whole = p + step <= p1;  // a tile of `step` panels, else of one
      for (int64_t r = r0; r < r1; r += tile_rows) {
        const int64_t tile = std::min(tile_rows, r1 - r);
        float* o = out + r * n + p * kOut;
        if (quantized) {
          const auto& tiles = kind == Kind::kQuads   ? kQuantizedTiles<Quads, kGated>
                              : kind == Kind::kPairs ? kQuantizedTiles<Pairs, kGated>
                                                     : kQuantizedTiles<Nibbles, kGated>;
          const void* xr = static_cast<const char*>(xq) + r * kp * (kind == Kind::kPairs ? 2 : 1);
          const int64_t panel_bytes = kind == Kind::kNibbles ? kp / 2 * kPanel : kp * kPanel;
          const int64_t scale_bytes = kind == Kind::kNibbles ? 2 : 4;
          tiles[whole][tile - 1](xr, xs + r * blocks, xsum ? xsum + r * blocks : nullptr, kp, bytes + p * panel_bytes,
                                 static_cast<const char*>(scales) + p * blocks * kPanel * scale_bytes, o, n, n, p);
        } else if (kind == Kind::kBf16) {
          const int64_t k2 = (k + 1) / 2 * 2;
          kTiles<true, kGated>[whole][tile - 1](x + r * k, k, bytes + p * k2 * kPanel * 2, k, o, n, n, p);
        } else {
          kTiles<false, kGated>[whole][tile - 1](x + r * k, k, bytes + p * k * kPanel * 4, k, o, n, n, p);
        }
      }
      p += whole ? step : 1;
    }
  }
};

template <bool kGated>
XLA_FFI_Error* Handle(XLA_FFI_CallFrame* frame) {
  using jaxllama::Fail;
  constexpr int64_t kOut = Product<kGated>::kOut;
  const XLA_FFI_Api* api = frame->api;
  if (jaxllama::NotExecuting(frame)) return nullptr;
  const XLA_FFI_Buffer *x = jaxllama::Arg(frame, 0), *w = jaxllama::Arg(frame, 1);
  XLA_FFI_Buffer* out = jaxllama::Result(frame, 0);
  const bool quantized = frame->args.size == 3;
  const XLA_FFI_Buffer* scales = quantized ? jaxllama::Arg(frame, 2) : nullptr;
  if (frame->args.size < 2 || frame->args.size > 3 || frame->rets.size != 1 || !x || !w || !out ||
      (quantized && !scales))
    return Fail(api, "matmul: 2 or 3 buffer arguments, 1 buffer result");
  Kind kind = Kind::kFloat;
  if (!quantized && w->dtype == XLA_FFI_DataType_BF16) {
    kind = Kind::kBf16;
  } else if (quantized && w->dtype == XLA_FFI_DataType_S8 && scales->dtype == XLA_FFI_DataType_F32) {
    kind = Kind::kPairs;
  } else if (quantized && w->dtype == XLA_FFI_DataType_U8 && scales->dtype == XLA_FFI_DataType_F32) {
    kind = Kind::kQuads;
  } else if (quantized && w->dtype == XLA_FFI_DataType_U8 && scales->dtype == XLA_FFI_DataType_F16) {
    kind = Kind::kNibbles;
  } else if (quantized || w->dtype != XLA_FFI_DataType_F32) {
    return Fail(api, "matmul: w f32 or bf16, or s8 (pairs) or u8 (quads) w and f32 scales, or u8 (Q4_0) w and f16 "
                     "scales expected");
  }
  if (x->dtype != XLA_FFI_DataType_F32 || out->dtype != XLA_FFI_DataType_F32)
    return Fail(api, "matmul: f32 x and out expected");
  if (x->rank < 1 || w->rank != 3 || out->rank != x->rank || w->dims[2] != kPanel)
    return Fail(api, "matmul: x [..., in], w [panels, in (padded), 16] and out [..., out] expected");
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x->rank; ++i) {
    if (out->dims[i] != x->dims[i]) return Fail(api, "matmul: x and out disagree");
    rows *= x->dims[i];
  }
  const int64_t k = x->dims[x->rank - 1], n = out->dims[out->rank - 1], panels = w->dims[0];
  const int64_t kp = (k + kQBlock - 1) / kQBlock * kQBlock;
  const int64_t panel_inputs = kind == Kind::kFloat ? k
                               : kind == Kind::kBf16  ? (k + 1) / 2 * 2
                               : kind == Kind::kNibbles ? kp / 2
                                                        : kp;
  if (w->dims[1] != panel_inputs || n > panels * kOut || n <= (panels - 1) * kOut)
    return Fail(api, "matmul: w's shape disagrees with x or out");
  if (quantized && (scales->rank != 3 || scales->dims[0] != panels || scales->dims[2] != kPanel ||
                    scales->dims[1] != kp / kQBlock))
    return Fail(api, "matmul: scales [panels, ceil(in / 32), 16] expected");
  if (rows == 0 || n == 0) return nullptr;

  // About 64 chunks, so that two or more threads end together; whole blocks of rows, groups of panels.
  const int64_t block = RowBlock(quantized ? kp * (kind == Kind::kPairs ? 2 : 1) : k * 4);
  const int64_t blocks = (rows + block - 1) / block;
  const int64_t step = quantized ? kQTilePanels : kTilePanels;  // panels per tile
  const int64_t per_group = std::max<int64_t>(1, panels * blocks / 64 / step) * step;
  const int64_t groups = (panels + per_group - 1) / per_group;
  // Quantized: x's rows quantized in up to 8 chunks of 4 or more rows, shared like the products.
  const int64_t quantizing = quantized ? std::min<int64_t>(8, (rows + 3) / 4) : 0;
  Product<kGated> job(quantizing, block, blocks * groups, groups, per_group);
  job.kind = kind;
  job.x = static_cast<const float*>(x->data);
  job.w = w->data;
  // This thread's calls' quantized x, written and read by all the job's threads until RunJob returns.
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<int8_t> xq8;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  if (quantized) {
    xs.resize(rows * (kp / kQBlock));
    if (kind != Kind::kPairs) {
      xq8.resize(rows * kp);
      xsum.resize(rows * (kp / kQBlock));
      job.xq = xq8.data();
      job.xsum = xsum.data();
    } else {
      xq.resize(rows * kp);
      job.xq = xq.data();
    }
    job.xs = xs.data();
    job.scales = scales->data;
    job.kp = kp;
  }
  job.out = static_cast<float*>(out->data);
  job.rows = rows;
  job.k = k;
  job.n = n;
  job.panels = panels;
  jaxllama::RunJob(frame, job, rows * k * panels * kPanel >= kMinShared);
  return nullptr;
}

}  // namespace

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 or [panels, in rounded up to even, kPanel] bf16 in pairs
// (`pack`), or quantized (`quantize`): w [panels, in padded to whole blocks of kQBlock, kPanel], s8 in pairs of
// inputs (Pairs) or u8 in fours (Quads), then its scales [panels, blocks, kPanel] f32; or Q4_0: w [panels, half
// that, kPanel] u8 (`NibbleTile`), then its scales [panels, blocks, kPanel] f16. Result: [..., out] f32 with out <= panels x kPanel: the first `out` columns
// of x @ the unpacked weight.
extern "C" XLA_FFI_Error* JaxllamaMatmul(XLA_FFI_CallFrame* frame) { return Handle<false>(frame); }

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 (`pack_gated`), or quantized as above. Result: [..., out] f32 with out <= panels x
// kLanes: silu(x @ gate) x (x @ up).
extern "C" XLA_FFI_Error* JaxllamaGatedMatmul(XLA_FFI_CallFrame* frame) { return Handle<true>(frame); }
