// Each op with a GPU-shaped variant, timed in both kernel shapes on the first OpenCL device (or
// the one --platform/--type picks): the CPU shape (a work-item per row or head, local size 1) and
// the GPU shape (work-groups of lanes, runtime/kernel_tuning.cpp's row for the device). Memory-
// bound ops print GB/s: the bytes they must move (weights, activations read and written, KV
// cache rows read) over the median time.
// Usage: bench_kernel_shapes [--quick] [--platform SUBSTRING] [--type cpu|gpu|any]
//                            [--set FIELD=VALUE ...] [--tune] [--save]
// --set overrides one KernelTuning field for this run (e.g. --set attn_wg=128). --tune times the
// GPU shape over candidate values of each field in turn (the ops that read it, the other fields
// held) and keeps the fastest. --save writes the resulting row as this device's entry of the
// tuning file in the kernel cache directory (runtime/kernel_tuning.h), which every later run on
// the device reads.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/kernel_tuning.h"
#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

cl::Mem random_buffer(Device& dev, size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  cl::Mem m = dev.alloc(n * 4);
  dev.write(m, v.data(), n * 4);
  return m;
}

cl::Mem upload_u32(Device& dev, const std::vector<uint32_t>& v) {
  cl::Mem m = dev.alloc(v.size() * 4);
  dev.write(m, v.data(), v.size() * 4);
  return m;
}

Weight bf16_weight(Device& dev, std::vector<int64_t> shape, uint32_t seed) {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  Weight w;
  w.dtype = DType::BF16;
  w.shape = shape;
  w.name = "bench";
  w.mem = dev.alloc(n * 2);
  dev.write(w.mem, v.data(), n * 2);
  return w;
}

// B decode rows, one new token each at position ctx - 1, every row's pages its own and scattered.
struct DecodeRows {
  cl::Mem row, pos, lookup;
  ops::StepTokens st;
};
DecodeRows decode_rows(Device& dev, uint32_t B, uint32_t ctx, uint32_t page_size) {
  const uint32_t ppr = (ctx + page_size - 1) / page_size;
  std::vector<uint32_t> row(B), pos(B, ctx - 1), lut(size_t(B) * ppr);
  for (uint32_t b = 0; b < B; ++b) row[b] = b;
  // Page j of row b is page j * B + b: neighbouring positions of a row are pages apart.
  for (uint32_t b = 0; b < B; ++b)
    for (uint32_t j = 0; j < ppr; ++j) lut[size_t(b) * ppr + j] = j * B + b;
  DecodeRows d;
  d.row = upload_u32(dev, row);
  d.pos = upload_u32(dev, pos);
  d.lookup = upload_u32(dev, lut);
  d.st = ops::StepTokens{d.row, d.pos, d.lookup, B, ppr, page_size};
  return d;
}

struct Row {
  std::string op, size;
  double bytes = 0;  // 0: not memory-bound, no GB/s
  std::function<void()> run;
  std::vector<std::string> fields;  // the KernelTuning fields its GPU shape reads
};

// The values --tune tries per field, one field at a time (the others held), in this order.
const std::vector<std::pair<std::string, std::vector<uint64_t>>>& tune_candidates() {
  static const std::vector<std::pair<std::string, std::vector<uint64_t>>> c = {
      {"norm_wg", {32, 64, 128, 256}},     {"rope_wg", {32, 64, 128, 256}},
      {"linear_wg", {32, 64, 128, 256}},   {"linear_rows", {1, 2, 4, 8}},
      {"attn_wg", {32, 64, 128, 256}},     {"attn_tile", {8, 16, 32}},
      {"attn_heads", {1, 2, 4, 8}},        {"attn_split", {256, 512, 1024, 2048}},
      {"mla_wg", {64, 128, 256}},          {"mla_tile", {4, 8, 16}},
      {"mla_heads", {4, 8, 16, 32}},       {"route_wg", {32, 64, 128, 256}}};
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  DeviceSelection sel;
  std::vector<std::string> sets;
  bool tune = false, save = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else if (std::strcmp(argv[i], "--platform") == 0 && i + 1 < argc) sel.platform = argv[++i];
    else if (std::strcmp(argv[i], "--type") == 0 && i + 1 < argc) sel.type = argv[++i];
    else if (std::strcmp(argv[i], "--set") == 0 && i + 1 < argc) sets.push_back(argv[++i]);
    else if (std::strcmp(argv[i], "--tune") == 0) tune = true;
    else if (std::strcmp(argv[i], "--save") == 0) save = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--platform SUBSTRING] [--type cpu|gpu|any] "
                   "[--set FIELD=VALUE ...] [--tune] [--save]\n",
                   argv[0]);
      return 2;
    }
  }
  const int reps = quick ? 3 : 9;
  DeviceManager mgr(sel);
  Device& dev = mgr[0];
  print_device(dev);
  KernelTuning tuning = dev.tuning();
  for (const std::string& a : sets) {
    const size_t eq = a.find('=');
    uint64_t v = 0;
    try {
      v = eq == std::string::npos ? 0 : std::stoull(a.substr(eq + 1));
    } catch (...) {
      v = 0;
    }
    if (eq == std::string::npos || v == 0 ||
        !set_kernel_tuning_field(tuning, a.substr(0, eq), v)) {
      std::fprintf(stderr, "--set %s: expected FIELD=POSITIVE_INTEGER with a KernelTuning field "
                   "(runtime/device.h)\n", a.c_str());
      return 2;
    }
  }
  dev.set_tuning(tuning);
  auto print_tuning = [&dev] {
    std::string line;
    for (const std::string& f : kernel_tuning_fields())
      line += (line.empty() ? "" : ", ") + f + " " + std::to_string(kernel_tuning_field(dev.tuning(), f));
    std::printf("tuning: %s\n", line.c_str());
  };
  print_tuning();

  std::vector<Row> rows;
  // Buffers live as long as the rows that use them.
  std::vector<cl::Mem> keep;
  std::vector<Weight> weights;
  weights.reserve(8);
  std::vector<DecodeRows> steps;
  steps.reserve(8);

  // RMSNorm: R rows of H (read x, write y, read the bf16 weight once).
  for (auto [R, H] : {std::pair<uint32_t, uint32_t>{1, 8192}, {64, 4096}, {512, 4096}}) {
    if (quick && R > 64) continue;
    cl::Mem x = random_buffer(dev, size_t(R) * H, 1), y = dev.alloc(size_t(R) * H * 4);
    weights.push_back(bf16_weight(dev, {H}, 2));
    const Weight& w = weights.back();
    keep.insert(keep.end(), {x, y});
    rows.push_back({"rmsnorm", "R=" + std::to_string(R) + " H=" + std::to_string(H),
                    double(R) * H * 8 + H * 2.0,
                    [&dev, x, y, &w, R, H] { ops::rmsnorm(dev, x, 0, H, nullptr, w, y, 0, H, R, H, 1e-5f); },
                    {"norm_wg"}});
  }

  // GEMV, bf16 weight N x K (the weights dominate the bytes).
  {
    const uint32_t N = quick ? 4096 : 8192, K = 2048;
    weights.push_back(bf16_weight(dev, {N, K}, 3));
    const Weight& w = weights.back();
    cl::Mem x = random_buffer(dev, K, 4), y = dev.alloc(N * 4);
    keep.insert(keep.end(), {x, y});
    rows.push_back({"linear M=1 bf16", "N=" + std::to_string(N) + " K=" + std::to_string(K),
                    double(N) * K * 2, [&dev, x, y, &w, N, K] {
                      ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, 1);
                    },
                    {"linear_wg", "linear_rows"}});
  }

  // Llama-8B-like attention layer: 32 query heads, 8 KV heads, head_dim 128, 128-token pages.
  const uint32_t nh = 32, nkv = 8, hd = 128, page = 128;
  // RoPE + KV store for T tokens (read and write q, k; read v; write k, v to the cache).
  for (uint32_t T : {1u, 64u}) {
    const uint32_t ld = (nh + 2 * nkv) * hd, ctx = 256;
    steps.push_back(decode_rows(dev, T, ctx, page));
    const DecodeRows& d = steps.back();
    const size_t pages = size_t(T) * d.st.pages_per_row + 1;
    cl::Mem qkv = random_buffer(dev, size_t(T) * ld, 5),
            cache = dev.alloc(pages * 2 * page * nkv * hd * 4);
    std::vector<float> inv(hd / 2);
    for (uint32_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(500000.0f, -float(2 * i) / hd);
    cl::Mem invm = dev.alloc(inv.size() * 4);
    dev.write(invm, inv.data(), inv.size() * 4);
    keep.insert(keep.end(), {qkv, cache, invm});
    rows.push_back({"rope_store_kv", "T=" + std::to_string(T),
                    double(T) * ((nh + nkv) * hd * 8.0 + nkv * hd * 4.0 + 2 * nkv * hd * 4.0),
                    [&dev, qkv, cache, invm, &d, ld] {
                      ops::rope_store_kv(dev, qkv, ld, nh, nkv, hd, invm, invm, 0xffffffffu, d.st,
                                         cache);
                    },
                    {"rope_wg"}});
  }

  // Decode attention: B rows of one new token at context ctx (reads ctx K and V rows of the KV
  // head per row).
  for (auto [B, ctx] : {std::pair<uint32_t, uint32_t>{1, 4096}, {8, 4096}, {32, 1024}}) {
    if (quick && B * ctx > 8192) continue;
    steps.push_back(decode_rows(dev, B, ctx, page));
    const DecodeRows& d = steps.back();
    const size_t pages = size_t(B) * d.st.pages_per_row + 1;
    cl::Mem q = random_buffer(dev, size_t(B) * nh * hd, 6),
            cache = random_buffer(dev, pages * 2 * page * nkv * hd, 7, 0.5f),
            out = dev.alloc(size_t(B) * nh * hd * 4);
    keep.insert(keep.end(), {q, cache, out});
    rows.push_back({"paged_attention decode", "B=" + std::to_string(B) + " ctx=" + std::to_string(ctx),
                    double(B) * ctx * 2 * nkv * hd * 4, [&dev, q, cache, out, &d] {
                      ops::paged_attention(dev, q, nh * hd, cache, d.st, nh, nkv, hd, 0.088f, out,
                                           nh * hd);
                    },
                    {"attn_wg", "attn_tile", "attn_heads", "attn_split"}});
  }

  // MLA absorbed decode attention over 576-wide latent rows (DeepSeek-V3: 128 heads; 16 with
  // --quick). Every head reads the same rows: bytes are the rows once per request.
  {
    ops::MlaShape s;
    s.n_heads = quick ? 16 : 128;
    s.kv_lora = 512;
    s.rope = 64;
    s.nope = 128;
    s.v = 128;
    for (auto [B, ctx] : {std::pair<uint32_t, uint32_t>{1, 4096}, {16, 2048}}) {
      if (quick && B > 1) continue;
      const uint32_t mpage = 64;
      steps.push_back(decode_rows(dev, B, ctx, mpage));
      const DecodeRows& d = steps.back();
      const size_t pages = size_t(B) * d.st.pages_per_row + 1;
      cl::Mem qf = random_buffer(dev, size_t(B) * s.n_heads * s.row(), 8, 0.1f),
              cache = random_buffer(dev, pages * mpage * s.row(), 9, 0.5f),
              out = dev.alloc(size_t(B) * s.n_heads * s.kv_lora * 4);
      keep.insert(keep.end(), {qf, cache, out});
      rows.push_back({"mla_decode_attention",
                      "B=" + std::to_string(B) + " ctx=" + std::to_string(ctx) + " heads=" +
                          std::to_string(s.n_heads),
                      double(B) * ctx * s.row() * 4, [&dev, qf, cache, out, &d, s] {
                        ops::mla_decode_attention(dev, qf, cache, d.st, s, 0.07f, out);
                      },
                      {"mla_wg", "mla_tile", "mla_heads", "attn_split"}});
    }
  }

  // DeepSeek-V3's router: 256 experts in 8 groups, top 4 groups, top 8 experts, for T tokens.
  for (uint32_t T : {1u, 256u}) {
    ops::RouterConfig rc;
    rc.n_experts = 256;
    rc.top_k = 8;
    rc.n_group = 8;
    rc.topk_group = 4;
    rc.norm_topk_prob = true;
    rc.routed_scaling_factor = 2.5f;
    cl::Mem logits = random_buffer(dev, size_t(T) * rc.n_experts, 10, 3.0f),
            ids = dev.alloc(size_t(T) * rc.top_k * 4), wts = dev.alloc(size_t(T) * rc.top_k * 4);
    keep.insert(keep.end(), {logits, ids, wts});
    rows.push_back({"moe_route", "T=" + std::to_string(T) + " E=256 top8", 0.0,
                    [&dev, logits, ids, wts, rc, T] {
                      ops::moe_route(dev, logits, nullptr, T, rc, ids, wts);
                    },
                    {"route_wg"}});
  }

  auto time_row = [&](const Row& r) {
    return median_time(reps, [&] {
      r.run();
      dev.finish();
    });
  };
  const KernelShape own = dev.kernel_shape();  // before --tune forces the GPU shape
  if (tune) {
    // One field at a time over its candidates, the GPU shape, the summed medians of the ops that
    // read it; a candidate the device cannot build or launch (local memory, work-group size) is
    // skipped. A change must win by 2% to replace the current value (noise).
    dev.set_kernel_shape(KernelShape::WorkGroups);
    std::printf("\ntuning the GPU shape:\n");
    for (const auto& [field, values] : tune_candidates()) {
      std::vector<const Row*> users;
      for (const Row& r : rows)
        if (std::find(r.fields.begin(), r.fields.end(), field) != r.fields.end()) users.push_back(&r);
      if (users.empty()) continue;
      auto total = [&](const KernelTuning& t) {
        dev.set_tuning(t);
        double sum = 0;
        for (const Row* r : users) sum += time_row(*r);
        return sum;
      };
      KernelTuning best = dev.tuning();
      double best_s = total(best);
      std::printf("  %-12s %6llu: %9.3f ms", field.c_str(),
                  (unsigned long long)kernel_tuning_field(best, field), best_s * 1e3);
      for (uint64_t v : values) {
        KernelTuning t = best;
        if (kernel_tuning_field(t, field) == v) continue;
        set_kernel_tuning_field(t, field, v);
        try {
          const double s = total(t);
          std::printf(" | %llu: %.3f", (unsigned long long)v, s * 1e3);
          if (s < best_s * 0.98) {
            best = t;
            best_s = s;
          }
        } catch (const std::exception& e) {
          std::printf(" | %llu: failed", (unsigned long long)v);
        }
      }
      dev.set_tuning(best);
      std::printf(" -> %llu\n", (unsigned long long)kernel_tuning_field(best, field));
      std::fflush(stdout);
    }
  }
  if (tune) print_tuning();
  if (save) {
    save_kernel_tuning(dev.info(), dev.tuning());
    std::printf("saved this device's tuning entry to %s\n", kernel_tuning_file().c_str());
  }

  std::printf("\n%-24s %-26s %12s %10s %12s %10s %8s\n", "op", "size", "cpu shape ms", "GB/s",
              "gpu shape ms", "GB/s", "gpu/cpu");
  for (const Row& r : rows) {
    double ms[2];
    for (int i = 0; i < 2; ++i) {
      dev.set_kernel_shape(i == 0 ? KernelShape::Chunks : KernelShape::WorkGroups);
      ms[i] = 1e3 * time_row(r);
    }
    auto gbs = [&](double t) { return r.bytes > 0 ? r.bytes / (t * 1e-3) / 1e9 : 0.0; };
    std::printf("%-24s %-26s %12.3f %10.1f %12.3f %10.1f %8.2f\n", r.op.c_str(), r.size.c_str(),
                ms[0], gbs(ms[0]), ms[1], gbs(ms[1]), ms[1] / ms[0]);
    std::fflush(stdout);
  }
  dev.set_kernel_shape(own);
  std::printf("\nThis device's own shape: %s. Times are medians of %d runs with a finish each "
              "(launch latency included).\n",
              kernel_shape_name(own), reps);
  return 0;
}
