// Each op with a GPU-shaped variant, timed in both kernel shapes on the first OpenCL device (or
// the one --platform/--type picks): the CPU shape (a work-item per row or head, local size 1) and
// the GPU shape (work-groups of lanes, runtime/kernel_tuning.cpp's row for the device). Memory-
// bound ops print GB/s: the bytes they must move (weights, activations read and written, KV
// cache rows read) over the median time.
// Usage: bench_kernel_shapes [--quick] [--platform SUBSTRING] [--type cpu|gpu|any]
//                            [--set FIELD=VALUE ...] [--tune] [--save]
// --set overrides one KernelTuning field for this run (e.g. --set attn_wg=128). --tune runs the
// runtime's tuner (runtime/kernel_tune.h, as `clshard tune --kernel-shape gpu`) over the GPU
// shape's fields and keeps the fastest. --save writes the resulting row as this device's entry of the
// tuning file in the kernel cache directory (runtime/kernel_tuning.h), which every later run on
// the device reads.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/kernel_tune.h"
#include "runtime/kernel_tuning.h"

using namespace clshard;
using namespace clshard::bench;

int main(int argc, char** argv) {
  CLI::App app{"Each op with a GPU-shaped variant, timed in both kernel shapes (CPU and GPU) on "
               "the first OpenCL device or the one --platform/--type picks",
               "bench_kernel_shapes"};
  bool quick = false;
  DeviceSelection sel;
  std::vector<std::string> sets;
  bool tune = false, save = false;
  app.add_flag("--quick", quick, "3 repeats instead of 9");
  app.add_option("--platform", sel.platform, "pick the device whose platform name contains this");
  app.add_option("--type", sel.type, "device type: cpu, gpu, accelerator or any")
      ->capture_default_str();
  app.add_option("--set", sets, "override one KernelTuning field for this run (FIELD=VALUE, e.g. "
                                "attn_wg=128); repeatable");
  app.add_flag("--tune", tune, "run the runtime's tuner over the GPU shape's fields, keep the "
                               "fastest");
  app.add_flag("--save", save, "write the resulting row as this device's entry of the tuning "
                               "file");
  parse_args(app, argc, argv);
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

  // The ops and shapes the tuner times (runtime/kernel_tune.cpp).
  TuneWorkload workload(dev, quick);
  auto time_row = [&](const TuneOp& r) {
    return median_time(reps, [&] {
      r.run();
      dev.finish();
    });
  };
  const KernelShape own = dev.kernel_shape();  // before --tune forces the GPU shape
  if (tune) {
    // The GPU shape's fields, by the runtime's tuner (what `clshard tune --kernel-shape gpu`
    // runs).
    dev.set_kernel_shape(KernelShape::WorkGroups);
    std::printf("\n");
    TuneOptions opt;
    opt.quick = quick;
    tune_kernel_fields(dev, opt, stdout);
  }
  if (tune) print_tuning();
  if (save) {
    save_kernel_tuning(dev.info(), dev.tuning());
    std::printf("saved this device's tuning entry to %s\n", kernel_tuning_file().c_str());
  }

  std::printf("\n%-24s %-26s %12s %10s %12s %10s %8s\n", "op", "size", "cpu shape ms", "GB/s",
              "gpu shape ms", "GB/s", "gpu/cpu");
  for (const TuneOp& r : workload.ops()) {
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
