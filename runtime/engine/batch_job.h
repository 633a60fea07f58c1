// `clshard run deploy.yaml`: prompts JSONL in, completions JSONL out, in input order, resumable,
// with progress on stderr and a closing summary.
#pragma once

#include <ostream>
#include <string>

#include "runtime/engine/deployment.h"

namespace clshard {

struct BatchJobSummary {
  size_t requests = 0;       // records this run wrote (errors included)
  size_t errors = 0;
  size_t skipped = 0;        // done by an earlier run
  uint64_t prompt_tokens = 0, completion_tokens = 0;
  double wall_s = 0;
  EngineStats engine;
};

// "1234 prompt tokens cached, 345 computed (hit rate 78.2%)": the summary's prefix-cache line.
// Computed counts every position a prefill row fed (a preempted request's recomputed sequence
// too); the hit rate is cached / (cached + computed).
std::string describe_prefix_cache(const EngineStats& s);

BatchJobSummary run_batch_job(Deployment& d, std::ostream& err);

}  // namespace clshard
