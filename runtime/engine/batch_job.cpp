#include "runtime/engine/batch_job.h"

#include <chrono>
#include <algorithm>
#include <map>
#include <optional>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/progress.h"

namespace clshard {

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
      GenerationRequest g;
      g.prompt = d.prompt_ids(r->prompt, r->prompt_token_ids, r->messages);
      g.sampling = Deployment::sampling_params(r->sampling);
      g.max_tokens = uint32_t(r->sampling.max_tokens);
      g.stop = r->sampling.stop;
      g.stop_token_ids = r->sampling.stop_token_ids;
      g.ignore_eos = r->sampling.ignore_eos;
      const size_t n = size_t(std::max(1, r->sampling.n));
      validate_sampling_params(g.sampling);  // before any choice is submitted
      Pending& p = pending[r];
      p.req = r;
      p.choices.resize(n);
      for (size_t i = 0; i < n; ++i) {
        GenerationRequest gi = g;
        gi.sampling.seed = choice_seed(g.sampling.seed, uint32_t(i));
        by_handle[engine->submit(std::move(gi))] = {r, i};
      }
    } catch (const std::exception& e) {
      pending.erase(r);
      writer.error(r->id, e.what());
    }
  }
  auto logprob_text = [&](int32_t id) -> std::string {
    if (!d.tokenizer || id < 0) return {};
    try {
      return d.tokenizer->decode({id});
    } catch (const std::exception&) {
      return {};
    }
  };
  auto to_record = [&](GenerationResult& r, bool want_logprobs) {
    CompletionRecord rec;
    rec.text = std::move(r.text);
    rec.token_ids = std::move(r.token_ids);
    rec.finish_reason = r.reason == EndReason::Stop ? FinishReason::Stop : FinishReason::Length;
    rec.prompt_tokens = r.prompt_tokens;
    rec.completion_tokens = rec.token_ids.size();
    if (want_logprobs) {
      rec.logprobs.emplace();
      for (const TokenLogprobs& lp : r.logprobs) {
        RecordLogprobs e;
        e.chosen = {lp.token, logprob_text(lp.token), lp.logprob};
        for (const TokenLogprob& t : lp.top)
          e.top.push_back({t.token, logprob_text(t.token), t.logprob});
        rec.logprobs->push_back(std::move(e));
      }
    }
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
  if (sum.engine.speculative.verify_rows > 0)
    err << "speculative: " << sum.engine.speculative.describe() << "\n";
  return sum;
}

}  // namespace clshard
