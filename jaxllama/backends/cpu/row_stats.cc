// Each row's most likely token and log-normalizer, for greedy decoding: argmax, max and logsumexp of logits
// [rows, vocab] in one read, shared among threads by rows. XLA:CPU runs the two reductions one after the other on
// one thread. An XLA FFI handler (`ffi.h`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ffi.h"
#include "vec.h"

namespace {

using jaxllama::Exp;
using jaxllama::Ints;
using jaxllama::kLanes;
using jaxllama::Vec;
constexpr int64_t kMinShared = 1 << 16;  // rows x vocab below which one thread does it all

struct RowStats : jaxllama::Job {
  RowStats(int64_t rows, int64_t per_chunk) : Job((rows + per_chunk - 1) / per_chunk), per_chunk(per_chunk) {}
  const float* logits;
  int32_t* argmax;
  float *top, *logz;
  int64_t rows, vocab;
  const int64_t per_chunk;

  void Run(int64_t c) override {
    for (int64_t r = c * per_chunk; r < std::min(rows, (c + 1) * per_chunk); ++r) Row(r);
  }

  void Row(int64_t r) {
    const float* x = logits + r * vocab;
    const int64_t whole = vocab / kLanes * kLanes;
    Vec best = Vec{} - std::numeric_limits<float>::infinity();
    Ints nan = {};
    for (int64_t i = 0; i < whole; i += kLanes) {
      Vec v;
      std::memcpy(&v, x + i, sizeof(v));
      best = v > best ? v : best;
      nan |= v != v;
    }
    float m = -std::numeric_limits<float>::infinity();
    bool any_nan = false;
    for (int l = 0; l < kLanes; ++l) m = std::max(m, best[l]), any_nan |= nan[l] != 0;
    for (int64_t i = whole; i < vocab; ++i) m = std::max(m, x[i]), any_nan |= std::isnan(x[i]);
    if (any_nan) {  // as jnp.argmax and jnp.max take it: the first NaN, and NaN
      int64_t at = 0;
      while (!std::isnan(x[at])) ++at;
      argmax[r] = static_cast<int32_t>(at);
      top[r] = logz[r] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    int64_t at = 0;  // the first position of the maximum, as jnp.argmax takes it
    while (x[at] != m) ++at;
    if (std::isinf(m)) {  // every token impossible (-inf), or one certain (+inf): as jax.nn.logsumexp
      argmax[r] = static_cast<int32_t>(at);
      top[r] = logz[r] = m;
      return;
    }
    Vec total = {};
    for (int64_t i = 0; i < whole; i += kLanes) {
      Vec v;
      std::memcpy(&v, x + i, sizeof(v));
      total += Exp(v - m);
    }
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += total[l];
    for (int64_t i = whole; i < vocab; ++i) sum += std::exp(x[i] - m);
    argmax[r] = static_cast<int32_t>(at);
    top[r] = m;
    logz[r] = m + std::log(sum);
  }
};

}  // namespace

// Argument: logits [rows, vocab] f32. Results: argmax [rows] s32 (the first maximum), max [rows] f32 and
// logsumexp [rows] f32.
extern "C" XLA_FFI_Error* JaxllamaRowStats(XLA_FFI_CallFrame* frame) {
  using jaxllama::Fail;
  const XLA_FFI_Api* api = frame->api;
  if (jaxllama::NotExecuting(frame)) return nullptr;
  const XLA_FFI_Buffer* logits = jaxllama::Arg(frame, 0);
  XLA_FFI_Buffer *argmax = jaxllama::Result(frame, 0), *top = jaxllama::Result(frame, 1),
                 *logz = jaxllama::Result(frame, 2);
  if (frame->args.size != 1 || frame->rets.size != 3 || !logits || !argmax || !top || !logz)
    return Fail(api, "row_stats: 1 buffer argument, 3 buffer results");
  if (logits->dtype != XLA_FFI_DataType_F32 || logits->rank != 2 || argmax->dtype != XLA_FFI_DataType_S32 ||
      top->dtype != XLA_FFI_DataType_F32 || logz->dtype != XLA_FFI_DataType_F32 || argmax->rank != 1 ||
      top->rank != 1 || logz->rank != 1 || argmax->dims[0] != logits->dims[0] || top->dims[0] != logits->dims[0] ||
      logz->dims[0] != logits->dims[0])
    return Fail(api, "row_stats: f32 [rows, vocab] -> s32 [rows], f32 [rows], f32 [rows]");
  const int64_t rows = logits->dims[0], vocab = logits->dims[1];
  if (rows == 0) return nullptr;
  if (vocab == 0) return Fail(api, "row_stats: an empty vocabulary");
  RowStats job(rows, std::max<int64_t>(1, rows / 16));
  job.logits = static_cast<const float*>(logits->data);
  job.argmax = static_cast<int32_t*>(argmax->data);
  job.top = static_cast<float*>(top->data);
  job.logz = static_cast<float*>(logz->data);
  job.rows = rows;
  job.vocab = vocab;
  jaxllama::RunJob(frame, job, rows * vocab >= kMinShared && rows > 1);
  return nullptr;
}
