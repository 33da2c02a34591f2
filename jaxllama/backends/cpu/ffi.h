// What the CPU kernels share: the XLA FFI's C API handshake and errors, and work split in chunks over the caller's
// thread and helper threads. Written against the FFI's C API alone (xla/ffi/api/c_api.h), which builds in about a
// second where the C++ FFI headers take six.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <sched.h>
#include <unistd.h>

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

// A call's work in `chunks` pieces, claimed by the calling thread and the helpers alike.
struct Job {
  explicit Job(int64_t chunks) : chunks(chunks) {}
  virtual ~Job() = default;
  virtual void Run(int64_t chunk) = 0;

  const int64_t chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Threads of the kernels' own that share a call's chunks with its caller. XLA's pool takes ~140 us to start a
// task here, a third of a 32-row product, and a third of the time starts it after the caller has done all the
// work; these helpers wait for the next call spinning (yielding the core to any other thread that wants it) for a
// while, and only then sleep. One call uses them at a time; a call that finds them busy runs on its own thread.
class Helpers {
 public:
  // The process's helpers, `threads` - 1 of them (`threads`: XLA's pool size at the first call that shares).
  static Helpers& Get(int64_t threads) {
    static Helpers* helpers = new Helpers(threads - 1);  // never destroyed: its threads outlive main
    return *helpers;
  }

  // Runs every chunk of `job`, with the helpers' help unless another call has them.
  void Run(Job& job) {
    std::unique_lock<std::mutex> mine(busy_, std::try_to_lock);
    if (!mine.owns_lock() || count_ == 0 || getpid() != pid_) return job.Drain();  // in a fork: no helpers
    current_.store(&job);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    job.Drain();  // then wait for chunks in progress, and for helpers still holding the job
    while (job.done.load(std::memory_order_acquire) < job.chunks) sched_yield();
    current_.store(nullptr);
    while (inside_.load() != 0) sched_yield();
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(500);

  explicit Helpers(int64_t count) : count_(count > 0 ? count : 0), pid_(getpid()) {
    for (int64_t i = 0; i < count_; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now;
      const auto since = std::chrono::steady_clock::now();
      while ((now = generation_.load()) == seen) {
        if (std::chrono::steady_clock::now() - since < kSpin) {
          sched_yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = now;
      // Announce first, then look: a caller clears current_ before it waits for inside_ to drop to zero.
      inside_.fetch_add(1);
      if (Job* job = current_.load()) job->Drain();
      inside_.fetch_sub(1);
    }
  }

  const int64_t count_;
  const pid_t pid_;  // the process whose helpers these are
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<Job*> current_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> inside_{0};
};

// Runs every chunk of `job` and returns when all are done: on this thread alone unless `share`, else also on the
// helpers, as many as XLA's pool has threads (or $JAXLLAMA_KERNEL_THREADS, if fewer: where a CPU quota is below
// the cores the process sees, spinning helpers would spend it), less this one.
inline void RunJob(XLA_FFI_CallFrame* frame, Job& job, bool share) {
  if (!share) return job.Drain();
  static const int64_t threads = [frame] {
    const char* limit = std::getenv("JAXLLAMA_KERNEL_THREADS");
    const XLA_FFI_Api* api = frame->api;
    int64_t n = 0;
    XLA_FFI_ThreadPool_NumThreads_Args count;
    std::memset(&count, 0, sizeof(count));
    count.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
    count.ctx = frame->ctx;
    count.num_threads = &n;
    if (XLA_FFI_Error* error = api->XLA_FFI_ThreadPool_NumThreads(&count)) {
      Discard(api, error);
      n = 0;
    }
    const int64_t cap = limit ? std::atoll(limit) : 0;  // unset, empty or not a positive number: no cap
    return cap > 0 ? std::min(n, cap) : n;
  }();
  Helpers::Get(threads).Run(job);
}

}  // namespace jaxllama
