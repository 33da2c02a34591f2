// Decode attention on the CPU: one query per row against the cached keys/values of the row's slot, for XLA:CPU,
// which runs it as single-threaded batched reductions at a third of the memory bandwidth (SmolLM2, 64 rows over
// 384 positions: 3 ms here against 8 ms per layer). An XLA FFI handler written against the FFI's C API alone, so
// that it builds in about a second; `decode_attention.py` builds, loads and calls it.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <sched.h>

#include "xla/ffi/api/c_api.h"

namespace {

constexpr int64_t kMinShared = 16384;  // (row, kv head) pairs x cache length below which one thread does it all

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

// The (row, kv head) pairs in chunks, claimed by the calling thread and the pool's threads alike; shared
// through a reference count, since a pool thread may start after the call has returned.
struct Work {
  const float *q, *keys, *values;
  const int32_t *slot_of, *positions;  // per query row: its cache row, its position
  float* out;
  Shape s;
  int64_t chunks, per_chunk;
  std::atomic<int64_t> next{0}, done{0}, owners{1};

  void Run() {
    float* scores = nullptr;
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      if (!scores) scores = new float[s.groups * s.length];
      for (int64_t i = c * per_chunk, end = std::min((c + 1) * per_chunk, s.rows * s.kv); i < end; ++i) {
        const int64_t b = i / s.kv, h = i % s.kv;
        float* o = out + i * s.groups * s.dim;
        const int64_t slot = slot_of[b], visible = std::min<int64_t>(int64_t{positions[b]} + 1, s.length);
        if (slot < 0 || slot >= s.slots || visible <= 0) {  // a padding row
          std::fill(o, o + s.groups * s.dim, 0.0f);
          continue;
        }
        const int64_t cell = (slot * s.kv + h) * s.dim * s.length;
        Attend(q + i * s.groups * s.dim, keys + cell, values + cell, visible, s, o, scores);
      }
      done.fetch_add(1, std::memory_order_release);
    }
    delete[] scores;
  }

  void Release() {
    if (owners.fetch_sub(1) == 1) delete this;
  }
};

void RunTask(void* data) {
  auto* work = static_cast<Work*>(data);
  work->Run();
  work->Release();
}

XLA_FFI_Error* Fail(const XLA_FFI_Api* api, const char* message) {
  XLA_FFI_Error_Create_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return api->XLA_FFI_Error_Create(&args);
}

void Discard(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_Destroy_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  args.error = error;
  api->XLA_FFI_Error_Destroy(&args);
}

}  // namespace

// Arguments: q [rows, kv, groups, dim] f32; keys [slots, kv, dim, length] f32; values [slots, kv, length, dim]
// f32; slots [rows] s32 (the cache row of each query row; out of range: a padding row, whose output is zeros);
// positions [rows] s32 (the query's position: it sees positions 0..position). Result: [rows, kv, groups, dim].
extern "C" XLA_FFI_Error* JaxllamaDecodeAttention(XLA_FFI_CallFrame* frame) {
  const XLA_FFI_Api* api = frame->api;
  // XLA first asks for the handler's metadata (the FFI version it was built against), as the first extension.
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* metadata = reinterpret_cast<XLA_FFI_Metadata_Extension*>(frame->extension_start)->metadata;
    metadata->api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                                                XLA_FFI_API_MINOR};
    metadata->traits = 0;
    return nullptr;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return nullptr;
  if (frame->args.size != 5 || frame->rets.size != 1) return Fail(api, "decode_attention: 5 arguments, 1 result");
  XLA_FFI_Buffer* in[5];
  for (int i = 0; i < 5; ++i) {
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) return Fail(api, "decode_attention: buffers expected");
    in[i] = static_cast<XLA_FFI_Buffer*>(frame->args.args[i]);
  }
  auto* result = static_cast<XLA_FFI_Buffer*>(frame->rets.rets[0]);
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

  auto* work = new Work;
  work->q = static_cast<const float*>(q->data);
  work->keys = static_cast<const float*>(keys->data);
  work->values = static_cast<const float*>(values->data);
  work->slot_of = static_cast<const int32_t*>(slots->data);
  work->positions = static_cast<const int32_t*>(positions->data);
  work->out = static_cast<float*>(result->data);
  work->s = Shape{qd[0], kd[0], qd[1], qd[2], qd[3], kd[3]};
  const int64_t pairs = qd[0] * qd[1];
  work->per_chunk = std::max<int64_t>(1, pairs / 32);
  work->chunks = (pairs + work->per_chunk - 1) / work->per_chunk;
  // Small calls run on this thread alone: handing work to the pool costs more than it saves.
  const bool alone = pairs * kd[3] < kMinShared;

  int64_t threads = 0;  // the pool's, when there is one and the call is large enough to share
  if (!alone) {
    XLA_FFI_ThreadPool_NumThreads_Args count;
    std::memset(&count, 0, sizeof(count));
    count.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
    count.ctx = frame->ctx;
    count.num_threads = &threads;
    if (XLA_FFI_Error* error = api->XLA_FFI_ThreadPool_NumThreads(&count)) {
      Discard(api, error);
      threads = 0;
    }
  }
  for (int64_t i = 0; i < std::min(threads, work->chunks - 1); ++i) {
    XLA_FFI_ThreadPool_Schedule_Args schedule;
    std::memset(&schedule, 0, sizeof(schedule));
    schedule.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
    schedule.ctx = frame->ctx;
    schedule.task = RunTask;
    schedule.data = work;
    work->owners.fetch_add(1);
    if (XLA_FFI_Error* error = api->XLA_FFI_ThreadPool_Schedule(&schedule)) {
      work->owners.fetch_sub(1);
      Discard(api, error);
      break;
    }
  }
  work->Run();  // claims whatever chunks the pool has not started; then waits for those in progress
  while (work->done.load(std::memory_order_acquire) < work->chunks) sched_yield();
  work->Release();
  return nullptr;
}
