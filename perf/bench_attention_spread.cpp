// Decode attention over a long context as the scores spread: llama3-1b's heads (32 query heads on
// 8 KV heads of 64), one token at --context positions, 16 layers' launches, with queries and keys
// drawn N(0, f^2) so that the scores' standard deviation is f^2 / 8 * sqrt(64) = f^2. Spreads of
// 16-36 put many positions 87-104 below the max, where exp(s - max) would be an f32 denormal:
// before common.cl's softmax_exp flushed those weights, a decode attention there took 2.0-3.1x as
// long on the 2-core Xeon (microcode assists in exp and in every FMA taking the weight).
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"

using namespace clshard;
using namespace clshard::bench;

int main(int argc, char** argv) {
  CLI::App app{"Decode attention (llama3-1b's heads) at a long context over score spreads of 1 to "
               "900: the time of 16 layers' launches",
               "bench_attention_spread"};
  uint32_t context = 4096;
  int reps = 9;
  app.add_option("--context", context, "cached positions before the decode token")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--reps", reps, "timed repeats per spread (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  parse_args(app, argc, argv);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);

  const uint32_t nh = 32, nkv = 8, hd = 64, ld = (nh + 2 * nkv) * hd, page = 128;
  const uint32_t ppr = (context + 1 + page - 1) / page;
  std::vector<uint32_t> lut(ppr);
  for (uint32_t i = 0; i < ppr; ++i) lut[i] = i;
  const size_t cache_floats = size_t(ppr + 1) * 2 * page * nkv * hd;
  cl::Mem cache = dev.alloc(cache_floats * 4), lm = dev.alloc(lut.size() * 4);
  dev.write(lm, lut.data(), lut.size() * 4);
  std::vector<float> inv(hd / 2);
  for (uint32_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(500000.0f, -float(2 * i) / hd);
  cl::Mem invm = dev.alloc(inv.size() * 4);
  dev.write(invm, inv.data(), inv.size() * 4);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto rows = [&](size_t n, float f) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng) * f;
    return v;
  };
  const float scale = 1.0f / std::sqrt(float(hd));
  std::printf("%u cached positions, %u/%u heads of %u; 16 decode attentions per figure\n", context,
              nh, nkv, hd);
  std::printf("%14s %10s\n", "score std", "ms");
  for (float f : {1.0f, 4.0f, 6.0f, 8.0f, 10.0f, 30.0f}) {
    dev.fill_zero(cache, cache_floats * 4);
    // The context's keys and values (rows [q | k | v] roped and stored), then the decode token's.
    const std::vector<float> ctx_rows = rows(size_t(context) * ld, f);
    std::vector<uint32_t> zeros(context, 0), positions(context);
    for (uint32_t i = 0; i < context; ++i) positions[i] = i;
    cl::Mem cm = dev.alloc(ctx_rows.size() * 4), rm = dev.alloc(context * 4),
            pm = dev.alloc(context * 4);
    dev.write(cm, ctx_rows.data(), ctx_rows.size() * 4);
    dev.write(rm, zeros.data(), context * 4);
    dev.write(pm, positions.data(), context * 4);
    ops::rope_store_kv(dev, cm, ld, nh, nkv, hd, invm, invm, 0xffffffffu,
                       ops::StepTokens{rm, pm, lm, context, ppr, page}, cache);
    const std::vector<float> token = rows(ld, f);
    const uint32_t row0 = 0;
    cl::Mem qm = dev.alloc(ld * 4), r1 = dev.alloc(4), p1 = dev.alloc(4);
    dev.write(qm, token.data(), ld * 4);
    dev.write(r1, &row0, 4);
    dev.write(p1, &context, 4);
    const ops::StepTokens one{r1, p1, lm, 1, ppr, page};
    ops::rope_store_kv(dev, qm, ld, nh, nkv, hd, invm, invm, 0xffffffffu, one, cache);
    cl::Mem out = dev.alloc(nh * hd * 4);
    const double t = median_time(reps, [&] {
      for (int l = 0; l < 16; ++l)
        ops::paged_attention(dev, qm, ld, cache, one, nh, nkv, hd, scale, out, nh * hd);
      dev.finish();
    });
    std::printf("%14.0f %10.2f\n", double(f * f), t * 1e3);
  }
}
