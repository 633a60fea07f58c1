#include "runtime/engine/batch_job.h"

#include <chrono>
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/progress.h"

namespace clshard {

std::string describe_prefix_cache(const EngineStats& s) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "%llu prompt tokens cached, %llu computed (hit rate %.1f%%)",
                (unsigned long long)s.cached_prompt_tokens, (unsigned long long)s.prefill_tokens,
                100.0 * s.prefix_hit_rate());
  return buf;
}

BatchJobSummary run_batch_job(Deployment& d, std::ostream& err) {
  const DeployConfig& cfg = d.config;
  if (cfg.job.input.empty())
    throw std::runtime_error(cfg.where("job.input") + ": no input file: this deployment has no job");
  auto t0 = std::chrono::steady_clock::now();
  BatchInput input = read_batch_input(cfg.job.input, cfg.sampling);
  BatchOutputOptions out_opts;
  out_opts.model_name = cfg.model.path.filename().string();
  BatchOutputWriter writer(cfg.job.output, input, out_opts);
  auto todo = writer.requests_to_run(input);

  BatchJobSummary sum;
  sum.skipped = writer.resumed_ids().size();
  auto engine = d.make_engine();
  // A request with n choices runs as n engine requests; its record is written when all are done.
  struct Pending {
    const BatchRequest* req = nullptr;
    std::vector<std::optional<GenerationResult>> choices;
    size_t done = 0;
    std::string error;
  };
  std::map<const BatchRequest*, Pending> pending;
  std::map<uint64_t, std::pair<const BatchRequest*, size_t>> by_handle;  // -> (request, choice)
  for (const BatchRequest* r : todo) {
    try {
      RequestFormat format;
      if (r->response_format) format.response_format = &*r->response_format;
      if (r->regex) format.regex = &*r->regex;
      format.response_format_field = r->response_format_field;
      format.regex_field = r->regex_field;
      GenerationRequest g = d.generation_request(
          d.prompt_ids(r->prompt, r->prompt_token_ids, r->messages), r->sampling, r->lora, format);
      validate_sampling_params(g.sampling);  // before any choice is submitted
      std::vector<GenerationRequest> choices = Deployment::choice_requests(g, r->sampling.n);
      Pending& p = pending[r];
      p.req = r;
      p.choices.resize(choices.size());
      for (size_t i = 0; i < choices.size(); ++i)
        by_handle[engine->submit(std::move(choices[i]))] = {r, i};
    } catch (const std::exception& e) {
      pending.erase(r);
      writer.error(r->id, e.what());
    }
  }
  auto to_record = [&](GenerationResult& r, bool want_logprobs) {
    CompletionRecord rec;
    rec.text = std::move(r.text);
    rec.token_ids = std::move(r.token_ids);
    rec.finish_reason = r.reason == EndReason::Stop ? FinishReason::Stop : FinishReason::Length;
    rec.prompt_tokens = r.prompt_tokens;
    rec.completion_tokens = rec.token_ids.size();
    if (want_logprobs) rec.logprobs = d.logprobs_text(r.logprobs);
    return rec;
  };
  if (sum.skipped)
    err << "resuming " << cfg.job.output.string() << ": " << sum.skipped
        << " request(s) already done, " << todo.size() << " to run\n";
  Progress progress(writer.records_total(), Progress::stderr_is_terminal(), err);
  auto report = [&] {
    progress.update(writer.records_written(), sum.prompt_tokens, sum.completion_tokens,
                    writer.error_records());
  };
  report();
  while (engine->has_work()) {
    for (GenerationResult& r : engine->step()) {
      const auto [req, choice] = by_handle.at(r.handle);
      Pending& p = pending.at(req);
      if (r.reason == EndReason::Error && p.error.empty()) p.error = r.error;
      p.choices[choice] = std::move(r);
      if (++p.done < p.choices.size()) continue;
      if (!p.error.empty()) {
        writer.error(req->id, p.error);
        pending.erase(req);
        continue;
      }
      const bool want_logprobs = req->sampling.logprobs;
      CompletionRecord rec = to_record(*p.choices[0], want_logprobs);
      if (p.choices.size() > 1) {
        rec.choices.push_back(rec);
        for (size_t i = 1; i < p.choices.size(); ++i) {
          rec.choices.push_back(to_record(*p.choices[i], want_logprobs));
          rec.completion_tokens += rec.choices.back().completion_tokens;
        }
      }
      sum.prompt_tokens += rec.prompt_tokens;
      sum.completion_tokens += rec.completion_tokens;
      writer.complete(req->id, rec);
      pending.erase(req);
    }
    report();
  }
  progress.finish();
  sum.requests = writer.records_written();
  sum.errors = writer.error_records();
  sum.engine = engine->stats();
  sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  err << "output: " << cfg.job.output.string() << "\n";
  err << "engine: " << sum.engine.steps << " steps, device " << sum.engine.device_s
      << " s, host " << sum.engine.host_s << " s, " << sum.engine.preemptions << " preemption(s)\n";
  err << "prefix cache: "
      << (cfg.kv_cache.prefix_caching
              ? describe_prefix_cache(sum.engine)
              : "off, " + std::to_string(sum.engine.prefill_tokens) + " prompt tokens computed")
      << "\n";
  if (sum.engine.speculative.verify_rows > 0)
    err << "speculative: " << sum.engine.speculative.describe() << "\n";
  return sum;
}

}  // namespace clshard
