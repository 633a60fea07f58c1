// Where a decode step's (or prefill's) time goes, kernel by kernel: a preset (dsv3-mini by default,
// bf16 and fp8; llama3-1b, bf16) decodes B requests at once (batch 1 unless --batch) as the model's
// forward runs it, with every launch timed on its own. This program defines clEnqueueNDRangeKernel,
// clEnqueueReadBuffer and clEnqueueWriteBuffer itself (the library is linked in statically, so its
// calls bind here) and forwards each to the OpenCL loader's; while timing is on, a launch waits for
// the queue before and after, and its wall time goes to its kernel's name and grid (the global
// size, "linear_fp8/48x1": launches of one kernel over different weights apart). Blocking reads and
// writes (the host round trips) are timed the same way. The step is timed untouched as well: the
// per-launch waits add their own cost, so the table's sum exceeds it a little. On a shared machine
// the wall time moves with the neighbours' load; the CPU time the process spends per step (every
// thread, PoCL's workers included) moves much less, so it is printed beside it.
// --timeline times the steps as they run in the queue instead, with no waits between launches: the
// queue is made with profiling (clCreateCommandQueueWithProperties is defined here too) and each
// launch's start and end come from its event. Per kernel and grid it prints the time from start to
// end and the gap before the start (from the previous command's end), and per step the gaps' sum,
// the part of it where the command was enqueued only after the previous one had ended (the host
// was late), and the span from the first start to the last end against the step's wall time. A
// native read loop before and after the steps says which bandwidth phase they ran in. Commands it
// does not define (fills, copies) count in the gap after them.
// --prefill N times a prefill of N tokens from an empty cache instead (one request, the step
// repeated over the same pages); --compute-dtype bf16 runs the deployment's bf16 compute.
// Usage: bench_step_breakdown [--preset P] [--dir D] [--dtypes bf16,fp8] [--context C]
//                             [--steps N] [--batch B] [--prefill N] [--compute-dtype f32|bf16]
//                             [--timeline]
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/generation.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

struct Tally {
  double seconds = 0;
  uint64_t calls = 0;
};
bool g_timing = false;
std::map<std::string, Tally> g_tally;

// --timeline: queues made with profiling, and every command's event kept while recording.
bool g_profile = false, g_recording = false;
struct Recorded {
  std::string what;
  cl_event event;
};
std::vector<Recorded> g_recorded;

template <typename F>
F real(const char* name) {
  static_assert(sizeof(F) == sizeof(void*));
  void* p = dlsym(RTLD_NEXT, name);
  if (!p) {
    std::fprintf(stderr, "bench_step_breakdown: no %s in the OpenCL loader\n", name);
    std::abort();
  }
  F f;
  std::memcpy(&f, &p, sizeof f);
  return f;
}

std::string kernel_name(cl_kernel k) {
  char name[128] = {0};
  clGetKernelInfo(k, CL_KERNEL_FUNCTION_NAME, sizeof name - 1, name, nullptr);
  return name;
}

// "48x1": the global size in dimensions 0 and 1.
std::string grid(cl_uint dims, const size_t* global) {
  return std::to_string(global[0]) + "x" + std::to_string(dims > 1 ? global[1] : 1);
}

// Runs `enqueue` between two waits on `q` and adds its wall time to `what`; while recording,
// keeps its event under `what` instead (and hands the caller its own reference if it asked).
template <typename F>
cl_int timed(cl_command_queue q, const std::string& what, cl_event* ev, F enqueue) {
  if (g_recording) {
    cl_event e = nullptr;
    const cl_int err = enqueue(&e);
    if (err != CL_SUCCESS || !e) return err;
    g_recorded.push_back({what, e});
    if (ev) {
      clRetainEvent(e);
      *ev = e;
    }
    return err;
  }
  if (!g_timing) return enqueue(ev);
  clFinish(q);
  const auto t0 = Clock::now();
  const cl_int err = enqueue(ev);
  clFinish(q);
  Tally& t = g_tally[what];
  t.seconds += seconds_since(t0);
  ++t.calls;
  return err;
}

// --timeline's figures: the recorded commands of each step in their order in the (in-order) queue.
struct Timeline {
  struct Lane {
    double exec = 0, gap = 0;  // seconds from start to end, and from the previous end to the start
    uint64_t calls = 0;
  };
  std::map<std::string, Lane> lanes;
  double wall = 0, span = 0, gaps = 0, host_late = 0;
  uint64_t steps = 0, launches = 0;

  // Takes (and releases) g_recorded as one step that took `wall_s` on the host.
  void add_step(double wall_s) {
    cl_ulong first = 0, prev_end = 0;
    for (const Recorded& r : g_recorded) {
      cl_ulong queued = 0, start = 0, end = 0;
      clGetEventProfilingInfo(r.event, CL_PROFILING_COMMAND_QUEUED, sizeof queued, &queued,
                              nullptr);
      clGetEventProfilingInfo(r.event, CL_PROFILING_COMMAND_START, sizeof start, &start, nullptr);
      clGetEventProfilingInfo(r.event, CL_PROFILING_COMMAND_END, sizeof end, &end, nullptr);
      clReleaseEvent(r.event);
      Lane& lane = lanes[r.what];
      lane.exec += double(end - start) * 1e-9;
      ++lane.calls;
      if (r.what[0] != '(') ++launches;
      if (prev_end) {
        const double gap = (double(start) - double(prev_end)) * 1e-9;
        lane.gap += gap;
        gaps += gap;
        if (queued > prev_end) host_late += gap;
      } else {
        first = start;
      }
      prev_end = std::max(prev_end, end);
    }
    g_recorded.clear();
    if (prev_end) span += double(prev_end - first) * 1e-9;
    wall += wall_s;
    ++steps;
  }

  void print() const {
    const double n = double(steps);
    std::printf(
        "  as run in the queue: wall %.2f ms per step; commands' span %.2f ms = execution %.2f + "
        "gaps %.2f (of which the host was late %.2f); %.1f launches per step\n",
        wall / n * 1e3, span / n * 1e3, (span - gaps) / n * 1e3, gaps / n * 1e3,
        host_late / n * 1e3, double(launches) / n);
    std::vector<std::pair<std::string, Lane>> rows(lanes.begin(), lanes.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a.second.exec + a.second.gap > b.second.exec + b.second.gap;
    });
    std::printf("  %-32s %9s %10s %10s %10s %8s\n", "kernel/grid", "calls", "ms/step", "us/call",
                "gap us", "share");
    for (const auto& [name, lane] : rows)
      std::printf("  %-32s %9.1f %10.3f %10.1f %10.1f %7.1f%%\n", name.c_str(),
                  double(lane.calls) / n, lane.exec / n * 1e3, lane.exec / double(lane.calls) * 1e6,
                  lane.gap / double(lane.calls) * 1e6, 100.0 * (lane.exec + lane.gap) / span);
  }
};

}  // namespace

extern "C" {

CL_API_ENTRY cl_int CL_API_CALL clEnqueueNDRangeKernel(cl_command_queue q, cl_kernel k,
                                                       cl_uint dims, const size_t* offset,
                                                       const size_t* global, const size_t* local,
                                                       cl_uint n_wait, const cl_event* wait,
                                                       cl_event* ev) {
  using Fn =
      cl_int(CL_API_CALL*)(cl_command_queue, cl_kernel, cl_uint, const size_t*, const size_t*,
                           const size_t*, cl_uint, const cl_event*, cl_event*);
  static const Fn fn = real<Fn>("clEnqueueNDRangeKernel");
  return timed(
      q, g_timing || g_recording ? kernel_name(k) + "/" + grid(dims, global) : std::string(), ev,
      [&](cl_event* e) { return fn(q, k, dims, offset, global, local, n_wait, wait, e); });
}

CL_API_ENTRY cl_int CL_API_CALL clEnqueueReadBuffer(cl_command_queue q, cl_mem m, cl_bool blocking,
                                                    size_t off, size_t bytes, void* dst,
                                                    cl_uint n_wait, const cl_event* wait,
                                                    cl_event* ev) {
  using Fn = cl_int(CL_API_CALL*)(cl_command_queue, cl_mem, cl_bool, size_t, size_t, void*, cl_uint,
                                  const cl_event*, cl_event*);
  static const Fn fn = real<Fn>("clEnqueueReadBuffer");
  return timed(q, "(host read)", ev,
               [&](cl_event* e) { return fn(q, m, blocking, off, bytes, dst, n_wait, wait, e); });
}

CL_API_ENTRY cl_int CL_API_CALL clEnqueueWriteBuffer(cl_command_queue q, cl_mem m, cl_bool blocking,
                                                     size_t off, size_t bytes, const void* src,
                                                     cl_uint n_wait, const cl_event* wait,
                                                     cl_event* ev) {
  using Fn = cl_int(CL_API_CALL*)(cl_command_queue, cl_mem, cl_bool, size_t, size_t, const void*,
                                  cl_uint, const cl_event*, cl_event*);
  static const Fn fn = real<Fn>("clEnqueueWriteBuffer");
  return timed(q, "(host write)", ev,
               [&](cl_event* e) { return fn(q, m, blocking, off, bytes, src, n_wait, wait, e); });
}

// The library's queues, with profiling under --timeline.
CL_API_ENTRY cl_command_queue CL_API_CALL clCreateCommandQueueWithProperties(
    cl_context ctx, cl_device_id dev, const cl_queue_properties* props, cl_int* err) {
  using Fn =
      cl_command_queue(CL_API_CALL*)(cl_context, cl_device_id, const cl_queue_properties*, cl_int*);
  static const Fn fn = real<Fn>("clCreateCommandQueueWithProperties");
  if (!g_profile) return fn(ctx, dev, props, err);
  std::vector<cl_queue_properties> with;
  bool set = false;
  for (const cl_queue_properties* p = props; p && p[0]; p += 2) {
    with.push_back(p[0]);
    with.push_back(p[0] == CL_QUEUE_PROPERTIES ? p[1] | CL_QUEUE_PROFILING_ENABLE : p[1]);
    set = set || p[0] == CL_QUEUE_PROPERTIES;
  }
  if (!set) with.insert(with.end(), {CL_QUEUE_PROPERTIES, CL_QUEUE_PROFILING_ENABLE});
  with.push_back(0);
  return fn(ctx, dev, with.data(), err);
}

}  // extern "C"

int main(int argc, char** argv) {
  CLI::App app{
      "Where a decode step's (or --prefill's) time goes, kernel by kernel: a preset "
      "(dsv3-mini bf16 and fp8 by default) at batch 1 or --batch B, every launch timed "
      "on its own",
      "bench_step_breakdown"};
  std::string preset = "dsv3-mini";
  app.add_option("--preset", preset, "the checkpoint's preset (clshard make-model)")
      ->capture_default_str()
      ->check(CLI::IsMember({"dsv3-mini", "llama3-1b"}));
  std::string root_arg = (std::filesystem::temp_directory_path() / "clshard-bench").string();
  std::vector<std::string> dtypes = {"bf16", "fp8"};
  uint32_t context = 128, n_steps = 16, batch = 1, prefill = 0;
  std::string compute_dtype = "f32";
  app.add_option("--dir", root_arg, "where the checkpoints live (written when missing)")
      ->capture_default_str();
  app.add_option("--dtypes", dtypes, "comma-separated checkpoint dtypes (llama3-1b: bf16 only)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--context", context, "cached tokens before the timed steps")
      ->capture_default_str();
  app.add_option("--steps", n_steps, "steps timed (decode steps, or prefills)")
      ->capture_default_str();
  CLI::Option* batch_opt =
      app.add_option("--batch", batch, "requests decoded together, each at the same context")
          ->capture_default_str()
          ->check(CLI::Range(1u, 256u));
  app.add_option("--prefill", prefill,
                 "time a prefill of this many tokens (one request) instead (0: decode)")
      ->capture_default_str()
      ->excludes(batch_opt);
  add_compute_dtype_option(app, compute_dtype);
  bool no_mmap = false;
  add_no_mmap_flag(app, no_mmap);
  app.add_flag("--timeline", g_profile,
               "time the steps as they run in the queue (profiling events, no waits between "
               "launches): each kernel's time from start to end and the gap before it");
  parse_args(app, argc, argv);
  if (preset == "llama3-1b" && app.count("--dtypes") == 0) dtypes = {"bf16"};
  const std::filesystem::path root = root_arg;
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);
  LoadOptions opts{{&dev}, std::nullopt};
  opts.compute_dtype = compute_dtype == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
  if (no_mmap) opts.weight_memory = WeightMemory::Copied;
  for (const auto& dt : dtypes) {
    const auto dir = ensure_preset(preset, dt, root / (preset + "-" + dt));
    const std::unique_ptr<CausalLM> loaded = load_model(dir, opts);
    CausalLM& model = *loaded;
    const uint32_t V = model.info().vocab_size;
    std::mt19937 rng(5);
    uint32_t ppr = 0;
    const uint32_t tokens_per_row = prefill > 0 ? prefill : context + 2 * n_steps + 2;
    const auto table =
        plan_static_pages(model, std::vector<uint32_t>(batch, tokens_per_row), 128, &ppr);
    uint32_t pos = context;
    // A decode step at the next position, or the prefill again over the same pages.
    auto step = [&] {
      return prefill > 0 ? random_step(table, ppr, 1, 0, prefill, V, rng)
                         : random_step(table, ppr, batch, pos++, 1, V, rng);
    };
    if (prefill == 0)
      model.forward(random_step(table, ppr, batch, 0, context, V, rng)).read_logits();
    model.forward(step()).read_logits();  // kernel builds

    // Untouched steps first, then the same number timed launch by launch.
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    for (uint32_t i = 0; i < n_steps; ++i) model.forward(step()).read_logits();
    const double t_step = seconds_since(t0) / n_steps;
    const double cpu_step = (cpu_seconds() - c0) / n_steps;
    if (g_profile) {
      const double read_before = stream_read_gbs(3);
      Timeline timeline;
      for (uint32_t i = 0; i < n_steps; ++i) {
        const StepInputs in = step();
        g_recording = true;
        const auto t = Clock::now();
        model.forward(in).read_logits();
        const double wall = seconds_since(t);
        g_recording = false;
        timeline.add_step(wall);
      }
      const double read_after = stream_read_gbs(3);
      std::printf(
          "\n%s %s, %s (compute %s): %.2f ms per step untouched, CPU time %.2f ms per step; the "
          "native read loop (%u threads) %.1f GB/s before the timeline's steps, %.1f after\n",
          preset.c_str(), dt.c_str(),
          (prefill > 0
               ? "prefill of " + std::to_string(prefill) + " tokens"
               : "decode batch " + std::to_string(batch) + " at context " + std::to_string(context))
              .c_str(),
          compute_dtype.c_str(), t_step * 1e3, cpu_step * 1e3,
          std::max(1u, std::thread::hardware_concurrency()), read_before, read_after);
      timeline.print();
      std::fflush(stdout);
      continue;
    }
    g_tally.clear();
    g_timing = true;
    const auto t1 = Clock::now();
    for (uint32_t i = 0; i < n_steps; ++i) model.forward(step()).read_logits();
    const double t_timed = seconds_since(t1) / n_steps;
    g_timing = false;

    std::vector<std::pair<std::string, Tally>> rows(g_tally.begin(), g_tally.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    double sum = 0;
    uint64_t launches = 0;
    for (const auto& [name, t] : rows) {
      sum += t.seconds;
      if (name[0] != '(') launches += t.calls;
    }
    if (prefill > 0)
      std::printf(
          "\n%s %s, prefill of %u tokens (compute %s): %.2f ms per step untouched "
          "(%.1f tok/s), CPU time %.2f ms per step; %.1f launches per step\n",
          preset.c_str(), dt.c_str(), prefill, compute_dtype.c_str(), t_step * 1e3,
          prefill / t_step, cpu_step * 1e3, double(launches) / n_steps);
    else
      std::printf(
          "\n%s %s, decode batch %u at context %u (compute %s): %.2f ms per step "
          "untouched (%.1f tok/s), CPU time %.2f ms per step; %.1f launches per step\n",
          preset.c_str(), dt.c_str(), batch, context, compute_dtype.c_str(), t_step * 1e3,
          batch / t_step, cpu_step * 1e3, double(launches) / n_steps);
    std::printf("  %-32s %9s %10s %10s %8s\n", "kernel/grid", "calls", "ms/step", "us/call",
                "share");
    for (const auto& [name, t] : rows)
      std::printf("  %-32s %9.1f %10.3f %10.1f %7.1f%%\n", name.c_str(), double(t.calls) / n_steps,
                  t.seconds / n_steps * 1e3, t.seconds / double(t.calls) * 1e6,
                  100.0 * t.seconds / sum);
    std::printf(
        "  sum of the timed calls %.2f ms per step; the timed steps took %.2f ms (host "
        "work between calls %.2f ms)\n",
        sum / n_steps * 1e3, t_timed * 1e3, (t_timed - sum / n_steps) * 1e3);
    std::fflush(stdout);
  }
  return 0;
}
