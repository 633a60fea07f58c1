#include "runtime/serve/metrics.h"

#include <algorithm>
#include <cstdio>

namespace clshard::serve {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void gauge(std::string& out, const std::string& name, const std::string& help, double v) {
  header(out, name, "gauge", help);
  out += name + " " + number(v) + "\n";
}

void counter(std::string& out, const std::string& name, const std::string& help, double v) {
  header(out, name, "counter", help);
  out += name + " " + number(v) + "\n";
}

void labelled_counter(std::string& out, const std::string& name, const std::string& help,
                      const char* label, const std::vector<std::string>& known,
                      const std::map<std::string, uint64_t>& values) {
  header(out, name, "counter", help);
  std::vector<std::string> keys = known;
  for (const auto& [k, _] : values)
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  for (const auto& k : keys) {
    auto it = values.find(k);
    out += name + "{" + label + "=\"" + k + "\"} " +
           number(it == values.end() ? 0.0 : double(it->second)) + "\n";
  }
}

// Latency buckets in seconds: 1 ms to 60 s.
std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
          0.75,  1.0,    2.5,   5.0,  10.0,  20.0, 40.0,  60.0};
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];  // le is inclusive: v == bound goes into that bucket
  ++count_;
  sum_ += v;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{le=\"" + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum " + number(sum_) + "\n";
  out += name + "_count " + std::to_string(count_) + "\n";
}

ServerMetrics::ServerMetrics()
    : ttft_(latency_bounds()), itl_(latency_bounds()), e2e_(latency_bounds()) {}

void ServerMetrics::set_gauges(const EngineGauges& g) {
  std::lock_guard lk(mu_);
  gauges_ = g;
}

EngineGauges ServerMetrics::gauges() const {
  std::lock_guard lk(mu_);
  return gauges_;
}

void ServerMetrics::add_prompt_tokens(uint64_t n) {
  std::lock_guard lk(mu_);
  prompt_tokens_ += n;
}

void ServerMetrics::add_generation_tokens(uint64_t n) {
  std::lock_guard lk(mu_);
  generation_tokens_ += n;
}

void ServerMetrics::observe_ttft(double s) {
  std::lock_guard lk(mu_);
  ttft_.observe(s);
}

void ServerMetrics::observe_inter_token(double s) {
  std::lock_guard lk(mu_);
  itl_.observe(s);
}

void ServerMetrics::request_finished(const std::string& outcome, double e2e_s) {
  std::lock_guard lk(mu_);
  ++finished_[outcome];
  e2e_.observe(e2e_s);
}

void ServerMetrics::request_rejected(const std::string& reason) {
  std::lock_guard lk(mu_);
  ++rejected_[reason];
}

uint64_t ServerMetrics::finished(const std::string& outcome) const {
  std::lock_guard lk(mu_);
  auto it = finished_.find(outcome);
  return it == finished_.end() ? 0 : it->second;
}

uint64_t ServerMetrics::rejected(const std::string& reason) const {
  std::lock_guard lk(mu_);
  auto it = rejected_.find(reason);
  return it == rejected_.end() ? 0 : it->second;
}

std::string ServerMetrics::render() const {
  std::lock_guard lk(mu_);
  std::string out;
  const EngineGauges& g = gauges_;
  gauge(out, "clshard_requests_running", "Requests with a row in the engine's batch.",
        double(g.running));
  gauge(out, "clshard_requests_waiting",
        "Requests accepted and waiting for a batch row or KV pages.", double(g.waiting));
  gauge(out, "clshard_kv_pages_used", "KV cache pages in use, over every replica.",
        double(g.kv_pages_used));
  gauge(out, "clshard_kv_pages_total", "KV cache pages, over every replica.",
        double(g.kv_pages_total));
  gauge(out, "clshard_kv_cache_usage_ratio", "Share of the KV cache pages in use.",
        g.kv_pages_total ? double(g.kv_pages_used) / double(g.kv_pages_total) : 0.0);
  counter(out, "clshard_engine_steps_total", "Engine steps run.", double(g.steps));
  counter(out, "clshard_prompt_tokens_total", "Prompt tokens of finished requests.",
          double(prompt_tokens_));
  counter(out, "clshard_generation_tokens_total", "Tokens generated (kept) for requests.",
          double(generation_tokens_));
  labelled_counter(out, "clshard_requests_finished_total",
                   "Requests that ran, by how they ended.", "outcome",
                   {"stop", "length", "cancelled", "deadline", "error"}, finished_);
  labelled_counter(out, "clshard_requests_rejected_total",
                   "Requests answered with an error without running, by reason.", "reason",
                   {"queue_full", "invalid", "unauthorized", "model_not_found", "not_ready"},
                   rejected_);
  ttft_.render(out, "clshard_time_to_first_token_seconds",
               "From a request's arrival to its first generated token.");
  itl_.render(out, "clshard_inter_token_latency_seconds",
              "Between consecutive tokens of a request.");
  e2e_.render(out, "clshard_e2e_request_latency_seconds",
              "From a request's arrival to its end.");
  if (g.speculative) {
    counter(out, "clshard_spec_decode_draft_tokens_total", "Draft tokens proposed.",
            double(g.drafted));
    counter(out, "clshard_spec_decode_accepted_tokens_total", "Draft tokens accepted.",
            double(g.accepted));
    gauge(out, "clshard_spec_decode_acceptance_rate", "Accepted drafts / proposed drafts.",
          g.drafted ? double(g.accepted) / double(g.drafted) : 0.0);
  }
  return out;
}

}  // namespace clshard::serve
