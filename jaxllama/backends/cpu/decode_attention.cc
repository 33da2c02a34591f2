// Decode attention on the CPU: one query per row against the cached keys/values of the row's slot, for XLA:CPU,
// which runs it as single-threaded batched reductions far below the memory bandwidth (benchmarks/README.md). An XLA FFI
// handler (`ffi.h`); `decode_attention.py` calls it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi.h"
#include "vec.h"

namespace {

constexpr int64_t kMinShared = 1024;  // (row, kv head) pairs x cache length below which one thread does it all

struct Shape {
  int64_t rows, slots, kv, groups, dim, length;
};

using jaxllama::kLanes;
using jaxllama::Vec;

constexpr int kGroupsAtOnce = 4;  // query heads of a kv head whose sums are kept in registers together

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

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

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

// scores[j, t0..t0 + kV x kRegLanes) = q[j] . keys[:, t0..] x scale for kG query heads: each key vector is read
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
      for (int h = 0; h < kV; ++h) acc[j][h] += w * key[h];
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h) {
      const Reg s = acc[j][h] * scale;
      std::memcpy(scores + j * n + t0 + h * kRegLanes, &s, sizeof(Reg));
    }
}

// out[j, e0..e0 + kV x kRegLanes) = sum over t < visible of p[j, t] x values[t, e0..] for kG query heads.
template <int kG, int kV, typename C>
void WeighBlock(const float* p, const C* values, int64_t hd, int64_t n, int64_t visible, int64_t e0, float* out) {
  Reg acc[kG][kV] = {};
  for (int64_t t = 0; t < visible; ++t) {
    __builtin_prefetch(values + (t + 4) * hd + e0);
    Reg value[kV];
    for (int h = 0; h < kV; ++h) value[h] = LoadReg(values + t * hd + e0 + h * kRegLanes);
    for (int j = 0; j < kG; ++j) {
      const Reg w = jaxllama::Splat<Reg>(p[j * n + t]);
      for (int h = 0; h < kV; ++h) acc[j][h] += w * value[h];
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int h = 0; h < kV; ++h) std::memcpy(out + j * hd + e0 + h * kRegLanes, &acc[j][h], sizeof(Reg));
}

// kG query heads' scores (`scoring`: positions [0, visible), 2 or 1 x kRegLanes at a time where the cache's length
// allows, the rest one by one) or weighted values (2 or 1 x kRegLanes dims at a time, the rest one by one).
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
        for (int64_t d = 0; d < hd; ++d) sum += q[j * hd + d] * ToFloat(keys[d * n + t]);
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
        for (int64_t t = 0; t < visible; ++t) sum += scores[j * n + t] * ToFloat(values[t * hd + e]);
        out[j * hd + e] = sum;
      }
    }
  }
}

// The kv head's query heads kGroupsAtOnce at a time: scores (`scoring`) or the weighted values.
template <typename C>
void Groups(const float* q, const C* keys, const C* values, int64_t visible, int64_t g, int64_t hd,
            int64_t n, float scale, float* out, float* scores, bool scoring) {
  for (int64_t j = 0; j < g; j += kGroupsAtOnce) {
    const float* qj = q + j * hd;
    float *oj = out + j * hd, *sj = scores + j * n;
    switch (std::min<int64_t>(kGroupsAtOnce, g - j)) {
      case 1: Heads<1, C>(qj, keys, values, visible, hd, n, scale, oj, sj, scoring); break;
      case 2: Heads<2, C>(qj, keys, values, visible, hd, n, scale, oj, sj, scoring); break;
      case 3: Heads<3, C>(qj, keys, values, visible, hd, n, scale, oj, sj, scoring); break;
      default: Heads<4, C>(qj, keys, values, visible, hd, n, scale, oj, sj, scoring); break;
    }
  }
}

// One (row, kv head): q [groups, dim]; keys [dim, length]; values [length, dim]; out [groups, dim]. Positions
// [0, visible) are attended to; scores [groups, length] is scratch. Query heads go kGroupsAtOnce at a time, their
// sums in registers (`Heads`): each key and value vector is read once for all of them, and no score or output is
// read and written back per dim or position (3x faster than loops over one head at a time).
template <typename C>
void Attend(const float* q, const C* keys, const C* values, int64_t visible, const Shape& s, float* out,
            float* scores) {
  const int64_t g = s.groups, hd = s.dim, n = s.length;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Groups(q, keys, values, visible, g, hd, n, scale, out, scores, true);
  for (int64_t j = 0; j < g; ++j) {
    float* sc = scores + j * n;
    float top = sc[0];
    for (int64_t t = 1; t < visible; ++t) top = std::max(top, sc[t]);
    Vec sums = {};
    int64_t t = 0;
    for (; t + kLanes <= visible; t += kLanes) {  // e^(score - top) <= 1, by `vec.h`'s Exp
      const Vec e = jaxllama::Exp(Load(sc + t) - top);
      std::memcpy(sc + t, &e, sizeof(e));
      sums += e;
    }
    float total = 0.0f;
    for (int i = 0; i < kLanes; ++i) total += sums[i];
    for (; t < visible; ++t) total += (sc[t] = std::exp(sc[t] - top));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < visible; ++t) sc[t] *= inv;
  }
  Groups(q, keys, values, visible, g, hd, n, scale, out, scores, false);
}

// The (row, kv head) pairs in chunks, over a cache of C.
template <typename C>
struct Attention : jaxllama::Job {
  Attention(int64_t chunks, int64_t per_chunk) : Job(chunks), per_chunk(per_chunk) {}
  const float* q;
  const C *keys, *values;
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

template <typename C>
XLA_FFI_Error* Run(XLA_FFI_CallFrame* frame, XLA_FFI_Buffer* const* in, XLA_FFI_Buffer* result, const Shape& s) {
  const int64_t pairs = s.rows * s.kv, per_chunk = std::max<int64_t>(1, pairs / 32);
  Attention<C> job((pairs + per_chunk - 1) / per_chunk, per_chunk);
  job.q = static_cast<const float*>(in[0]->data);
  job.keys = static_cast<const C*>(in[1]->data);
  job.values = static_cast<const C*>(in[2]->data);
  job.slot_of = static_cast<const int32_t*>(in[3]->data);
  job.positions = static_cast<const int32_t*>(in[4]->data);
  job.out = static_cast<float*>(result->data);
  job.s = s;
  // Small calls run on this thread alone: handing work to the pool costs more than it saves.
  jaxllama::RunJob(frame, job, pairs * s.length >= kMinShared);
  return nullptr;
}

}  // namespace

// Arguments: q [rows, kv, groups, dim] f32; keys [slots, kv, dim, length] and values [slots, kv, length, dim], both
// f32, f16 or bf16; slots [rows] s32 (the cache row of each query row; out of range: a padding row, whose output is
// zeros); positions [rows] s32 (the query's position: it sees positions 0..position). Result: [rows, kv, groups,
// dim] f32.
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
      !(cache == XLA_FFI_DataType_F32 || cache == XLA_FFI_DataType_F16 || cache == XLA_FFI_DataType_BF16))
    return Fail(api, "decode_attention: f32 q and result, keys and values both f32, f16 or bf16");
  if (slots->dtype != XLA_FFI_DataType_S32 || positions->dtype != XLA_FFI_DataType_S32 || slots->rank != 1 ||
      positions->rank != 1)
    return Fail(api, "decode_attention: s32 [rows] slots and positions");
  const int64_t *qd = q->dims, *kd = keys->dims, *vd = values->dims;
  if (kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[3] || vd[3] != kd[2] ||
      slots->dims[0] != qd[0] || positions->dims[0] != qd[0])
    return Fail(api, "decode_attention: shapes disagree");

  const Shape shape{qd[0], kd[0], qd[1], qd[2], qd[3], kd[3]};
  if (cache == XLA_FFI_DataType_F16) return Run<Half>(frame, in, result, shape);
  if (cache == XLA_FFI_DataType_BF16) return Run<BFloat16>(frame, in, result, shape);
  return Run<float>(frame, in, result, shape);
}
