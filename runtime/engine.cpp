#include "runtime/engine.h"

#include <algorithm>
#include <chrono>

#include "runtime/device.h"

namespace clshard {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

uint32_t plan_kv_pages(const CausalLM& model, uint32_t page_size, int64_t pages,
                       double memory_fraction, uint32_t max_batch_size, uint32_t max_length) {
  if (pages > 0) return uint32_t(pages);
  const Device& dev = *model.devices().at(0);
  const uint64_t page_bytes = model.kv_bytes_per_token() * page_size;
  const uint64_t weights = dev.info().host_unified_memory ? 0 : model.info().weight_bytes;
  const uint64_t free_bytes = dev.info().global_mem > weights ? dev.info().global_mem - weights : 0;
  uint64_t n = uint64_t(double(free_bytes) * memory_fraction) / std::max<uint64_t>(page_bytes, 1);
  // One layer's pages live in one buffer: stay under the device's largest allocation.
  const uint64_t layer_page_bytes = page_bytes / std::max<uint32_t>(model.info().num_layers, 1);
  if (layer_page_bytes > 0) n = std::min<uint64_t>(n, dev.info().max_alloc / layer_page_bytes - 1);
  const uint64_t useful = uint64_t(max_batch_size) * ((max_length + page_size - 1) / page_size);
  n = std::min(n, useful);
  if (n == 0)
    throw std::runtime_error("KV cache: no room for a single page of " +
                             std::to_string(page_bytes) + " bytes on " + dev.label());
  return uint32_t(n);
}

Engine::Engine(CausalLM& model, const Tokenizer* tokenizer, const SchedulerLimits& limits)
    : model_(model), tokenizer_(tokenizer), scheduler_(limits) {
  if (model.kv_num_pages() < limits.total_pages || model.kv_page_size() != limits.page_size)
    throw std::logic_error("Engine: the model's KV cache does not match the scheduler's pages");
  eos_ids_ = model.info().eos_token_ids;
  if (tokenizer_ && tokenizer_->eos_id() &&
      std::find(eos_ids_.begin(), eos_ids_.end(), *tokenizer_->eos_id()) == eos_ids_.end())
    eos_ids_.push_back(*tokenizer_->eos_id());
}

uint64_t Engine::submit(GenerationRequest request) {
  validate_sampling_params(request.sampling);
  if (!request.stop.empty() && !tokenizer_)
    throw std::invalid_argument("stop strings need the checkpoint's tokenizer.json");
  const uint32_t vocab = model_.info().vocab_size;
  for (int32_t t : request.prompt)
    if (t < 0 || uint32_t(t) >= vocab)
      throw std::invalid_argument("prompt token " + std::to_string(t) +
                                  " is outside the vocabulary of " + std::to_string(vocab));
  const uint64_t h = scheduler_.add(request.prompt, request.max_tokens);
  Live live;
  live.req = std::move(request);
  if (tokenizer_) live.decoder.emplace(*tokenizer_, /*skip_special_tokens=*/true);
  live_.emplace(h, std::move(live));
  return h;
}

void Engine::observe(uint64_t handle, Live& live, int32_t token) {
  const auto& stops = live.req.stop_token_ids;
  if (std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end() ||
      std::find(stops.begin(), stops.end(), token) != stops.end()) {
    live.drop_last = true;
    scheduler_.finish(handle, EndReason::Stop);
    return;
  }
  std::string piece = live.decoder ? live.decoder->push(token) : std::string();
  if (!piece.empty() && !live.req.stop.empty()) {
    // Look for a stop string that ends inside the new piece.
    const size_t old_len = live.text.size();
    live.text += piece;
    size_t longest = 0;
    for (const auto& s : live.req.stop) longest = std::max(longest, s.size());
    const size_t from = old_len > longest ? old_len - longest : 0;
    size_t cut = std::string::npos;
    for (const auto& s : live.req.stop)
      if (!s.empty()) cut = std::min(cut, live.text.find(s, from));
    if (cut != std::string::npos) {
      piece = cut > old_len ? live.text.substr(old_len, cut - old_len) : std::string();
      live.text.resize(std::max(cut, std::min(cut, old_len)));
      if (on_token_) on_token_(handle, token, piece);
      scheduler_.finish(handle, EndReason::Stop);
      return;
    }
  } else {
    live.text += piece;
  }
  if (on_token_) on_token_(handle, token, piece);
}

std::vector<GenerationResult> Engine::step() {
  auto t0 = Clock::now();
  std::optional<ScheduledStep> plan = scheduler_.schedule();
  std::vector<GenerationResult> done;
  if (plan) {
    stats_.host_s += since(t0);
    auto t1 = Clock::now();
    StepOutputs out = model_.forward(plan->inputs);
    std::vector<int32_t> sampled;
    std::vector<size_t> sampled_rows;
    if (plan->num_samples() > 0) {
      // Every row's logits are sampled in one launch; intermediate prefill chunks are ignored.
      std::vector<SamplingParams> params;
      std::vector<uint64_t> seeds;
      for (const auto& row : plan->rows) {
        const Live& live = live_.at(row.handle);
        params.push_back(live.req.sampling);
        seeds.push_back(step_seed(live.req.sampling, live.req.prompt.size() + row.num_generated));
      }
      auto tokens = sample_tokens(*out.device, out.logits, out.rows, out.vocab, params, seeds);
      for (size_t i = 0; i < plan->rows.size(); ++i)
        if (plan->rows[i].needs_sample) {
          sampled.push_back(tokens[i]);
          sampled_rows.push_back(i);
        }
    }
    stats_.device_s += since(t1);
    auto t2 = Clock::now();
    ++stats_.steps;
    stats_.output_tokens += sampled.size();
    scheduler_.commit(*plan, sampled);
    for (size_t i = 0; i < sampled.size(); ++i) {
      const uint64_t h = plan->rows[sampled_rows[i]].handle;
      if (scheduler_.state(h) == RequestState::Finished && !live_.at(h).decoder) {
        if (on_token_) on_token_(h, sampled[i], "");
        continue;
      }
      observe(h, live_.at(h), sampled[i]);
    }
    stats_.host_s += since(t2);
  }
  auto t3 = Clock::now();
  for (FinishedRequest& f : scheduler_.take_finished()) {
    GenerationResult r;
    r.handle = f.handle;
    r.reason = f.reason;
    r.error = f.error;
    r.prompt_tokens = f.prompt_tokens;
    r.preemptions = f.preemptions;
    r.token_ids = std::move(f.generated);
    auto it = live_.find(f.handle);
    if (it != live_.end()) {
      if (it->second.drop_last && !r.token_ids.empty()) r.token_ids.pop_back();
      if (it->second.decoder) r.text = it->second.text + it->second.decoder->flush();
      live_.erase(it);
    }
    stats_.prompt_tokens += r.prompt_tokens;
    done.push_back(std::move(r));
  }
  stats_.preemptions = scheduler_.preemptions();
  stats_.host_s += since(t3);
  return done;
}

}  // namespace clshard
