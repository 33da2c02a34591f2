// Matrix products x @ w on the CPU against weights packed once, at load, into panels of kPanel output columns
// ([panels, in, kPanel], `matmul.py`'s `pack`), as llama.cpp and BLAS libraries lay them out. XLA:CPU runs each of a
// decode step's small products (32-64 rows) on one thread, through a library that repacks the weight on every
// call; this kernel reads each panel as one contiguous stream and shares every product between XLA's threads.
// A gated product (an MLP's gate and up projections, `pack_gated`) holds in each panel 8 gate columns and the 8 up
// columns of the same outputs, and stores silu(gate) x up: XLA's fusion for it took longer than the product at 32
// rows (~0.25 ms of ~0.9).
// Quantized weights (`matmul.py`'s `quantize`: int8, a float32 scale per column per block of kQBlock inputs, as
// llama.cpp's Q8_0) take 1.125 bytes a weight instead of 4, the bytes that bound a one-row product. Their products
// quantize each row of x to int16 per block (a scale per row and block) and sum each block in int32 (AVX2's
// pmaddwd: 16 multiply-adds per instruction, where converting int8 weights to float took more instructions than
// the float product), then add it in float times the two scales. As in float32, each row is computed on its own,
// in the same order, whatever rows share its call. XLA FFI handlers (`ffi.h`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi.h"
#include "vec.h"

namespace {

using jaxllama::kLanes;
using jaxllama::Vec;

constexpr int64_t kPanel = 2 * kLanes;  // output columns per panel: two vectors
constexpr int64_t kTile = 4;     // rows per tile: 4 x 2 vector accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kBlock = 48;   // rows whose inputs stay in cache (L2) while the panels stream past them
constexpr int64_t kMinShared = 1 << 16;  // rows x in x panel columns below which one thread does it all
constexpr int64_t kQBlock = 32;  // inputs per scale of a quantized weight
constexpr int64_t kAhead = 1024;  // bytes of a panel fetched ahead of the tile: one thread's stream from memory
                                  // is bound by latency (a one-row quantized product: 6.2 -> 8.7 G weights/s)

// One row of a tile's output from its two accumulators: `width` <= kPanel columns, or (kGated) silu(the first
// kLanes columns) x the last kLanes, `width` <= kLanes.
template <bool kGated>
void Store(const Vec& lo, const Vec& hi, float* out, int64_t width) {
  if (kGated) {
    const Vec y = jaxllama::SiluTimes(lo, hi);
    std::memcpy(out, &y, width * sizeof(float));
  } else if (width == kPanel) {
    std::memcpy(out, &lo, sizeof(Vec));
    std::memcpy(out + kLanes, &hi, sizeof(Vec));
  } else {  // the last panel of an output whose width is not a multiple of kPanel
    float row[kPanel];
    std::memcpy(row, &lo, sizeof(Vec));
    std::memcpy(row + kLanes, &hi, sizeof(Vec));
    std::memcpy(out, row, width * sizeof(float));
  }
}

// out[rows, kPanel] (stride ldo) = x[rows, k] (stride ldx) @ panel[k, kPanel]; `width` <= kPanel columns stored.
// kGated: out[rows, kLanes] = silu(the first kLanes columns) x the last kLanes; `width` <= kLanes.
template <int kRows, bool kGated>
void Tile(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo, int64_t width) {
  Vec acc[kRows][2] = {};
  for (int64_t p = 0; p < k; ++p) {
    __builtin_prefetch(panel + p * kPanel + kAhead / sizeof(float));
    Vec w0, w1;
    std::memcpy(&w0, panel + p * kPanel, sizeof(Vec));
    std::memcpy(&w1, panel + p * kPanel + kLanes, sizeof(Vec));
    for (int i = 0; i < kRows; ++i) {
      const float s = x[i * ldx + p];
      const Vec a = {s, s, s, s, s, s, s, s};  // a broadcast (`Vec{} + s` would also add a zero)
      acc[i][0] += a * w0;
      acc[i][1] += a * w1;
    }
  }
  for (int i = 0; i < kRows; ++i) Store<kGated>(acc[i][0], acc[i][1], out + i * ldo, width);
}

// Tile for a quantized panel: out[rows, kPanel] = x @ the panel, x given as xq[rows, kp] (int16, stride kp) times
// each block's xs[rows, kp / kQBlock]; the panel as q[kp / 2, kPanel, 2] (int8: pairs of inputs, column by column,
// as pmaddwd reads them) times each block's scales[kp / kQBlock, kPanel]. kp: the inputs padded to whole blocks.
template <int kRows, bool kGated>
void QuantizedTile(const int16_t* xq, const float* xs, int64_t kp, const int8_t* q, const float* scales, float* out,
                   int64_t ldo, int64_t width) {
  using jaxllama::Ints;
  using jaxllama::Shorts;
  const int64_t blocks = kp / kQBlock;
  Vec acc[kRows][2] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    Ints part[kRows][2] = {};
    for (int64_t p = b * kQBlock; p < (b + 1) * kQBlock; p += 2) {
      __builtin_prefetch(q + p * kPanel + kAhead);
      const Shorts w0 = jaxllama::LoadBytes(q + p * kPanel), w1 = jaxllama::LoadBytes(q + p * kPanel + kPanel);
      for (int i = 0; i < kRows; ++i) {
        int32_t pair;  // x's inputs p and p + 1, in every pair of lanes
        std::memcpy(&pair, xq + i * kp + p, sizeof(pair));
        const Ints a = {pair, pair, pair, pair, pair, pair, pair, pair};
        part[i][0] = jaxllama::MultiplyAddPairs(part[i][0], a, w0);
        part[i][1] = jaxllama::MultiplyAddPairs(part[i][1], a, w1);
      }
    }
    Vec s0, s1;
    std::memcpy(&s0, scales + b * kPanel, sizeof(Vec));
    std::memcpy(&s1, scales + b * kPanel + kLanes, sizeof(Vec));
    for (int i = 0; i < kRows; ++i) {
      const float x_scale = xs[i * blocks + b];
      acc[i][0] += __builtin_convertvector(part[i][0], Vec) * (s0 * x_scale);
      acc[i][1] += __builtin_convertvector(part[i][1], Vec) * (s1 * x_scale);
    }
  }
  for (int i = 0; i < kRows; ++i) Store<kGated>(acc[i][0], acc[i][1], out + i * ldo, width);
}

// xq[rows, kp] and xs[rows, kp / kQBlock] for x[rows, k] (`QuantizedTile`): per row and block, scale = max |x| /
// 32767 and xq = x / scale rounded to nearest; 0 past k. A NaN or infinite input makes its block's scale NaN or
// infinite, and its row's outputs NaN. Written as loops the compiler vectorizes: done one value at a time (a
// division and a rounding call each), it took a sixth of a 32-row product's time.
void QuantizeRows(const float* x, int64_t rows, int64_t k, int64_t kp, int16_t* xq, float* xs) {
  const int64_t blocks = kp / kQBlock;
  constexpr float kRound = 12582912.0f;  // 1.5 x 2^23: (v + kRound) - kRound rounds |v| < 2^22 to nearest, even
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {  // loops over a block's kQBlock values, which the compiler vectorizes
      float v[kQBlock];
      const int64_t start = b * kQBlock, n = std::min(k - start, kQBlock);
      for (int64_t i = 0; i < kQBlock; ++i) v[i] = i < n ? x[r * k + start + i] : 0.0f;
      float top = 0.0f;
      bool nan = false;
      for (int64_t i = 0; i < kQBlock; ++i) {
        top = std::max(top, std::abs(v[i]));
        nan |= v[i] != v[i];
      }
      const float scale = nan ? std::nanf("") : top / 32767.0f;
      xs[r * blocks + b] = scale;
      const bool usable = scale > 0.0f && scale <= 3.4e38f;  // else (0, NaN or inf) the inputs count as 0
      for (int64_t i = 0; i < kQBlock; ++i) {
        const float q = usable ? std::min(std::max((v[i] / scale + kRound) - kRound, -32767.0f), 32767.0f) : 0.0f;
        xq[r * kp + start + i] = static_cast<int16_t>(static_cast<int32_t>(q));
      }
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <bool kGated>
constexpr TileFn kTiles[kTile + 1] = {nullptr, Tile<1, kGated>, Tile<2, kGated>, Tile<3, kGated>, Tile<4, kGated>};
using QuantizedTileFn = void (*)(const int16_t*, const float*, int64_t, const int8_t*, const float*, float*,
                                 int64_t, int64_t);
template <bool kGated>
constexpr QuantizedTileFn kQuantizedTiles[kTile + 1] = {nullptr, QuantizedTile<1, kGated>, QuantizedTile<2, kGated>,
                                                         QuantizedTile<3, kGated>, QuantizedTile<4, kGated>};

// Chunks: blocks of kBlock rows x groups of panels.
template <bool kGated>
struct Product : jaxllama::Job {
  static constexpr int64_t kOut = kGated ? kLanes : kPanel;  // output columns per panel
  Product(int64_t chunks, int64_t groups, int64_t per_group) : Job(chunks), groups(groups), per_group(per_group) {}
  const float *x, *w;  // float32 panels, or for quantized ones (w nullptr):
  const int16_t* xq = nullptr;  // x quantized (`QuantizeRows`), its scales xs, the panels q and their scales
  const float *xs = nullptr, *scales = nullptr;
  const int8_t* q = nullptr;
  float* out;
  int64_t rows, k, n, panels;
  int64_t kp = 0;  // a quantized panel's inputs: k padded to whole blocks
  const int64_t groups, per_group;

  void Run(int64_t c) override {
    const int64_t r0 = (c / groups) * kBlock, r1 = std::min(rows, r0 + kBlock);
    const int64_t p0 = (c % groups) * per_group, p1 = std::min(panels, p0 + per_group);
    const int64_t blocks = kp / kQBlock;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t width = std::min(kOut, n - p * kOut);
      for (int64_t r = r0; r < r1; r += kTile) {
        const int64_t tile = std::min(kTile, r1 - r);
        if (q) {
          kQuantizedTiles<kGated>[tile](xq + r * kp, xs + r * blocks, kp, q + p * kp * kPanel,
                                        scales + p * blocks * kPanel, out + r * n + p * kOut, n, width);
        } else {
          kTiles<kGated>[tile](x + r * k, k, w + p * k * kPanel, k, out + r * n + p * kOut, n, width);
        }
      }
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
  if (x->dtype != XLA_FFI_DataType_F32 || out->dtype != XLA_FFI_DataType_F32 ||
      w->dtype != (quantized ? XLA_FFI_DataType_S8 : XLA_FFI_DataType_F32) ||
      (quantized && scales->dtype != XLA_FFI_DataType_F32))
    return Fail(api, "matmul: f32 x and out, f32 w or s8 w and f32 scales expected");
  if (x->rank < 1 || w->rank != 3 || out->rank != x->rank || w->dims[2] != kPanel)
    return Fail(api, "matmul: x [..., in], w [panels, in (quantized: padded to 32), 16] and out [..., out] expected");
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x->rank; ++i) {
    if (out->dims[i] != x->dims[i]) return Fail(api, "matmul: x and out disagree");
    rows *= x->dims[i];
  }
  const int64_t k = x->dims[x->rank - 1], n = out->dims[out->rank - 1], panels = w->dims[0];
  const int64_t kp = (k + kQBlock - 1) / kQBlock * kQBlock;
  if (w->dims[1] != (quantized ? kp : k) || n > panels * kOut || n <= (panels - 1) * kOut)
    return Fail(api, "matmul: w's shape disagrees with x or out");
  if (quantized && (scales->rank != 3 || scales->dims[0] != panels || scales->dims[2] != kPanel ||
                    scales->dims[1] != kp / kQBlock))
    return Fail(api, "matmul: scales [panels, ceil(in / 32), 16] expected");
  if (rows == 0 || n == 0) return nullptr;

  // About 64 chunks, so that two or more threads end together; whole blocks of rows, groups of panels.
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  const int64_t per_group = std::max<int64_t>(1, panels * blocks / 64);
  const int64_t groups = (panels + per_group - 1) / per_group;
  Product<kGated> job(blocks * groups, groups, per_group);
  job.x = static_cast<const float*>(x->data);
  job.w = quantized ? nullptr : static_cast<const float*>(w->data);
  thread_local std::vector<int16_t> xq;  // this thread's calls' quantized x, read by the helpers until Run returns
  thread_local std::vector<float> xs;
  if (quantized) {
    xq.resize(rows * kp);
    xs.resize(rows * (kp / kQBlock));
    QuantizeRows(job.x, rows, k, kp, xq.data(), xs.data());
    job.xq = xq.data();
    job.xs = xs.data();
    job.q = static_cast<const int8_t*>(w->data);
    job.scales = static_cast<const float*>(scales->data);
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

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 (`pack`), or quantized (`quantize`): w [panels, in
// padded to whole blocks of kQBlock, kPanel] s8 (pairs of inputs interleaved), then its scales [panels, blocks,
// kPanel] f32. Result: [..., out] f32 with out <= panels x kPanel: the first `out`
// columns of x @ the unpacked weight.
extern "C" XLA_FFI_Error* JaxllamaMatmul(XLA_FFI_CallFrame* frame) { return Handle<false>(frame); }

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 (`pack_gated`), or quantized as above. Result: [..., out] f32 with out <= panels x
// kLanes: silu(x @ gate) x (x @ up).
extern "C" XLA_FFI_Error* JaxllamaGatedMatmul(XLA_FFI_CallFrame* frame) { return Handle<true>(frame); }
