// The server's figures in Prometheus' text exposition format (GET /metrics): requests running and
// waiting, tokens in and out, request outcomes, time to first token, inter-token and end-to-end
// latency histograms, KV pages, speculative acceptance. Thread-safe: the engine thread records,
// HTTP threads count rejections and render.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace clshard::serve {

// A cumulative histogram with fixed upper bounds (seconds), as Prometheus renders them.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // `# HELP`, `# TYPE`, the _bucket lines (le="..." and le="+Inf"), _sum and _count.
  void render(std::string& out, const std::string& name, const std::string& help) const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative (+Inf last)
  uint64_t count_ = 0;
  double sum_ = 0;
};

// What the engine thread reports after each step.
struct EngineGauges {
  uint64_t running = 0, waiting = 0;  // waiting includes requests not yet handed to the engine
  uint64_t kv_pages_used = 0, kv_pages_total = 0;
  bool speculative = false;
  uint64_t drafted = 0, accepted = 0;  // speculative drafts proposed / accepted, in all
  uint64_t steps = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  void set_gauges(const EngineGauges& g);
  EngineGauges gauges() const;
  void add_prompt_tokens(uint64_t n);
  void add_generation_tokens(uint64_t n);
  void observe_ttft(double s);
  void observe_inter_token(double s);
  // A request that ended: outcome "stop" | "length" | "cancelled" | "deadline" | "error", and its
  // time from arrival to the end.
  void request_finished(const std::string& outcome, double e2e_s);
  // A request answered without running: "queue_full" (429), "invalid" (400), "unauthorized",
  // "not_ready" ...
  void request_rejected(const std::string& reason);
  uint64_t finished(const std::string& outcome) const;
  uint64_t rejected(const std::string& reason) const;
  std::string render() const;

 private:
  mutable std::mutex mu_;
  EngineGauges gauges_;
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  Histogram ttft_, itl_, e2e_;
  std::map<std::string, uint64_t> finished_, rejected_;
};

}  // namespace clshard::serve
