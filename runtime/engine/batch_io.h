// The batch job's files: the prompts (JSONL in), the completions (JSONL out), and resuming a job
// whose output already holds some results.
//
// Input, one JSON object per line (blank lines skipped):
//   {"id": ..., "prompt": "text" | "prompt_token_ids": [...] | "messages": [...], <sampling>}
//   {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
//    "body": {"prompt" | "messages", "max_tokens", "temperature", ...}}   (OpenAI batch file)
// <sampling> is any of temperature, top_k, top_p, min_p, seed, max_tokens, stop, stop_token_ids,
// frequency_penalty, presence_penalty, repetition_penalty, logprobs (true | false, or an integer
// k in [0, 20] = true with top_logprobs k, as OpenAI's completions), top_logprobs, n (choices;
// choice i samples with choice_seed(seed, i) of sampling.h), ignore_eos; they override the
// deployment's defaults. Structured output: "response_format" (OpenAI's, an object) or "regex"
// (a string), in the line or in its body; the job compiles them with the tokenizer
// (runtime/engine/structured/response_format.h) and a bad one becomes the line's error record
// naming the field. A line that is not a valid request becomes an error
// record; the job goes on.
//
// Output, one JSON object per input line, in input order:
//   {"id", "line", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}
//     plus "logprobs": [{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token",
//     "logprob"}]}] when asked, and with n > 1 "choices": [{"index", "text", "token_ids",
//     "finish_reason", "completion_tokens", "logprobs"?}] (the top-level fields are choice 0's,
//     completion_tokens the sum over the choices)
//   {"id", "line", "error"}                                  (a bad line, or a request that failed)
// OpenAI-shaped requests also get "custom_id" and "response" (OpenAI's batch output shape).
//
// Durability and resume: every record is written with one write(2) and fdatasync'd, so a killed
// job loses only the requests in flight. Records that finish before an earlier line is done wait
// in memory for their turn AND go at once to a journal (<output>.pending); a rerun moves journaled
// records into the output before it starts. On a rerun the records of the new run are appended
// after those of the earlier run(s), so the file is in input order within each run; every record
// carries its input line number ("line") to restore the global order, and its id. A rerun
// skips requests by id (error records included: to retry a failed request, delete its record)
// and input errors by line number (their records may have a null id), so it expects the same
// input file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/deploy_config.h"

namespace clshard {

struct ChatTurn {
  std::string role;
  std::string content;
};

struct BatchRequest {
  std::string id;            // as text: ids compare as text, so 7 and "7" are the same id
  bool id_is_number = false; // written back as a JSON number
  size_t line = 0;           // 1-based line of the input file
  // Exactly one of the three is set.
  std::optional<std::string> prompt;
  std::optional<std::vector<int32_t>> prompt_token_ids;
  std::optional<std::vector<ChatTurn>> messages;  // to be rendered with the chat template
  SamplingDefaults sampling;  // the deployment's defaults with this request's fields applied
  std::optional<std::string> lora;  // the LoRA adapter (a name of the deployment's lora.adapters)
  bool openai_shape = false;  // {"custom_id", "body": ...}: the output adds custom_id and response
  // Structured output as given (key order kept: properties come out in schema order), and the
  // name the fields have in the line ("response_format" or "body.response_format").
  std::optional<nlohmann::ordered_json> response_format;
  std::optional<std::string> regex;
  std::string response_format_field = "response_format", regex_field = "regex";
  bool is_chat() const { return messages.has_value(); }
};

struct InputError {
  size_t line = 0;
  // The line's id when it has a usable one; empty when it has none (the record's id is then
  // null: a line number here could collide with a real id of another line, and resume would take
  // that request for done).
  std::string id;
  bool id_is_number = false;
  std::string message;
  bool openai_shape = false;
};

struct BatchInput {
  std::vector<BatchRequest> requests;  // in line order
  std::vector<InputError> errors;      // in line order
};

// Reads a JSONL input file. Throws only when the file cannot be read; bad lines become errors.
BatchInput read_batch_input(const std::filesystem::path& path, const SamplingDefaults& defaults);
// The same from the file's text.
BatchInput parse_batch_input(const std::string& jsonl_text, const SamplingDefaults& defaults);

// The per-request sampling fields a request body may carry (temperature, top_k, ...), as the
// batch input reads them; the server (runtime/serve/) reads its bodies with the same rules.
const std::vector<std::string>& request_sampling_fields();
// Applies one of them (or max_completion_tokens) to `s`; std::invalid_argument "FIELD: what was
// expected, got ..." for a bad value, FIELD being `field` (the name to report).
void apply_request_sampling_field(SamplingDefaults& s, const std::string& key,
                                  const nlohmann::json& value, const std::string& field);

enum class FinishReason { Stop, Length };
const char* to_string(FinishReason r);

// A token and its log-probability as the output shows it ("token": its text, when a tokenizer is
// there; empty otherwise).
struct TokenLogprobText {
  int32_t token_id = -1;
  std::string token;
  float logprob = 0.0f;
  std::string bytes;  // the token's own bytes (may be part of a UTF-8 character); empty: token's
};
struct RecordLogprobs {
  TokenLogprobText chosen;
  std::vector<TokenLogprobText> top;
};

// OpenAI's logprobs objects, as the batch job's OpenAI-shaped records and the server write them.
// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
// "bytes"}]}]}. Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
// "text_offset"}, offsets counted in bytes of the completion from `text_offset` (a stream's
// chunk starts where the text sent before it ends). A -inf log-probability is written as null.
nlohmann::ordered_json openai_chat_logprobs(const std::vector<RecordLogprobs>& lps);
nlohmann::ordered_json openai_completion_logprobs(const std::vector<RecordLogprobs>& lps,
                                                  size_t text_offset = 0);

// What the engine reports for one finished request.
struct CompletionRecord {
  std::string text;                // decoded completion (stop string excluded)
  std::vector<int32_t> token_ids;  // completion tokens
  FinishReason finish_reason = FinishReason::Length;
  uint64_t prompt_tokens = 0;
  uint64_t completion_tokens = 0;
  std::optional<std::vector<RecordLogprobs>> logprobs;  // per completion token, when asked
  // n > 1: every choice in order (their prompt_tokens unused); the fields above then hold choice
  // 0, and completion_tokens the sum over the choices.
  std::vector<CompletionRecord> choices;
};

// The journal that holds records finished out of order until the output catches up.
std::filesystem::path pending_journal_path(const std::filesystem::path& output);

// What an existing output file (and its journal) already holds.
struct OutputState {
  std::set<std::string> ids;  // every id with a record, error records included
  size_t records = 0;         // complete lines in the output
  size_t error_records = 0;
  uint64_t valid_bytes = 0;   // the output up to its last newline
  uint64_t file_bytes = 0;    // valid_bytes plus a torn last line, if any
};
// Reads the output file (a missing file is empty) plus the ids in its journal. A last line without
// a newline is a record torn by a kill and is ignored. Throws when a complete line is not a record
// (then this is not our output file, and appending to it would be wrong).
OutputState read_output_state(const std::filesystem::path& output);
// The ids a rerun skips: read_output_state(output).ids.
std::set<std::string> completed_ids(const std::filesystem::path& output);
// Cuts a torn last line (one without a newline) off a file; returns the bytes removed.
uint64_t truncate_torn_tail(const std::filesystem::path& file);

struct BatchOutputOptions {
  bool resume = true;       // false: start the output afresh (truncate it, drop the journal)
  bool fsync = true;        // fdatasync after each record (false: write(2) only, survives a kill
                            // of the process but not of the machine)
  std::string model_name;   // "model" in the OpenAI response bodies; left out when empty
};

// Writes the records of one run in input order. Not thread-safe: call it from the engine's loop.
class BatchOutputWriter {
 public:
  // Opens (creating directories) the output. With resume, cuts a torn last line, moves journaled
  // records into the output, and skips every id already there; the input's errors are written as
  // their turn comes, the requests' when complete() or error() is called for them.
  BatchOutputWriter(const std::filesystem::path& output, const BatchInput& input,
                    const BatchOutputOptions& options = {});
  ~BatchOutputWriter();
  BatchOutputWriter(const BatchOutputWriter&) = delete;
  BatchOutputWriter& operator=(const BatchOutputWriter&) = delete;

  // Ids an earlier run already wrote; the engine must not run them again.
  const std::set<std::string>& resumed_ids() const { return resumed_; }
  bool should_run(const BatchRequest& r) const { return resumed_.count(r.id) == 0; }
  // The input's requests left to run, in line order.
  std::vector<const BatchRequest*> requests_to_run(const BatchInput& input) const;

  // A request finished. Throws std::invalid_argument for an id that is not a pending request and
  // std::logic_error for a second result for the same id.
  void complete(const std::string& id, const CompletionRecord& record);
  // A request failed at run time (e.g. its prompt is longer than model.max_length).
  void error(const std::string& id, const std::string& message);

  size_t records_written() const { return next_; }            // by this run
  size_t records_total() const { return slots_.size(); }       // this run writes in all
  size_t error_records() const { return errors_written_; }     // by this run
  bool done() const { return next_ == slots_.size(); }

 private:
  struct Slot {
    std::string id;
    bool id_is_number = false;
    size_t line = 0;
    bool openai_shape = false;
    bool chat = false;
    std::optional<std::string> record;  // the JSON line (with '\n') once known
    bool is_error = false;
  };
  void finish_slot(size_t index, std::string line, bool is_error);
  void write_ready_prefix();
  std::string completion_line(const Slot& s, const CompletionRecord& r) const;
  std::string error_line(const Slot& s, const std::string& message) const;

  std::filesystem::path output_;
  std::filesystem::path journal_;
  BatchOutputOptions options_;
  int fd_ = -1;
  int journal_fd_ = -1;
  std::vector<Slot> slots_;
  std::map<std::string, size_t> request_slot_;  // id -> index in slots_
  std::set<std::string> resumed_;
  size_t next_ = 0;  // first slot not yet written
  size_t errors_written_ = 0;
};

}  // namespace clshard
