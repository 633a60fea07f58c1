#include "runtime/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "parallel/topology.h"
#include "runtime/device.h"

namespace clshard {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

std::string SpeculativeStats::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "drafted %llu, accepted %llu (%.1f%%), mean accepted length %.2f",
                (unsigned long long)drafted, (unsigned long long)accepted,
                100.0 * acceptance_rate(), mean_accepted_length());
  std::string s = buf;
  if (!drafted_at.empty()) s += "; by position:";
  for (size_t k = 0; k < drafted_at.size(); ++k) {
    std::snprintf(buf, sizeof buf, " %zu: %.1f%%", k + 1,
                  drafted_at[k] ? 100.0 * double(accepted_at[k]) / double(drafted_at[k]) : 0.0);
    s += buf;
  }
  return s;
}

uint32_t plan_kv_pages(const CausalLM& model, uint32_t page_size, int64_t pages,
                       double memory_fraction, uint32_t max_batch_size, uint32_t max_length,
                       const DraftModel* draft) {
  if (pages > 0) return uint32_t(pages);
  const Device& dev = *model.devices().at(0);
  const uint64_t page_bytes =
      (model.kv_bytes_per_token() + (draft ? draft->kv_bytes_per_token() : 0)) * page_size;
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

Engine::Engine(CausalLM& model, const Tokenizer* tokenizer, const SchedulerLimits& limits,
               DraftModel* draft, const SpeculativeOptions& spec)
    : model_(model), tokenizer_(tokenizer), draft_(draft), spec_(spec) {
  if (draft_ && (spec_.num_tokens < 1 || limits.num_speculative_tokens != spec_.num_tokens))
    throw std::logic_error("Engine: a draft needs num_speculative_tokens >= 1 in both the "
                           "options and the scheduler's limits");
  if (!draft_ && limits.num_speculative_tokens != 0)
    throw std::logic_error("Engine: num_speculative_tokens without a draft");
  if (draft_ && spec_.relaxed_thinking && tokenizer_) {
    think_start_ = tokenizer_->token_id("<think>");
    think_end_ = tokenizer_->token_id("</think>");
  }
  stats_.speculative.drafted_at.assign(spec_.num_tokens, 0);
  stats_.speculative.accepted_at.assign(spec_.num_tokens, 0);
  // The running requests of a replica use at most the adapters its device holds at once.
  SchedulerLimits replica_limits = limits;
  if (model.max_loaded_lora_adapters() > 0)
    replica_limits.max_loaded_adapters = model.max_loaded_lora_adapters();
  for (uint32_t r = 0; r < model.num_replicas(); ++r) schedulers_.emplace_back(replica_limits);
  handle_of_.resize(schedulers_.size());
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
  if (request.adapter_id > model_.num_lora_adapters())
    throw std::invalid_argument("LoRA adapter id " + std::to_string(request.adapter_id) +
                                " but the model has " +
                                std::to_string(model_.num_lora_adapters()) + " adapter(s)");
  const uint32_t vocab = model_.info().vocab_size;
  for (int32_t t : request.prompt)
    if (t < 0 || uint32_t(t) >= vocab)
      throw std::invalid_argument("prompt token " + std::to_string(t) +
                                  " is outside the vocabulary of " + std::to_string(vocab));
  // Cache-aware routing (parallel/ decides): the load is requests running or waiting; a replica
  // may run up to an eighth of a batch more than the least loaded one to reuse its prefix.
  std::vector<uint64_t> load, prefix;
  for (const Scheduler& s : schedulers_) {
    load.push_back(s.num_running() + s.num_waiting());
    prefix.push_back(
        schedulers_.size() > 1 ? s.prefix_match_tokens(request.prompt, request.adapter_id) : 0);
  }
  const uint64_t slack = std::max<uint64_t>(1, schedulers_.front().limits().max_batch_size / 8);
  const size_t replica = parallel::Topology::route_request(prefix, load, slack);
  const uint64_t h = next_handle_++;
  Live live;
  live.replica = replica;
  live.local = schedulers_[replica].add(request.prompt, request.max_tokens, request.adapter_id);
  handle_of_[replica][live.local] = h;
  live.req = std::move(request);
  if (live.req.constraint) live.constraint = live.req.constraint->clone();
  if (tokenizer_) live.decoder.emplace(*tokenizer_, /*skip_special_tokens=*/true);
  live_.emplace(h, std::move(live));
  return h;
}

void Engine::emit(uint64_t handle, int32_t token, std::string_view text,
                  const TokenLogprobs* lp) {
  if (on_token_) on_token_(TokenEvent{handle, token, text, lp});
}

bool Engine::observe(uint64_t handle, Live& live, int32_t token, const TokenLogprobs* lp) {
  if (think_start_ && token == *think_start_) live.thinking = true;
  if (think_end_ && token == *think_end_) live.thinking = false;
  if (lp) live.logprobs.push_back(*lp);
  const auto& stops = live.req.stop_token_ids;
  const bool is_eos_id = std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end();
  // The masks allow only what the constraint allows (and EOS where it can end), so a token it
  // refuses is a bug: the request fails rather than return output that breaks its format.
  if (live.constraint && !(is_eos_id && live.constraint->can_end()) &&
      !live.constraint->advance(token)) {
    schedulers_[live.replica].finish(live.local, EndReason::Error,
                                     "structured output: token " + std::to_string(token) +
                                         " is not allowed by the request's format");
    return true;
  }
  // An EOS a constraint allowed ends its complete output even under ignore_eos.
  const bool eos = is_eos_id && (!live.req.ignore_eos || live.constraint);
  if (eos || std::find(stops.begin(), stops.end(), token) != stops.end()) {
    live.drop_last = true;
    schedulers_[live.replica].finish(live.local, EndReason::Stop);
    return true;
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
      emit(handle, token, piece, lp);
      schedulers_[live.replica].finish(live.local, EndReason::Stop);
      return true;
    }
  } else {
    live.text += piece;
  }
  emit(handle, token, piece, lp);
  // A complete structured output (nothing may follow it) ends the request without an EOS.
  if (live.constraint && live.constraint->is_complete()) {
    schedulers_[live.replica].finish(live.local, EndReason::Stop);
    return true;
  }
  return false;
}

bool Engine::cancel(uint64_t handle, const std::string& why) {
  auto it = live_.find(handle);
  if (it == live_.end()) return false;
  const Live& live = it->second;
  // Between steps no request is in flight, so the scheduler frees its pages now.
  return schedulers_[live.replica].finish(live.local, EndReason::Error, why);
}

RequestState Engine::state(uint64_t handle) const {
  auto it = live_.find(handle);
  if (it == live_.end()) return RequestState::Finished;
  return schedulers_[it->second.replica].state(it->second.local);
}

size_t Engine::num_running() const {
  size_t n = 0;
  for (const auto& s : schedulers_) n += s.num_running();
  return n;
}

size_t Engine::num_waiting() const {
  size_t n = 0;
  for (const auto& s : schedulers_) n += s.num_waiting();
  return n;
}

void Engine::reset_stats() {
  stats_ = EngineStats{};
  stats_.speculative.drafted_at.assign(spec_.num_tokens, 0);
  stats_.speculative.accepted_at.assign(spec_.num_tokens, 0);
}

uint64_t Engine::kv_pages_in_use() const {
  uint64_t n = 0;
  for (const auto& s : schedulers_) n += s.pages_in_use();
  return n;
}

uint64_t Engine::kv_pages_total() const {
  uint64_t n = 0;
  for (const auto& s : schedulers_) n += s.pool().total_pages();
  return n;
}

uint32_t Engine::penalty_slot(Device& dev, uint32_t vocab, Live& live) {
  if (!penalty_counts_) penalty_counts_.emplace(dev, vocab);
  if (&penalty_counts_->device() != &dev || penalty_counts_->vocab() != vocab)
    throw std::logic_error("Engine: penalties need the logits on one device with one vocabulary");
  if (!live.penalty_slot) live.penalty_slot = penalty_counts_->acquire(live.req.prompt);
  return *live.penalty_slot;
}

void Engine::count_committed(
    const std::vector<std::pair<uint64_t, std::vector<int32_t>>>& kept) {
  std::vector<std::pair<uint32_t, int32_t>> add;
  for (const auto& [h, tokens] : kept) {
    const Live& live = live_.at(h);
    if (!live.penalty_slot) continue;
    for (int32_t t : tokens) add.emplace_back(*live.penalty_slot, t);
  }
  if (!add.empty()) penalty_counts_->add(add);
}

const cl::Mem& Engine::penalised_logits(const StepOutputs& out,
                                        const std::vector<PenaltyRow>& rows, bool keep_raw,
                                        Scratch& copy) {
  if (rows.empty()) return out.logits;
  if (!keep_raw) {
    apply_penalties(*penalty_counts_, out.logits, out.logits, out.rows, rows);
    return out.logits;
  }
  copy = Scratch(*out.device, size_t(out.rows) * out.vocab * sizeof(float));
  apply_penalties(*penalty_counts_, out.logits, copy.mem(), out.rows, rows);
  return copy.mem();
}

std::vector<TokenLogprobs> Engine::step_logprobs(const StepOutputs& out,
                                                 const cl::Mem& sampled_from,
                                                 std::vector<LogprobRow> rows,
                                                 const std::vector<const SamplingParams*>& params) {
  const bool processed = logprobs_mode_ == LogprobsMode::Processed;
  for (size_t j = 0; j < rows.size(); ++j) {
    rows[j].top_n = uint32_t(params[j]->top_logprobs);
    rows[j].inv_temperature =
        processed && params[j]->temperature > 0.0f ? 1.0f / params[j]->temperature : 1.0f;
  }
  return compute_logprobs(*out.device, processed ? sampled_from : out.logits, out.vocab, rows);
}

bool Engine::has_work() const {
  for (const auto& s : schedulers_)
    if (s.has_unfinished()) return true;
  return false;
}

void Engine::step_plain(Batch& b) {
  const size_t R = schedulers_.size();
  auto t1 = Clock::now();
  StepOutputs out = model_.forward(b.merged);
  std::vector<int32_t> tokens;
  std::vector<std::optional<TokenLogprobs>> row_logprobs(b.row_info.size());
  bool any_sample = false;
  for (const auto* row : b.row_info) any_sample = any_sample || row->needs_sample;
  if (any_sample) {
    // Every row's logits are sampled in one launch; intermediate prefill chunks are ignored.
    std::vector<SamplingParams> params;
    std::vector<uint64_t> seeds;
    std::vector<PenaltyRow> penalised;
    std::vector<LogprobRow> lp_rows;
    std::vector<const SamplingParams*> lp_params;
    std::vector<const TokenConstraint*> row_constraint(out.rows, nullptr);
    bool keep_raw = false;
    for (size_t i = 0; i < b.row_info.size(); ++i) {
      Live& live = live_.at(b.row_handle[i]);
      const SamplingParams& sp = live.req.sampling;
      params.push_back(sp);
      seeds.push_back(step_seed(sp, live.req.prompt.size() + b.row_info[i]->num_generated));
      if (!b.row_info[i]->needs_sample) continue;
      row_constraint[i] = live.constraint.get();
      if (sp.has_penalties()) {
        penalised.push_back({uint32_t(i), penalty_slot(*out.device, out.vocab, live), sp, {}});
        keep_raw = keep_raw || (sp.logprobs && logprobs_mode_ == LogprobsMode::Raw);
      }
      if (sp.logprobs) {
        lp_rows.push_back({uint32_t(i), -1, 0, 1.0f, false});
        lp_params.push_back(&live.req.sampling);
      }
    }
    Scratch copy;
    const cl::Mem& sample_from = penalised_logits(out, penalised, keep_raw, copy);
    std::vector<uint32_t> bits;
    if (constraint_masks(row_constraint, out.vocab, bits)) {
      Scratch mask(*out.device, bits.size() * sizeof(uint32_t));
      out.device->write(mask.mem(), bits.data(), bits.size() * sizeof(uint32_t));
      tokens = sample_tokens(*out.device, sample_from, out.rows, out.vocab, params, seeds,
                             &mask.mem());
    } else {
      tokens = sample_tokens(*out.device, sample_from, out.rows, out.vocab, params, seeds);
    }
    for (LogprobRow& r : lp_rows) r.token = tokens[r.row];
    auto lps = step_logprobs(out, sample_from, lp_rows, lp_params);
    for (size_t j = 0; j < lp_rows.size(); ++j) row_logprobs[lp_rows[j].row] = std::move(lps[j]);
  }
  stats_.device_s += since(t1);
  auto t2 = Clock::now();
  std::vector<std::pair<uint64_t, int32_t>> kept;  // (engine handle, token)
  std::vector<size_t> kept_row;                     // its merged row
  std::vector<std::pair<uint64_t, std::vector<int32_t>>> counted;
  for (size_t r = 0, i = 0; r < R; ++r) {
    if (!b.plans[r]) continue;
    std::vector<int32_t> sampled;
    for (const auto& row : b.plans[r]->rows) {
      if (row.needs_sample) {
        sampled.push_back(tokens[i]);
        kept.emplace_back(b.row_handle[i], tokens[i]);
        kept_row.push_back(i);
        counted.push_back({b.row_handle[i], {tokens[i]}});
      }
      ++i;
    }
    schedulers_[r].commit(*b.plans[r], sampled);
  }
  count_committed(counted);
  stats_.output_tokens += kept.size();
  for (size_t k = 0; k < kept.size(); ++k) {
    const auto& [h, token] = kept[k];
    Live& live = live_.at(h);
    const auto& lp = row_logprobs[kept_row[k]];
    if (schedulers_[live.replica].state(live.local) == RequestState::Finished &&
        !live.decoder) {
      if (lp) live.logprobs.push_back(*lp);
      emit(h, token, "", lp ? &*lp : nullptr);
      continue;
    }
    observe(h, live, token, lp ? &*lp : nullptr);
  }
  stats_.host_s += since(t2);
}

bool Engine::schedule(Batch& b) {
  const size_t R = schedulers_.size();
  b.plans.assign(R, std::nullopt);
  bool any = false;
  for (size_t r = 0; r < R; ++r) {
    b.plans[r] = schedulers_[r].schedule();
    any = any || b.plans[r].has_value();
  }
  if (!any) return false;
  // One step for all replicas: a replica with nothing to do still takes part, with no rows.
  if (R == 1) {
    b.merged = b.plans[0]->inputs;
  } else {
    std::vector<StepInputs> parts;
    for (size_t r = 0; r < R; ++r) {
      if (b.plans[r]) {
        parts.push_back(b.plans[r]->inputs);
      } else {
        StepInputs empty;
        empty.input_row_offsets = {0};
        parts.push_back(empty);
      }
    }
    b.merged = merge_replica_steps(parts, model_.kv_num_pages());
  }
  for (size_t r = 0; r < R; ++r)
    if (b.plans[r])
      for (const auto& row : b.plans[r]->rows) {
        b.row_handle.push_back(handle_of_[r].at(row.handle));
        b.row_info.push_back(&row);
        b.row_replica.push_back(r);
      }
  return true;
}

std::vector<GenerationResult> Engine::step() {
  auto t0 = Clock::now();
  Batch batch;
  const bool any = schedule(batch);
  stats_.host_s += since(t0);
  if (any) {
    if (draft_)
      step_speculative(batch);
    else
      step_plain(batch);
    ++stats_.steps;
  }
  const size_t R = schedulers_.size();
  std::vector<GenerationResult> done;
  auto t3 = Clock::now();
  stats_.preemptions = 0;
  stats_.cached_prompt_tokens = stats_.prefill_tokens = 0;
  for (size_t r = 0; r < R; ++r) {
    for (FinishedRequest& f : schedulers_[r].take_finished()) {
      GenerationResult res;
      res.handle = handle_of_[r].at(f.handle);
      handle_of_[r].erase(f.handle);
      res.reason = f.reason;
      res.error = f.error;
      res.prompt_tokens = f.prompt_tokens;
      res.preemptions = f.preemptions;
      res.cached_tokens = f.cached_tokens;
      res.token_ids = std::move(f.generated);
      auto it = live_.find(res.handle);
      if (it != live_.end()) {
        if (it->second.drop_last && !res.token_ids.empty()) res.token_ids.pop_back();
        if (it->second.decoder) res.text = it->second.text + it->second.decoder->flush();
        res.logprobs = std::move(it->second.logprobs);
        if (res.logprobs.size() > res.token_ids.size()) res.logprobs.resize(res.token_ids.size());
        if (it->second.penalty_slot) penalty_counts_->release(*it->second.penalty_slot);
        live_.erase(it);
      }
      stats_.prompt_tokens += res.prompt_tokens;
      done.push_back(std::move(res));
    }
    stats_.preemptions += schedulers_[r].preemptions();
    stats_.cached_prompt_tokens += schedulers_[r].cached_tokens();
    stats_.prefill_tokens += schedulers_[r].prefill_tokens();
  }
  stats_.host_s += since(t3);
  return done;
}

}  // namespace clshard
