// Kernel throughput on the first OpenCL device: memory bandwidth (the decode roofline), GEMV GB/s
// for f32 and bf16 weights, GEMM GFLOP/s at M = 1, 8, 64, 512, next to OpenBLAS sgemm, and the
// bf16-compute GEMM (model.compute_dtype: bf16) on llama3-1b's prefill shapes against the CPU's
// register-only f32 FMA and vdpbf16ps peaks measured in the same run, and the prefill GEMMs next to
// CLBlast's SGEMM and HGEMM on the same device (--clblast: only that).
// Usage: bench_kernels [--quick] [--gemm-bf16 [--tiles] [--rows M]] [--clblast [--rows M]]
//   --gemm-bf16: only the peaks and the bf16-compute GEMMs; --tiles: over several tile shapes too
//   (KernelTuning's gemm_bf16_packed_tm x gemm_bf16_packed_nv and gemm_bf16_tm x gemm_bf16_tn);
//   --rows: the GEMM's M (512).
#include <cblas.h>
#include <clblast.h>
#include <clblast_half.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

Weight random_weight(Device& dev, int64_t N, int64_t K, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  Weight w;
  w.dtype = dt;
  w.shape = {N, K};
  w.name = "bench";
  const size_t n = size_t(N) * K;
  if (dt == DType::BF16) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = f32_to_bf16(d(rng));
    w.mem = dev.alloc(n * 2);
    dev.write(w.mem, v.data(), n * 2);
  } else {
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    w.mem = dev.alloc(n * 4);
    dev.write(w.mem, v.data(), n * 4);
  }
  return w;
}

// llama3-1b's prefill GEMMs: y[M, N] = x[M, K] W^T.
struct GemmShape {
  const char* name;
  int64_t N, K;
};
constexpr GemmShape kPrefillShapes[] = {{"q/k/v 3072x2048", 3072, 2048},
                                        {"o 2048x2048", 2048, 2048},
                                        {"gate|up 16384x2048", 16384, 2048},
                                        {"down 2048x8192", 2048, 8192}};

// The bf16-compute GEMM at llama3-1b's prefill shapes (M = 512 tokens): the packed GEMM
// (bf16_packed.cl; what bf16 weights take from gemm_bf16_packed_rows rows) and linear_bf16's tiles
// (bf16_tile.cl; below those rows, and FP8 weights), each with vdpbf16ps where the device selects
// it and with the portable micro-kernel, the packed GEMM with AMX's tiles where the device selects
// them (ops::bf16_amx), and the f32-compute GEMM: GFLOP/s and the fraction of the
// bf16 peak. --tiles adds rows over other packed tiles (rows x vectors of 16 columns) and other
// tiles (rows x weight rows).
void gemm_bf16_section(Device& dev, int reps, bool tiles, uint32_t M) {
  // The host's peaks bound only a CPU device's GEMMs (on the H200 they made 2,800%).
  const ComputePeaks peaks = dev.is_cpu() ? measure_compute_peaks() : ComputePeaks{};
  auto pct = [&](double v) {
    return peaks.bf16_dot_gflops > 0 ? 100 * v / peaks.bf16_dot_gflops : 0;
  };
  const KernelTuning own = dev.tuning();
  // A row of the table: the packed and the tiled GEMM's tiles (0 x 0: that GEMM not timed).
  struct Row {
    uint32_t ptm, pnv, tm, tn;
  };
  std::vector<Row> rows = {
      {own.gemm_bf16_packed_tm, own.gemm_bf16_packed_nv, own.gemm_bf16_tm, own.gemm_bf16_tn}};
  if (tiles) {
    for (auto [a, b] : std::vector<std::pair<uint32_t, uint32_t>>{
             {4, 2}, {4, 3}, {4, 4}, {6, 3}, {6, 4}, {8, 2}, {8, 3}})
      if (a != own.gemm_bf16_packed_tm || b != own.gemm_bf16_packed_nv)
        rows.push_back({a, b, 0, 0});
    for (auto [a, b] : std::vector<std::pair<uint32_t, uint32_t>>{
             {4, 4}, {2, 8}, {8, 2}, {4, 6}, {6, 4}, {3, 8}, {4, 2}, {2, 4}, {8, 3}})
      if (a != own.gemm_bf16_tm || b != own.gemm_bf16_tn) rows.push_back({0, 0, a, b});
  }
  auto label = [](uint32_t a, uint32_t b) {
    return a ? std::to_string(a) + "x" + std::to_string(b) : std::string("-");
  };
  std::printf("\nbf16-compute GEMM (compute_dtype bf16), M=%u, GFLOP/s%s:\n", M,
              peaks.bf16_dot_gflops > 0 ? " (% of the bf16 peak)" : "");
  std::printf("  %-20s %-6s %-6s %13s %13s %13s %13s %13s %13s\n", "N x K", "packed", "tiles",
              "packed AMX", "packed dot", "tiles dot", "packed port.", "tiles port.",
              "f32 compute");
  const bool amx = ops::bf16_amx(dev);
  // One GEMM's GFLOP/s with the tuning t (packed_rows 1: the packed GEMM; 0: the tiles).
  auto time_gemm = [&](const KernelTuning& t, double flops, const std::function<void()>& run) {
    dev.set_tuning(t);
    const double g = flops /
                     median_time(reps,
                                 [&] {
                                   run();
                                   dev.finish();
                                 }) /
                     1e9;
    dev.set_tuning(own);
    return g;
  };
  auto print_rows = [&](const char* name, double flops,
                        const std::function<void(ComputeDType)>& gemm) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const Row& row = rows[r];
      // The columns: packed with AMX's tiles (16 rows, where the device has them), packed and
      // tiled with vdpbf16ps, packed and tiled with the portable micro-kernel, f32 compute.
      double g[6] = {0, 0, 0, 0, 0, 0};
      for (int v = 0; v < 5; ++v) {
        const bool is_packed = v != 2 && v != 4;
        if (is_packed ? row.ptm == 0 : row.tm == 0) continue;
        if (v == 0 && !amx) continue;
        KernelTuning t = own;
        t.gemm_bf16_amx = v == 0 ? 1 : 0;
        t.gemm_bf16_dot = v < 3 ? 1 : 0;
        t.gemm_bf16_packed_rows = is_packed ? 1 : 0;
        t.gemm_bf16_packed_tm = is_packed ? row.ptm : own.gemm_bf16_packed_tm;
        t.gemm_bf16_packed_nv = is_packed ? row.pnv : own.gemm_bf16_packed_nv;
        t.gemm_bf16_tm = is_packed ? own.gemm_bf16_tm : row.tm;
        t.gemm_bf16_tn = is_packed ? own.gemm_bf16_tn : row.tn;
        g[v] = time_gemm(t, flops, [&] { gemm(ComputeDType::BF16); });
      }
      if (r == 0) g[5] = time_gemm(own, flops, [&] { gemm(ComputeDType::F32); });
      std::printf("  %-20s %-6s %-6s", name, label(row.ptm, row.pnv).c_str(),
                  label(row.tm, row.tn).c_str());
      for (double v : g) {
        if (v > 0 && peaks.bf16_dot_gflops > 0)
          std::printf(" %6.1f (%3.0f%%)", v, pct(v));
        else if (v > 0)
          std::printf(" %13.1f", v);
        else
          std::printf(" %13s", "-");
      }
      std::printf("\n");
    }
  };
  for (const GemmShape& s : kPrefillShapes) {
    Weight w = random_weight(dev, s.N, s.K, DType::BF16, 3);
    cl::Mem x = dev.alloc(size_t(M) * s.K * 4), y = dev.alloc(size_t(M) * s.N * 4);
    dev.fill_zero(x, size_t(M) * s.K * 4);
    auto gemm = [&](ComputeDType c) {
      ops::linear(dev, x, 0, uint32_t(s.K), w, nullptr, y, 0, uint32_t(s.N), M, 1.0f, false, c);
    };
    // The first shape's GEMM for two seconds, untimed, before its row: what runs in the seconds
    // after the register-only peaks runs slower (bench_llama's prefill too). On the 2-core Zen 5
    // EPYC (2026-12-05, --quick) the first row, q/k/v, read 46% of the bf16 peak in the packed
    // GEMM, where the same shape later in the table read 78% and o read 74% when moved first;
    // after this warm-up q/k/v read 84% and 94% in two runs.
    if (&s == &kPrefillShapes[0])
      for (const auto t0 = Clock::now(); seconds_since(t0) < 2.0;) {
        gemm(ComputeDType::BF16);
        dev.finish();
      }
    print_rows(s.name, 2.0 * M * s.N * s.K, gemm);
  }
  // The model's gate/up: both weights in one launch with the SwiGLU epilogue (GLU tiles: gate
  // columns and the same columns' up rows), 2 x 8192 x 2048 at M rows.
  {
    const int64_t F = 8192, K = 2048;
    Weight gate = random_weight(dev, F, K, DType::BF16, 6), up = random_weight(dev, F, K, DType::BF16, 7);
    cl::Mem x = dev.alloc(size_t(M) * K * 4), y = dev.alloc(size_t(M) * F * 4);
    dev.fill_zero(x, size_t(M) * K * 4);
    print_rows("swiglu 2x8192x2048", 2.0 * M * 2 * F * K, [&](ComputeDType c) {
      ops::linear_swiglu(dev, x, 0, uint32_t(K), nullptr, 0.0f, gate, up, y, 0, uint32_t(F), M, c);
    });
  }
  // Whether the dot columns (gemm_bf16_dot 1, whatever the device's row says) ran vdpbf16ps.
  KernelTuning dot = own;
  dot.gemm_bf16_dot = 1;
  dev.set_tuning(dot);
  if (!ops::bf16_dot_product(dev))
    std::printf("  (no vdpbf16ps on this device: the dot columns are the portable kernels)\n");
  dev.set_tuning(own);
}

// llama3-1b's prefill GEMMs (M tokens) in our kernels (f32 and bf16 weights) next to CLBlast's
// tuned SGEMM (f32 weights) and HGEMM (fp16 weights and activations, where the device has
// cl_khr_fp16) on the same queue: the figures that decide where the prefill GEMMs should go to
// CLBlast (issue 9). CLBlast's first call per shape compiles its kernels; median_time's warm-up
// call keeps that out of the figures.
void clblast_section(Device& dev, int reps, uint32_t M) {
  std::printf("\nPrefill GEMM y[M,N] = x[M,K] W^T, M=%u, GFLOP/s:\n", M);
  std::printf("  %-20s %10s %10s %14s %14s\n", "N x K", "f32 (ours)", "bf16 (ours)",
              "CLBlast SGEMM", "CLBlast HGEMM");
  cl_command_queue queue = dev.queue();
  auto status_text = [](clblast::StatusCode c) { return "status " + std::to_string(int(c)); };
  for (const GemmShape& s : kPrefillShapes) {
    const double flops = 2.0 * M * s.N * s.K;
    Weight wf = random_weight(dev, s.N, s.K, DType::F32, 4);
    Weight wb = random_weight(dev, s.N, s.K, DType::BF16, 5);
    cl::Mem x = dev.alloc(size_t(M) * s.K * 4), y = dev.alloc(size_t(M) * s.N * 4);
    dev.fill_zero(x, size_t(M) * s.K * 4);
    auto ours = [&](const Weight& w) {
      return flops / median_time(reps, [&] {
               ops::linear(dev, x, 0, uint32_t(s.K), w, nullptr, y, 0, uint32_t(s.N), M);
               dev.finish();
             }) / 1e9;
    };
    const double g_f32 = ours(wf), g_bf16 = ours(wb);
    std::string sgemm = "-", hgemm = "-";
    clblast::StatusCode status = clblast::StatusCode::kSuccess;
    const double t_s = median_time(reps, [&] {
      status = clblast::Gemm<float>(clblast::Layout::kRowMajor, clblast::Transpose::kNo,
                                    clblast::Transpose::kYes, M, size_t(s.N), size_t(s.K), 1.0f,
                                    x.get(), 0, size_t(s.K), wf.mem.get(), 0, size_t(s.K), 0.0f,
                                    y.get(), 0, size_t(s.N), &queue);
      dev.finish();
    });
    sgemm = status == clblast::StatusCode::kSuccess ? std::to_string(int(flops / t_s / 1e9))
                                                    : status_text(status);
    if (dev.info().fp16) {
      const half one = FloatToHalf(0.5f);
      std::vector<half> wh(size_t(s.N) * s.K, one), xh(size_t(M) * s.K, one);
      cl::Mem wm = dev.alloc(wh.size() * 2), xm = dev.alloc(xh.size() * 2),
              ym = dev.alloc(size_t(M) * s.N * 2);
      dev.write(wm, wh.data(), wh.size() * 2);
      dev.write(xm, xh.data(), xh.size() * 2);
      const half zero = FloatToHalf(0.0f);
      const double t_h = median_time(reps, [&] {
        status = clblast::Gemm<half>(clblast::Layout::kRowMajor, clblast::Transpose::kNo,
                                     clblast::Transpose::kYes, M, size_t(s.N), size_t(s.K), one,
                                     xm.get(), 0, size_t(s.K), wm.get(), 0, size_t(s.K), zero,
                                     ym.get(), 0, size_t(s.N), &queue);
        dev.finish();
      });
      hgemm = status == clblast::StatusCode::kSuccess ? std::to_string(int(flops / t_h / 1e9))
                                                      : status_text(status);
    }
    std::printf("  %-20s %10.1f %10.1f %14s %14s\n", s.name, g_f32, g_bf16, sgemm.c_str(),
                hgemm.c_str());
  }
  if (!dev.info().fp16) std::printf("  (no cl_khr_fp16 on this device: no HGEMM)\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Kernel throughput on the first OpenCL device: read bandwidth, GEMV GB/s, GEMM "
               "GFLOP/s next to OpenBLAS sgemm, and the bf16-compute GEMM against the CPU's peaks",
               "bench_kernels"};
  bool quick = false, gemm_bf16_only = false, tiles = false;
  uint32_t gemm_rows = 512;
  app.add_flag("--quick", quick, "fewer repeats");
  app.add_flag("--gemm-bf16", gemm_bf16_only, "only the peaks and the bf16-compute GEMM");
  app.add_flag("--tiles", tiles,
               "with --gemm-bf16: over several tile shapes (KernelTuning's gemm_bf16_packed_tm x "
               "gemm_bf16_packed_nv and gemm_bf16_tm x gemm_bf16_tn) too");
  bool clblast_only = false;
  app.add_flag("--clblast", clblast_only, "only the prefill GEMMs next to CLBlast's SGEMM/HGEMM");
  app.add_option("--rows", gemm_rows, "the M of the bf16-compute GEMM and of --clblast")
      ->capture_default_str();
  parse_args(app, argc, argv);
  const int reps = quick ? 3 : 9;
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);
  if (clblast_only) {
    clblast_section(dev, quick ? 3 : 5, gemm_rows);
    return 0;
  }
  if (gemm_bf16_only) {
    gemm_bf16_section(dev, quick ? 3 : 5, tiles, gemm_rows);
    return 0;
  }

  // 1. Bandwidth, far past the caches: the OpenCL read kernel and the native STREAM loop.
  std::printf("\n");
  const double roofline = measure_roofline(dev, reps).best();

  // 2. GEMV, N=8192 x K=2048, alternating between weight copies so the caches stay cold; both
  // kernel shapes (the device's own first), so the figures say which variant this device wants.
  const KernelShape own = dev.kernel_shape();
  const KernelShape other =
      own == KernelShape::Chunks ? KernelShape::WorkGroups : KernelShape::Chunks;
  auto shape_name = [](KernelShape s) {
    return s == KernelShape::Chunks ? "chunks/work-item" : "work-groups";
  };
  std::printf("\nGEMV (M=1), N=8192 x K=2048, cold cache:\n");
  for (KernelShape shape : {own, other})
  for (DType dt : {DType::F32, DType::BF16}) {
    dev.set_kernel_shape(shape);
    const int64_t N = 8192, K = 2048;
    std::vector<Weight> ws;
    for (int i = 0; i < 3; ++i) ws.push_back(random_weight(dev, N, K, dt, 10 + i));
    cl::Mem x = dev.alloc(K * 4), y = dev.alloc(N * 4);
    dev.fill_zero(x, K * 4);
    int which = 0;
    double t = median_time(reps * 2, [&] {
      ops::linear(dev, x, 0, K, ws[which++ % 3], nullptr, y, 0, N, 1);
      dev.finish();
    });
    const double bytes = double(N) * K * dtype_size(dt);
    std::printf("  %-17s %-5s %7.3f ms  %6.1f GB/s of weights  (%.0f%% of measured bandwidth)\n",
                shape_name(shape), dtype_name(dt), t * 1e3, bytes / t / 1e9,
                100.0 * bytes / t / 1e9 / roofline);
  }
  dev.set_kernel_shape(own);

  // 3. GEMM at M = 1, 8, 64, 512 (N = K = 2048), f32 and bf16 weights, vs OpenBLAS sgemm.
  std::printf("\nGEMM y[M,N] = x[M,K] W^T, N=K=2048, GFLOP/s:\n");
  std::printf("  %5s %10s %10s %14s %16s\n", "M", "f32 (ours)", "bf16 (ours)", "OpenBLAS sgemm",
              "bf16, other shape");
  const int64_t N = 2048, K = 2048;
  Weight wf = random_weight(dev, N, K, DType::F32, 1), wb = random_weight(dev, N, K, DType::BF16, 2);
  std::vector<float> wh(size_t(N) * K, 0.5f), xh(512 * K, 0.25f), yh(512 * N);
  for (uint32_t M : {1u, 8u, 64u, 512u}) {
    cl::Mem x = dev.alloc(size_t(M) * K * 4), y = dev.alloc(size_t(M) * N * 4);
    dev.fill_zero(x, size_t(M) * K * 4);
    const double flops = 2.0 * M * N * K;
    double tf = median_time(reps, [&] {
      ops::linear(dev, x, 0, K, wf, nullptr, y, 0, N, M);
      dev.finish();
    });
    double tb = median_time(reps, [&] {
      ops::linear(dev, x, 0, K, wb, nullptr, y, 0, N, M);
      dev.finish();
    });
    dev.set_kernel_shape(other);
    double tother = median_time(reps, [&] {
      ops::linear(dev, x, 0, K, wb, nullptr, y, 0, N, M);
      dev.finish();
    });
    dev.set_kernel_shape(own);
    double tblas = median_time(reps, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.0f,
                  xh.data(), int(K), wh.data(), int(K), 0.0f, yh.data(), int(N));
    });
    std::printf("  %5u %10.1f %10.1f %14.1f %16.1f\n", M, flops / tf / 1e9, flops / tb / 1e9,
                flops / tblas / 1e9, flops / tother / 1e9);
  }

  // 4. The bf16-compute GEMM and the compute peaks.
  gemm_bf16_section(dev, quick ? 3 : 5, false, gemm_rows);

  // 5. The prefill GEMMs next to CLBlast.
  clblast_section(dev, quick ? 3 : 5, gemm_rows);
  return 0;
}
