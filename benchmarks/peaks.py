"""What this CPU's cores do from registers, per form of product the CPU kernels use: the ceiling each kernel's
figures are a fraction of. A C++ loop of 12 independent accumulators (no memory traffic), compiled as the kernels
are (`-O3 -march=native`, or JAXLLAMA_CPU_MARCH's target), run on every core at once:

- float32 FMAs (`vfmadd`, 8 lanes or 16 with AVX-512): the float32 and bfloat16 products' arithmetic;
- int16 pairs (`pmaddwd` + add, or VNNI's `vpdpwssd`): q8_0's;
- int8 quads as w8a8 sums them (VNNI's `vpdpbusd`; on AVX2 without it llama.cpp's sequence: `vpsignb` twice,
  `pmaddubsw`, `pmaddwd`, add);
- bfloat16 pairs (`vdpbf16ps`), where the CPU has AVX-512 BF16;
- int16 pairs and int8 quads in Q8_0's blocks (`*_in_blocks`): the same loops, each block of 32 inputs' integer sum
  then added in float as the quantized products add it (converted, times its two scales' product, read from memory
  as a tile reads them, by an FMA). The ceiling the block format itself leaves a kernel, before any weight is
  loaded or widened: on a CPU whose integer and float arithmetic share their pipes, below the bare form's peak.

Counts multiply-adds x 2 as operations (G(FL)OP/s), as `matmul_bench` counts a product's.

    python -m benchmarks.peaks [--seconds 1.0] [--runs 3]   (each form's best run)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import fire

from jaxllama.backends.cpu import matmul
from jaxllama.backends.cpu.library import MARCH

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

constexpr int kAcc = 12;
volatile float g_sink;  // every loop's result lands here: none may be dropped as unused

#if defined(__AVX512F__)
typedef __m512 F; typedef __m512i I;
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SETF(x) _mm512_set1_ps(x)
#define SETI(x) _mm512_set1_epi32(x)
#define CONVERT(x) _mm512_cvtepi32_ps(x)
constexpr int kBytes = 64;
#else
typedef __m256 F; typedef __m256i I;
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SETF(x) _mm256_set1_ps(x)
#define SETI(x) _mm256_set1_epi32(x)
#define CONVERT(x) _mm256_cvtepi32_ps(x)
constexpr int kBytes = 32;
#endif

// Each returns multiply-adds done; `sink` keeps the compiler from dropping the loop.
static double Fma(long n, float* sink) {
  F acc[kAcc]; for (int i = 0; i < kAcc; ++i) acc[i] = SETF(i);
  const F a = SETF(0.999f), b = SETF(1e-7f);
  for (long k = 0; k < n; ++k) for (int i = 0; i < kAcc; ++i) acc[i] = FMA(acc[i], a, b);
  for (int i = 1; i < kAcc; ++i) acc[0] = FMA(acc[0], a, acc[i]);
  std::memcpy(sink, &acc[0], sizeof(float));
  return double(n) * kAcc * (kBytes / 4);
}

static I Pairs(I acc, I a, I b) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return _mm512_dpwssd_epi32(acc, a, b);
#elif defined(__AVX512F__)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static I Quads(I acc, I u, I s) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return _mm512_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512F__)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(u), s), _mm512_set1_epi16(1)));
#else
  const __m256i m = _mm256_sign_epi8(u, u), t = _mm256_sign_epi8(s, u);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(m, t), _mm256_set1_epi16(1)));
#endif
}

template <I (*Op)(I, I, I)>
static double Integer(long n, int per_lane, float* sink) {
  I acc[kAcc]; for (int i = 0; i < kAcc; ++i) acc[i] = SETI(i);
  const I a = SETI(0x01020304), b = SETI(0x05060708);
  // each step's operand is its accumulator: a chain the compiler cannot sum in closed form
  for (long k = 0; k < n; ++k) for (int i = 0; i < kAcc; ++i) acc[i] = Op(acc[i], acc[i], b);
  for (int i = 1; i < kAcc; ++i) acc[0] = Op(acc[0], acc[i], a);
  std::memcpy(sink, &acc[0], sizeof(float));
  return double(n) * kAcc * (kBytes / 4) * per_lane;
}

// As Integer, with a block's float work every kQBlock inputs, as a tile does it: each accumulator's block sum
// converted, times the product of its columns' weight scales and its row's input scale (a vector and a broadcast,
// from memory), added by an FMA to a float sum.
constexpr int kQBlock = Q_BLOCK;  // the kernels' block (`matmul.Q_BLOCK`), given by the build
template <I (*Op)(I, I, I)>
static double InBlocks(long n, int per_lane, float* sink) {
  const int steps = kQBlock / per_lane;  // Op's per accumulator and block
  I acc[kAcc]; F sum[kAcc];
  for (int i = 0; i < kAcc; ++i) { acc[i] = SETI(i); sum[i] = SETF(0.0f); }
  const I b = SETI(0x05060708);
  alignas(64) float scales[64][kBytes / 4], x_scales[64];
  for (int j = 0; j < 64; ++j) { x_scales[j] = 1e-9f * (j + 1); for (float& v : scales[j]) v = 1e-3f * (j + 1); }
  for (long k = 0; k < n; ++k) {
    for (int s = 0; s < steps; ++s) for (int i = 0; i < kAcc; ++i) acc[i] = Op(acc[i], acc[i], b);
    // a tile's accumulators: kAcc / 2 rows (each its input scale) x 2 vectors of columns (each its weight scales)
    F scale[2];
    std::memcpy(&scale[0], scales[k & 63], sizeof(F));
    std::memcpy(&scale[1], scales[(k + 1) & 63], sizeof(F));
    for (int i = 0; i < kAcc; ++i)
      sum[i] = FMA(CONVERT(acc[i]), scale[i & 1] * SETF(x_scales[(k + i / 2) & 63]), sum[i]);
  }
  for (int i = 1; i < kAcc; ++i) sum[0] = sum[0] + sum[i] + CONVERT(acc[i]);
  std::memcpy(sink, &sum[0], sizeof(float));
  return double(n) * steps * kAcc * (kBytes / 4) * per_lane;
}

#if defined(__AVX512BF16__)
static double Bf16(long n, float* sink) {
  __m512 acc[kAcc]; for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(i);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x33d633d6);
  for (long k = 0; k < n; ++k) for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  for (int i = 1; i < kAcc; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  std::memcpy(sink, &acc[0], sizeof(float));
  return double(n) * kAcc * 16 * 2;
}
#endif

template <typename Fn>
static void Report(const char* name, Fn fn, double seconds, int threads) {
  long n = 1 << 16;
  for (;;) {  // the iterations that take about `seconds` on one core
    float sink;
    const auto t0 = std::chrono::steady_clock::now();
    fn(n, &sink);
    g_sink = g_sink + sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > seconds / 4 || n > (1L << 40)) { n = long(n * seconds / (s > 0 ? s : 1e-9)); break; }
    n *= 4;
  }
  std::vector<double> done(threads);
  std::vector<float> sinks(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { done[t] = fn(n, &sinks[t]); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total = 0; for (double d : done) total += d;
  for (float x : sinks) g_sink = g_sink + x;
  std::printf("%s %.1f\n", name, 2 * total / s / 1e9);
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  const int threads = std::thread::hardware_concurrency();
  Report("float32_fma", Fma, seconds, threads);
  Report("int16_pairs", [](long n, float* s) { return Integer<Pairs>(n, 2, s); }, seconds, threads);
  Report("int8_quads", [](long n, float* s) { return Integer<Quads>(n, 4, s); }, seconds, threads);
  Report("int16_pairs_in_blocks", [](long n, float* s) { return InBlocks<Pairs>(n, 2, s); }, seconds, threads);
  Report("int8_quads_in_blocks", [](long n, float* s) { return InBlocks<Quads>(n, 4, s); }, seconds, threads);
#if defined(__AVX512BF16__)
  Report("bf16_pairs", Bf16, seconds, threads);
#endif
  return 0;
}
"""

FORMS = {
    "float32_fma": "float32 FMAs (float32 and bfloat16 products)",
    "int16_pairs": "int16 pairs (q8_0)",
    "int8_quads": "int8 quads (w8a8)",
    "bf16_pairs": "bfloat16 pairs (vdpbf16ps)",
    "int16_pairs_in_blocks": "int16 pairs in Q8_0 blocks (q8_0's ceiling)",
    "int8_quads_in_blocks": "int8 quads in Q8_0 blocks (w8a8's ceiling)",
}
# The ceiling a block-quantized product's arithmetic leaves, per bare form.
IN_BLOCKS = {"int16_pairs": "int16_pairs_in_blocks", "int8_quads": "int8_quads_in_blocks"}


def measure(seconds: float = 1.0, runs: int = 3) -> dict[str, float]:
    """{form: G(FL)OP/s on all cores} for each form this CPU runs: the best of `runs` runs, as another process
    sharing a core for a moment lowers one run's figure by as much as half."""
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    march = os.environ.get(MARCH) or "native"
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peaks.cc", Path(tmp) / "peaks"
        source.write_text(SOURCE)
        command = [*compiler, "-O3", f"-march={march}", f"-DQ_BLOCK={matmul.Q_BLOCK}", "-std=c++17", "-pthread"]
        command += [str(source), "-o", str(binary)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        best: dict[str, float] = {}
        for _ in range(runs):
            out = subprocess.run([str(binary), str(seconds)], check=True, capture_output=True, text=True).stdout
            for name, value in (line.split() for line in out.splitlines()):
                best[name] = max(best.get(name, 0.0), float(value))
    return best


def main(seconds: float = 1.0, runs: int = 3) -> None:
    march = os.environ.get(MARCH) or "native"
    print(f"-march={march}, {os.cpu_count()} cores, from registers:")
    for name, value in measure(seconds, runs).items():
        print(f"  {FORMS[name]:<48} {value:8.1f} G(FL)OP/s")


if __name__ == "__main__":
    fire.Fire(main)
