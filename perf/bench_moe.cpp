// One DeepSeek-V3 MoE layer's routed experts at decode (dsv3-mini shapes: 64 experts, top 8,
// hidden 2048, expert FFN 512), bf16 and fp8, both ways the decoder can run them: per expert
// (gate, up, silu, down launches for each active expert, the plan known on the host) and grouped
// (the device plan and one launch per projection over every active expert; moe.cl).
// bytes_per_second counts the active experts' weight bytes.
#include <benchmark/benchmark.h>

#include <array>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/dtype.h"
#include "runtime/ops.h"
#include "runtime/ops_moe.h"
#include "runtime/tensor.h"

namespace clshard {
namespace {

constexpr uint32_t kE = 64, kTopK = 8, kH = 2048, kF = 512;

Device& device() {
  static DeviceManager mgr(DeviceSelection{});
  return mgr[0];
}

struct Layer {
  ops::GroupedExperts grouped;
  std::vector<std::array<Weight, 3>> w, s;
};

Weight weight_of(Device& dev, const uint8_t* data, size_t bytes, DType dt, int64_t N, int64_t K) {
  Weight w;
  w.mem = dev.alloc(bytes, CL_MEM_READ_ONLY);
  dev.write(w.mem, data, bytes);
  w.dtype = dt;
  w.shape = {N, K};
  w.name = "bench.expert";
  return w;
}

const Layer& layer(bool fp8) {
  static Layer layers[2];
  Layer& L = layers[fp8];
  if (L.grouped) return L;
  Device& dev = device();
  const DType dt = fp8 ? DType::F8_E4M3 : DType::BF16;
  const size_t es = fp8 ? 1 : 2;
  std::mt19937 rng(1);
  std::vector<uint8_t> packed;
  std::vector<uint64_t> table(size_t(kE) * 6, 0);
  for (uint32_t e = 0; e < kE; ++e) {
    std::array<Weight, 3> w, s;
    for (uint32_t m = 0; m < 3; ++m) {
      const uint32_t N = m == 2 ? kH : kF, K = m == 2 ? kF : kH;
      // Weights of a checkpoint's magnitudes: bf16 from N(0, 0.02), e4m3 codes of random sign
      // and mantissa with exponents 4-10 (1/8 to 15), none a NaN or a denormal. (Random bytes had
      // put bf16 denormals among the weights, whose products took the CPU's microcode assists:
      // the grouped bf16 experts timed at 1.4-3.5 GB/s here, where a decode step reads them at
      // 14-16.)
      std::vector<uint8_t> bytes(size_t(N) * K * es);
      std::normal_distribution<float> normal(0.0f, 0.02f);
      for (size_t i = 0; i < size_t(N) * K; ++i) {
        if (fp8) {
          const uint32_t r = rng();
          bytes[i] = uint8_t((r & 0x80) | ((4 + (r >> 8) % 7) << 3) | ((r >> 16) & 7));
        } else {
          const uint16_t b = f32_to_bf16(normal(rng));
          std::memcpy(&bytes[2 * i], &b, 2);
        }
      }
      table[e * 6 + m] = packed.size() / es;
      packed.insert(packed.end(), bytes.begin(), bytes.end());
      w[m] = weight_of(dev, bytes.data(), bytes.size(), dt, N, K);
      if (fp8) w[m].fp8_nan_free = fp8_nan_free(bytes.data(), bytes.size());
      if (fp8) {
        std::vector<float> sc(size_t(N / 128) * (K / 128), 1.0f / 448);
        table[e * 6 + 3 + m] = packed.size() / 4;
        const auto* p = reinterpret_cast<const uint8_t*>(sc.data());
        packed.insert(packed.end(), p, p + sc.size() * 4);
        s[m] = weight_of(dev, p, sc.size() * 4, DType::F32, N / 128, K / 128);
      }
    }
    L.w.push_back(w);
    L.s.push_back(s);
  }
  L.grouped.mem = dev.alloc(packed.size(), CL_MEM_READ_ONLY);
  dev.write(L.grouped.mem, packed.data(), packed.size());
  L.grouped.table = dev.alloc(table.size() * 8, CL_MEM_READ_ONLY);
  dev.write(L.grouped.table, table.data(), table.size() * 8);
  L.grouped.dtype = dt;
  L.grouped.fp8_nan_free = fp8;  // exponents 4-10: never e4m3's NaN (scanned per weight above)
  L.grouped.n_experts = kE;
  L.grouped.hidden = kH;
  L.grouped.inter = kF;
  L.grouped.pairs_aligned = ops::grouped_rows_aligned(table, kH, kF);
  return L;
}

void run(benchmark::State& state, bool fp8, bool grouped) {
  const uint32_t T = uint32_t(state.range(0)), S = T * kTopK;
  Device& dev = device();
  const Layer& L = layer(fp8);
  std::mt19937 rng(T);
  std::vector<int32_t> ids(S);
  for (uint32_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(kE);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + kTopK, ids.begin() + t * kTopK);
  }
  const ops::ExpertBatches eb = ops::group_by_expert(ids, T, kTopK, kE);
  std::vector<float> xh(size_t(S) * kH, 0.01f);
  cl::Mem x = dev.alloc(xh.size() * 4), idb = dev.alloc(S * 4);
  dev.write(x, xh.data(), xh.size() * 4);
  dev.write(idb, ids.data(), S * 4);
  cl::Mem gu = dev.alloc(size_t(S) * 2 * kF * 4), y = dev.alloc(size_t(S) * kH * 4);
  auto lin = [&](const cl::Mem& in, uint32_t off, uint32_t ld, uint32_t e, uint32_t m,
                 uint32_t y_off, uint32_t ldy, const cl::Mem& out, uint32_t n) {
    if (fp8)
      ops::linear_fp8(dev, in, off, ld, L.w[e][m], L.s[e][m], out, y_off, ldy, n);
    else
      ops::linear(dev, in, off, ld, L.w[e][m], nullptr, out, y_off, ldy, n);
  };
  auto step = [&] {
    if (grouped) {
      const ops::GroupedPlan plan = ops::plan_experts(dev, idb, T, kTopK, kE);
      ops::moe_grouped_linear(dev, x, kH, &plan.src_token.mem(), L.grouped, 0, 2, plan, gu,
                              2 * kF);
      ops::silu_mul(dev, gu, 0, 2 * kF, gu, kF, 2 * kF, gu, 2 * kF, S, kF);
      ops::moe_grouped_linear(dev, gu, 2 * kF, nullptr, L.grouped, 2, 1, plan, y, kH);
    } else {
      for (uint32_t e = 0; e < kE; ++e) {
        const uint32_t b = eb.expert_offsets[e], n = eb.expert_offsets[e + 1] - b;
        if (n == 0) continue;
        lin(x, b * kH, kH, e, 0, b * 2 * kF, 2 * kF, gu, n);
        lin(x, b * kH, kH, e, 1, b * 2 * kF + kF, 2 * kF, gu, n);
        ops::silu_mul(dev, gu, b * 2 * kF, 2 * kF, gu, b * 2 * kF + kF, 2 * kF, gu, 2 * kF, n, kF);
        lin(gu, b * 2 * kF, 2 * kF, e, 2, b * kH, kH, y, n);
      }
    }
    dev.finish();
  };
  step();
  for (auto _ : state) step();
  uint32_t active = 0;
  for (uint32_t e = 0; e < kE; ++e) active += eb.expert_offsets[e + 1] > eb.expert_offsets[e];
  state.SetBytesProcessed(int64_t(double(state.iterations()) * active * 3.0 * kH * kF *
                                  (fp8 ? 1 : 2)));
  state.counters["experts"] = active;
}

void BM_MoePerExpertBf16(benchmark::State& s) { run(s, false, false); }
void BM_MoeGroupedBf16(benchmark::State& s) { run(s, false, true); }
void BM_MoePerExpertFp8(benchmark::State& s) { run(s, true, false); }
void BM_MoeGroupedFp8(benchmark::State& s) { run(s, true, true); }

#define TOKENS Arg(1)->Arg(8)->Arg(16)->ArgName("T")->Unit(benchmark::kMicrosecond)->UseRealTime()
BENCHMARK(BM_MoePerExpertBf16)->TOKENS;
BENCHMARK(BM_MoeGroupedBf16)->TOKENS;
BENCHMARK(BM_MoePerExpertFp8)->TOKENS;
BENCHMARK(BM_MoeGroupedFp8)->TOKENS;

}  // namespace
}  // namespace clshard

BENCHMARK_MAIN();
