// Matrix products x @ w on the CPU against weights packed once, at load, into panels of kPanel output columns
// ([panels, in, kPanel], `matmul.py`'s `pack`), as llama.cpp and BLAS libraries lay them out. XLA:CPU runs each of a
// decode step's small products (32-64 rows) on one thread, through a library that repacks the weight on every
// call; this kernel reads each panel as one contiguous stream and shares every product between XLA's threads.
// A gated product (an MLP's gate and up projections, `pack_gated`) holds in each panel 8 gate columns and the 8 up
// columns of the same outputs, and stores silu(gate) x up: XLA's fusion for it took longer than the product at 32
// rows (~0.25 ms of ~0.9). XLA FFI handlers (`ffi.h`).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ffi.h"
#include "vec.h"

namespace {

using jaxllama::kLanes;
using jaxllama::Vec;

constexpr int64_t kPanel = 2 * kLanes;  // output columns per panel: two vectors
constexpr int64_t kTile = 4;     // rows per tile: 4 x 2 vector accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kBlock = 48;   // rows whose inputs stay in cache (L2) while the panels stream past them
constexpr int64_t kMinShared = 1 << 20;  // rows x in x panel columns below which one thread does it all

// out[rows, kPanel] (stride ldo) = x[rows, k] (stride ldx) @ panel[k, kPanel]; `width` <= kPanel columns stored.
// kGated: out[rows, kLanes] = silu(the first kLanes columns) x the last kLanes; `width` <= kLanes.
template <int kRows, bool kGated>
void Tile(const float* x, int64_t ldx, const float* panel, int64_t k, float* out, int64_t ldo, int64_t width) {
  Vec acc[kRows][2] = {};
  for (int64_t p = 0; p < k; ++p) {
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
  for (int i = 0; i < kRows; ++i) {
    if (kGated) {
      const Vec y = jaxllama::SiluTimes(acc[i][0], acc[i][1]);
      std::memcpy(out + i * ldo, &y, width * sizeof(float));
    } else if (width == kPanel) {
      std::memcpy(out + i * ldo, &acc[i][0], sizeof(Vec));
      std::memcpy(out + i * ldo + kLanes, &acc[i][1], sizeof(Vec));
    } else {  // the last panel of an output whose width is not a multiple of kPanel
      float row[kPanel];
      std::memcpy(row, &acc[i][0], sizeof(Vec));
      std::memcpy(row + kLanes, &acc[i][1], sizeof(Vec));
      std::memcpy(out + i * ldo, row, width * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <bool kGated>
constexpr TileFn kTiles[kTile + 1] = {nullptr, Tile<1, kGated>, Tile<2, kGated>, Tile<3, kGated>, Tile<4, kGated>};

// Chunks: blocks of kBlock rows x groups of panels.
template <bool kGated>
struct Product : jaxllama::Job {
  static constexpr int64_t kOut = kGated ? kLanes : kPanel;  // output columns per panel
  Product(int64_t chunks, int64_t groups, int64_t per_group) : Job(chunks), groups(groups), per_group(per_group) {}
  const float *x, *w;
  float* out;
  int64_t rows, k, n, panels;
  const int64_t groups, per_group;

  void Run(int64_t c) override {
    const int64_t r0 = (c / groups) * kBlock, r1 = std::min(rows, r0 + kBlock);
    const int64_t p0 = (c % groups) * per_group, p1 = std::min(panels, p0 + per_group);
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = w + p * k * kPanel;
      const int64_t width = std::min(kOut, n - p * kOut);
      for (int64_t r = r0; r < r1; r += kTile) {
        const int64_t tile = std::min(kTile, r1 - r);
        kTiles<kGated>[tile](x + r * k, k, panel, k, out + r * n + p * kOut, n, width);
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
  if (frame->args.size != 2 || frame->rets.size != 1 || !x || !w || !out)
    return Fail(api, "matmul: 2 buffer arguments, 1 buffer result");
  if (x->dtype != XLA_FFI_DataType_F32 || w->dtype != XLA_FFI_DataType_F32 || out->dtype != XLA_FFI_DataType_F32)
    return Fail(api, "matmul: f32 expected");
  if (x->rank < 1 || w->rank != 3 || out->rank != x->rank || w->dims[2] != kPanel)
    return Fail(api, "matmul: x [..., in], w [panels, in, 16] and out [..., out] expected");
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x->rank; ++i) {
    if (out->dims[i] != x->dims[i]) return Fail(api, "matmul: x and out disagree");
    rows *= x->dims[i];
  }
  const int64_t k = x->dims[x->rank - 1], n = out->dims[out->rank - 1], panels = w->dims[0];
  if (w->dims[1] != k || n > panels * kOut || n <= (panels - 1) * kOut)
    return Fail(api, "matmul: w's shape disagrees with x or out");
  if (rows == 0 || n == 0) return nullptr;

  // About 64 chunks, so that two or more threads end together; whole blocks of rows, groups of panels.
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  const int64_t per_group = std::max<int64_t>(1, panels * blocks / 64);
  const int64_t groups = (panels + per_group - 1) / per_group;
  Product<kGated> job(blocks * groups, groups, per_group);
  job.x = static_cast<const float*>(x->data);
  job.w = static_cast<const float*>(w->data);
  job.out = static_cast<float*>(out->data);
  job.rows = rows;
  job.k = k;
  job.n = n;
  job.panels = panels;
  jaxllama::RunJob(frame, job, rows * k * panels * kPanel >= kMinShared);
  return nullptr;
}

}  // namespace

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 (`pack`). Result: [..., out] f32 with out <= panels x
// kPanel: the first `out` columns of x @ the unpacked weight.
extern "C" XLA_FFI_Error* JaxllamaMatmul(XLA_FFI_CallFrame* frame) { return Handle<false>(frame); }

// Arguments: x [..., in] f32; w [panels, in, kPanel] f32 (`pack_gated`). Result: [..., out] f32 with out <= panels x
// kLanes: silu(x @ gate) x (x @ up).
extern "C" XLA_FFI_Error* JaxllamaGatedMatmul(XLA_FFI_CallFrame* frame) { return Handle<true>(frame); }
