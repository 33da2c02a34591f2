// What the CPU kernels share: the XLA FFI's C API handshake and errors, and work split in chunks over the caller's
// thread and XLA's thread pool. Written against the FFI's C API alone (xla/ffi/api/c_api.h), which builds in about a
// second where the C++ FFI headers take six.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include <sched.h>

#include "xla/ffi/api/c_api.h"

namespace jaxllama {

inline XLA_FFI_Error* Fail(const XLA_FFI_Api* api, const char* message) {
  XLA_FFI_Error_Create_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return api->XLA_FFI_Error_Create(&args);
}

inline void Discard(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_Destroy_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  args.error = error;
  api->XLA_FFI_Error_Destroy(&args);
}

// True when XLA only asks for the handler's metadata (the FFI version it was built against, as the first
// extension) or calls at a stage other than execution: the handler then returns nullptr at once.
inline bool NotExecuting(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* metadata = reinterpret_cast<XLA_FFI_Metadata_Extension*>(frame->extension_start)->metadata;
    metadata->api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                                                XLA_FFI_API_MINOR};
    metadata->traits = 0;
    return true;
  }
  return frame->stage != XLA_FFI_ExecutionStage_EXECUTE;
}

// The call's buffers, checked to be buffers: nullptr where one is not.
inline XLA_FFI_Buffer* Arg(XLA_FFI_CallFrame* frame, int64_t i) {
  if (i >= frame->args.size || frame->args.types[i] != XLA_FFI_ArgType_BUFFER) return nullptr;
  return static_cast<XLA_FFI_Buffer*>(frame->args.args[i]);
}

inline XLA_FFI_Buffer* Result(XLA_FFI_CallFrame* frame, int64_t i) {
  if (i >= frame->rets.size || frame->rets.types[i] != XLA_FFI_RetType_BUFFER) return nullptr;
  return static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]);
}

// A call's work in `chunks` pieces, claimed by the calling thread and the pool's threads alike. Allocated with
// new and shared through a reference count, since a pool thread may start after the call has returned.
struct Job {
  explicit Job(int64_t chunks) : chunks(chunks) {}
  virtual ~Job() = default;
  virtual void Run(int64_t chunk) = 0;

  const int64_t chunks;
  std::atomic<int64_t> next{0}, done{0}, owners{1};

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  void Release() {
    if (owners.fetch_sub(1) == 1) delete this;
  }
  static void Task(void* data) {
    auto* job = static_cast<Job*>(data);
    job->Drain();
    job->Release();
  }
};

// Runs every chunk of `job` (taking ownership of it) and returns when all are done: on this thread alone unless
// `share`, else also on XLA's thread pool where the call has one.
inline void RunJob(XLA_FFI_CallFrame* frame, Job* job, bool share) {
  const XLA_FFI_Api* api = frame->api;
  int64_t threads = 0;
  if (share) {
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
  for (int64_t i = 0; i < threads && i < job->chunks - 1; ++i) {
    XLA_FFI_ThreadPool_Schedule_Args schedule;
    std::memset(&schedule, 0, sizeof(schedule));
    schedule.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
    schedule.ctx = frame->ctx;
    schedule.task = Job::Task;
    schedule.data = job;
    job->owners.fetch_add(1);
    if (XLA_FFI_Error* error = api->XLA_FFI_ThreadPool_Schedule(&schedule)) {
      job->owners.fetch_sub(1);
      Discard(api, error);
      break;
    }
  }
  job->Drain();  // claims whatever chunks the pool has not started; then waits for those in progress
  while (job->done.load(std::memory_order_acquire) < job->chunks) sched_yield();
  job->Release();
}

}  // namespace jaxllama
