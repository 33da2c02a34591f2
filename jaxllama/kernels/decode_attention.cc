// Decode attention on the CPU: one query per row against the cached keys/values of the row's slot, for XLA:CPU,
// which runs it as single-threaded batched reductions at a third of the memory bandwidth (SmolLM2, 64 rows over
// 384 positions: 3 ms here against 8 ms per layer). An XLA FFI handler (`ffi.h`); `decode_attention.py` calls it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ffi.h"

namespace {

constexpr int64_t kMinShared = 4096;  // (row, kv head) pairs x cache length below which one thread does it all

struct Shape {
  int64_t rows, slots, kv, groups, dim, length;
};

// One (row, kv head): q [groups, dim]; keys [dim, length]; values [length, dim]; out [groups, dim]. Positions
// [0, visible) are attended to; scores [groups, length] is scratch.
void Attend(const float* q, const float* keys, const float* values, int64_t visible, const Shape& s, float* out,
            float* scores) {
  const int64_t g = s.groups, hd = s.dim, n = s.length;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t j = 0; j < g; ++j) std::fill(scores + j * n, scores + j * n + visible, 0.0f);
  for (int64_t d = 0; d < hd; ++d) {  // keys are [dim, length]: each key row is read once for all groups
    const float* k = keys + d * n;
    for (int64_t j = 0; j < g; ++j) {
      const float w = q[j * hd + d] * scale;
      float* sc = scores + j * n;
      for (int64_t t = 0; t < visible; ++t) sc[t] += w * k[t];
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sc = scores + j * n;
    float top = sc[0];
    for (int64_t t = 1; t < visible; ++t) top = std::max(top, sc[t]);
    float total = 0.0f;
    for (int64_t t = 0; t < visible; ++t) total += (sc[t] = std::exp(sc[t] - top));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < visible; ++t) sc[t] *= inv;
  }
  std::fill(out, out + g * hd, 0.0f);
  for (int64_t t = 0; t < visible; ++t) {  // values are [length, dim]: each value row is read once
    const float* v = values + t * hd;
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * n + t];
      float* o = out + j * hd;
      for (int64_t e = 0; e < hd; ++e) o[e] += p * v[e];
    }
  }
}

// The (row, kv head) pairs in chunks.
struct Attention : jaxllama::Job {
  Attention(int64_t chunks, int64_t per_chunk) : Job(chunks), per_chunk(per_chunk) {}
  const float *q, *keys, *values;
  const int32_t *slot_of, *positions;  // per query row: its cache row, its position
  float* out;
  Shape s;
  const int64_t per_chunk;

  void Run(int64_t c) override {
    thread_local std::vector<float> scores;
    scores.resize(s.groups * s.length);
    for (int64_t i = c * per_chunk, end = std::min((c + 1) * per_chunk, s.rows * s.kv); i < end; ++i) {
      const int64_t b = i / s.kv, h = i % s.kv;
      float* o = out + i * s.groups * s.dim;
      const int64_t slot = slot_of[b], visible = std::min<int64_t>(int64_t{positions[b]} + 1, s.length);
      if (slot < 0 || slot >= s.slots || visible <= 0) {  // a padding row
        std::fill(o, o + s.groups * s.dim, 0.0f);
        continue;
      }
      const int64_t cell = (slot * s.kv + h) * s.dim * s.length;
      Attend(q + i * s.groups * s.dim, keys + cell, values + cell, visible, s, o, scores.data());
    }
  }
};

}  // namespace

// Arguments: q [rows, kv, groups, dim] f32; keys [slots, kv, dim, length] f32; values [slots, kv, length, dim]
// f32; slots [rows] s32 (the cache row of each query row; out of range: a padding row, whose output is zeros);
// positions [rows] s32 (the query's position: it sees positions 0..position). Result: [rows, kv, groups, dim].
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
  const XLA_FFI_Buffer* floats[] = {q, keys, values, result};
  for (const XLA_FFI_Buffer* b : floats)
    if (b->dtype != XLA_FFI_DataType_F32 || b->rank != 4) return Fail(api, "decode_attention: f32 [.,.,.,.]");
  if (slots->dtype != XLA_FFI_DataType_S32 || positions->dtype != XLA_FFI_DataType_S32 || slots->rank != 1 ||
      positions->rank != 1)
    return Fail(api, "decode_attention: s32 [rows] slots and positions");
  const int64_t *qd = q->dims, *kd = keys->dims, *vd = values->dims;
  if (kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[3] || vd[3] != kd[2] ||
      slots->dims[0] != qd[0] || positions->dims[0] != qd[0])
    return Fail(api, "decode_attention: shapes disagree");

  const int64_t pairs = qd[0] * qd[1], per_chunk = std::max<int64_t>(1, pairs / 32);
  Attention job((pairs + per_chunk - 1) / per_chunk, per_chunk);
  job.q = static_cast<const float*>(q->data);
  job.keys = static_cast<const float*>(keys->data);
  job.values = static_cast<const float*>(values->data);
  job.slot_of = static_cast<const int32_t*>(slots->data);
  job.positions = static_cast<const int32_t*>(positions->data);
  job.out = static_cast<float*>(result->data);
  job.s = Shape{qd[0], kd[0], qd[1], qd[2], qd[3], kd[3]};
  // Small calls run on this thread alone: handing work to the pool costs more than it saves.
  jaxllama::RunJob(frame, job, pairs * kd[3] >= kMinShared);
  return nullptr;
}
