// Tuning runs: the candidate values of the per-device tuning fields (KernelTuning, device.h)
// timed on one device with the model-independent ops at representative shapes, the fastest kept
// per field. `clshard tune` (runtime/cli/tune_command.cpp) runs it and writes the entry with
// save_kernel_tuning (kernel_tuning.h); perf/bench_kernel_shapes times the same ops in both shapes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/device.h"

namespace clshard {

// One op at one representative shape, with the KernelTuning fields it reads in each shape.
struct TuneOp {
  std::string op, size;
  double bytes = 0;  // bytes it must move (memory-bound ops); 0: no GB/s figure
  std::function<void()> run;
  std::vector<std::string> gpu_fields;  // read in the WorkGroups shape
  std::vector<std::string> cpu_fields;  // read in the Chunks shape
};

// The ops with their buffers (random data) on `dev`: RMSNorm, bf16 and FP8 GEMVs, bf16 GEMMs and
// GEMVs and a prefill's grouped experts in the bf16 compute dtype, f32 prefill GEMMs (our kernels
// or CLBlast), RoPE + KV store, paged decode and prefill attention, MLA decode, the MoE router.
// `quick`: fewer and smaller shapes.
class TuneWorkload {
 public:
  TuneWorkload(Device& dev, bool quick);
  ~TuneWorkload();
  const std::vector<TuneOp>& ops() const { return ops_; }

 private:
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;
  std::vector<TuneOp> ops_;
};

// A tunable field, the kernel shape whose kernels read it, and the values a run tries.
struct TuneField {
  std::string field;
  KernelShape shape;
  std::vector<uint64_t> candidates;
};
const std::vector<TuneField>& tunable_fields();

struct TuneOptions {
  std::vector<std::string> fields;  // empty: every tunable field of the device's kernel shape
  bool quick = false;               // smaller shapes, 3 timed runs instead of 7
};

// One field's run: the value it started from, every candidate's time (the summed medians of the
// ops that read it; negative: the device could not build or launch it) and the value chosen.
struct TunedField {
  std::string field;
  uint64_t start = 0, chosen = 0;
  std::vector<std::pair<uint64_t, double>> seconds;
};

struct TuneResult {
  KernelTuning tuning;  // the device's tuning with every chosen value
  std::vector<TunedField> fields;
};

// Tunes `dev` in its current kernel shape: each field in turn (the tunable_fields() order) over
// its candidates, the others held at their current or already chosen values; a candidate must
// beat the current value by 2% to replace it (noise). Progress and timings go to `log` (null: no
// output). Leaves dev.tuning() at the result. Throws std::invalid_argument for a field name that
// is not a KernelTuning field, has no candidates, or is read only by the other kernel shape.
TuneResult tune_kernel_fields(Device& dev, const TuneOptions& options, std::FILE* log);

}  // namespace clshard
