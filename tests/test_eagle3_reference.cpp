// Eagle3 drafts over DeepSeek-V3 (models/eagle3_deepseek_v3) against the reference code's outputs
// (../shared/reference cases `kind: eagle3`: the MLA draft, and with "draft_kind": "mha" the
// Llama-style draft, over the bf16 and fp8 grouped targets). Each case gives the target's captures
// aux_hidden [S, 3H]; the draft runs over positions 0..S-2 with tokens seq[1..S-1] and capture rows
// 0..S-2, and its logits [S-1, V] and pre-norm output [S-1, H] must match every row within 1e-3:
// all positions in one prefill step, one position per step, and with the H-wide input (the path
// the draft's own output takes). Then: 2 CPU sub-devices (data-parallel replicas) give the
// one-device numbers, a draft vocabulary smaller than the target's through d2t, and the errors for
// drafts that do not fit their target.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>

#include "models/eagle3_deepseek_v3/model.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/generation.h"
#include "runtime/safetensors.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr float kTolerance = 1e-3f;      // the reference's fp32-engine tolerance (max abs)
constexpr float kSameTolerance = 1e-5f;  // the same rows on another layout or device count

using eagle3_deepseek_v3::DraftKind;
using eagle3_deepseek_v3::Eagle3Draft;
using test::DraftRefCase;
using test::max_abs_diff;

LoadOptions one_device() { return LoadOptions{{&test::default_device()}, std::nullopt}; }

std::unique_ptr<Eagle3Draft> load_draft(const DraftRefCase& rc) {
  return eagle3_deepseek_v3::load(rc.target, rc.draft, one_device());
}

// The target's deployment on every device (DP = EP = devices), which the draft shares.
LoadOptions replicas(DeviceManager& mgr) {
  LoadOptions o;
  o.devices = mgr.devices();
  o.data_parallel_degree = o.expert_parallel_degree = uint32_t(mgr.size());
  return o;
}

std::string case_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

std::vector<float> to_host(const TensorView& t) {
  std::vector<float> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = t.dtype == DType::BF16 ? bf16_to_f32(reinterpret_cast<const uint16_t*>(t.data)[i])
                                  : reinterpret_cast<const float*>(t.data)[i];
  return v;
}

// A hidden row for (sequence, position), `width` floats.
using HiddenSource = std::function<const float*(size_t seq, uint32_t pos)>;

HiddenSource captures(const DraftRefCase& rc) {
  return [&rc](size_t b, uint32_t p) {
    return rc.seqs[b].target_hidden.data() + size_t(p) * rc.hidden_width;
  };
}

// Per sequence, the rows the draft returned for its positions, in order.
struct DraftRun {
  std::vector<std::vector<float>> logits, hidden;
};

// Pages for rows that reach `lengths`: each row consecutive pages of its replica's own pool.
struct PageLayout {
  std::vector<uint32_t> table;
  uint32_t pages_per_row = 1, pages = 1;
};
PageLayout plan_pages(const std::vector<uint32_t>& lengths, std::vector<uint32_t> splits,
                      uint32_t page_size) {
  if (splits.empty()) splits = {0, uint32_t(lengths.size())};
  PageLayout l;
  for (uint32_t len : lengths)
    l.pages_per_row = std::max(l.pages_per_row, (len + page_size - 1) / page_size);
  for (size_t r = 0; r + 1 < splits.size(); ++r) {
    uint32_t n = 0;
    for (uint32_t b = splits[r]; b < splits[r + 1]; ++b)
      n += (lengths[b] + page_size - 1) / page_size;
    l.pages = std::max(l.pages, n);
  }
  l.table.assign(lengths.size() * l.pages_per_row, l.pages);  // the null page
  for (size_t r = 0; r + 1 < splits.size(); ++r) {
    uint32_t next = 0;
    for (uint32_t b = splits[r]; b < splits[r + 1]; ++b)
      for (uint32_t i = 0; i < (lengths[b] + page_size - 1) / page_size; ++i)
        l.table[b * l.pages_per_row + i] = next++;
  }
  return l;
}

// The step's hidden rows, each replica's on its device.
std::vector<ReplicaHidden> upload_hidden(Eagle3Draft& d, const StepInputs& in, uint32_t width,
                                         const HiddenSource& src) {
  std::vector<ReplicaHidden> out;
  const auto devs = d.devices();
  for (size_t r = 0; r < devs.size(); ++r) {
    const StepInputs s = in.replica_step(r);
    const uint32_t b0 = in.data_parallel_splits.empty() ? 0 : in.data_parallel_splits[r];
    std::vector<float> rows;
    for (size_t b = 0; b < s.num_rows(); ++b)
      for (uint32_t i = 0; i < s.row_length(b); ++i) {
        const float* row = src(b0 + b, s.cache_lengths[b] + i);
        rows.insert(rows.end(), row, row + width);
      }
    ReplicaHidden h;
    h.device = devs[r];
    h.count = uint32_t(s.num_tokens());
    h.rows = devs[r]->alloc(std::max<size_t>(rows.size(), 1) * sizeof(float));
    if (!rows.empty()) devs[r]->write(h.rows, rows.data(), rows.size() * sizeof(float));
    out.push_back(std::move(h));
  }
  return out;
}

// The draft over positions [0, S - 1) of every sequence (tokens seq[1..], hidden rows from src),
// `chunk` positions per row per step (0: all in one step), rows split over replicas by `splits`.
DraftRun run_draft(Eagle3Draft& d, const DraftRefCase& rc, uint32_t chunk, uint32_t width,
                   const HiddenSource& src, const std::vector<uint32_t>& splits = {},
                   uint32_t page_size = 16) {
  const size_t B = rc.seqs.size();
  std::vector<uint32_t> lengths;
  for (const auto& s : rc.seqs) lengths.push_back(uint32_t(s.tokens.size() - 1));
  const PageLayout pl = plan_pages(lengths, splits, page_size);
  d.allocate_kv_cache(pl.pages, page_size);
  DraftRun run;
  run.logits.resize(B);
  run.hidden.resize(B);
  std::vector<uint32_t> done(B, 0);
  for (int steps = 0;; ++steps) {
    StepInputs in;
    in.lookup_table = pl.table;
    in.pages_per_row = pl.pages_per_row;
    in.data_parallel_splits = splits;
    in.return_logits = ReturnLogits::All;
    in.input_row_offsets = {0};
    bool any = false;
    for (size_t b = 0; b < B; ++b) {
      const uint32_t n = chunk ? std::min(chunk, lengths[b] - done[b]) : lengths[b] - done[b];
      for (uint32_t p = done[b]; p < done[b] + n; ++p)
        in.tokens.push_back(rc.seqs[b].tokens[p + 1]);
      in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
      in.cache_lengths.push_back(done[b]);
      any |= n > 0;
    }
    if (!any) break;
    const StepOutputs out = d.forward(in, upload_hidden(d, in, width, src), width);
    EXPECT_EQ(out.vocab, rc.vocab);
    EXPECT_EQ(out.hidden_width, rc.hidden);
    EXPECT_EQ(out.hidden.size(), d.devices().size());
    const auto logits = out.read_logits(), hidden = out.read_hidden();
    EXPECT_EQ(hidden.size(), size_t(out.rows) * rc.hidden);
    for (size_t b = 0; b < B; ++b) {
      const uint32_t r0 = out.logit_offsets[b], r1 = out.logit_offsets[b + 1];
      EXPECT_EQ(r1 - r0, in.row_length(b));
      run.logits[b].insert(run.logits[b].end(), logits.begin() + size_t(r0) * rc.vocab,
                           logits.begin() + size_t(r1) * rc.vocab);
      run.hidden[b].insert(run.hidden[b].end(), hidden.begin() + size_t(r0) * rc.hidden,
                           hidden.begin() + size_t(r1) * rc.hidden);
      done[b] += in.row_length(b);
    }
  }
  return run;
}

struct Diffs {
  float logits = 0, hidden = 0, hidden_rel = 0;  // hidden_rel: relative to the rows' rms
};
Diffs compare(const DraftRun& run, const DraftRefCase& rc) {
  Diffs d;
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    d.logits = std::max(d.logits, max_abs_diff(run.logits[b], rc.seqs[b].draft_logits));
    const float h = max_abs_diff(run.hidden[b], rc.seqs[b].draft_hidden);
    double ss = 0;
    for (float v : rc.seqs[b].draft_hidden) ss += double(v) * v;
    d.hidden = std::max(d.hidden, h);
    d.hidden_rel =
        std::max(d.hidden_rel, float(h / std::sqrt(ss / rc.seqs[b].draft_hidden.size())));
  }
  return d;
}

void expect_matches_reference(const DraftRun& run, const DraftRefCase& rc, const std::string& what) {
  const Diffs d = compare(run, rc);
  std::cout << "[ eagle3 " << what << " ] " << rc.id << ": max |logit diff| " << d.logits
            << ", max |hidden diff| " << d.hidden << " (" << d.hidden_rel << " of rms)\n";
  EXPECT_LT(d.logits, kTolerance) << rc.id << " " << what;
  EXPECT_LT(d.hidden, kTolerance) << rc.id << " " << what;
  ::testing::Test::RecordProperty("max_abs_diff_" + what, std::to_string(d.logits));
}

// The MLA draft's attention path of its last step (the MHA draft has one).
void expect_mla_path(const Eagle3Draft& d, ops::MlaPath p) {
  if (d.kind() == DraftKind::Mla) {
    EXPECT_EQ(d.last_mla_path(), p);
  }
}

TEST(Eagle3ReferenceIndex, ListsTheExpectedCases) {
  const auto ids = test::case_ids("eagle3");
  for (const char* want :
       {"deepseek-v3-tiny-grouped-bf16/short.eagle3", "deepseek-v3-tiny-grouped-fp8/short.eagle3",
        "deepseek-v3-tiny-grouped-bf16/short.eagle3mha",
        "deepseek-v3-tiny-grouped-fp8/short.eagle3mha"})
    EXPECT_NE(std::find(ids.begin(), ids.end(), want), ids.end()) << want;
}

class Eagle3Reference : public ::testing::TestWithParam<std::string> {};

// What the draft asks of the target, from its config and checkpoint.
TEST_P(Eagle3Reference, DraftInfoNamesTheCapturedLayers) {
  const DraftRefCase rc = test::load_draft_case(GetParam());
  auto d = load_draft(rc);
  EXPECT_EQ(d->kind(), rc.mha ? DraftKind::Mha : DraftKind::Mla);
  const DraftInfo& i = d->info();
  EXPECT_EQ(i.architecture, rc.mha ? "LlamaForCausalLMEagle3" : "Eagle3DeepseekV3ForCausalLM");
  EXPECT_EQ(i.vocab_size, rc.vocab);
  EXPECT_EQ(i.hidden_size, rc.hidden);
  EXPECT_EQ(i.target_hidden, ReturnHidden::SelectedLayers);
  std::vector<uint32_t> layers;
  for (int64_t id : rc.aux_layer_ids) layers.push_back(uint32_t(id - 1));
  EXPECT_EQ(i.target_layers, layers);
  EXPECT_EQ(i.target_hidden_width, rc.hidden_width);
  EXPECT_EQ(i.target_hidden_width, 3 * rc.hidden);
  EXPECT_GT(i.weight_bytes, 0u);
  EXPECT_TRUE(d->vocab_map().identity);
  // One cache row per token: MLA latent + rope, or K and V of the kv heads.
  EXPECT_EQ(d->kv_bytes_per_token(), rc.mha ? 2u * 2 * 32 * 4 : (64u + 16) * 4);
}

// Every sequence's positions in one ragged prefill step (pages of 16, so rows cross pages).
TEST_P(Eagle3Reference, PrefillStepMatchesReference) {
  const DraftRefCase rc = test::load_draft_case(GetParam());
  auto d = load_draft(rc);
  const DraftRun run = run_draft(*d, rc, 0, rc.hidden_width, captures(rc));
  expect_mla_path(*d, ops::MlaPath::Prefill);
  expect_matches_reference(run, rc, "prefill");
  // The MLA draft's absorbed path on the same step.
  if (!rc.mha) {
    d->set_mla_path(ops::MlaPath::Decode);
    const DraftRun dec = run_draft(*d, rc, 0, rc.hidden_width, captures(rc));
    expect_mla_path(*d, ops::MlaPath::Decode);
    expect_matches_reference(dec, rc, "prefill-absorbed");
  }
}

// One position per row per step, the cache lengths advancing: step 0 with the first capture
// rows, then one token and its capture row per step for all rows together.
TEST_P(Eagle3Reference, OnePositionPerStepMatchesReference) {
  const DraftRefCase rc = test::load_draft_case(GetParam());
  auto d = load_draft(rc);
  const DraftRun run = run_draft(*d, rc, 1, rc.hidden_width, captures(rc));
  expect_mla_path(*d, ops::MlaPath::Decode);
  expect_matches_reference(run, rc, "one-per-step");
  // Chunks of 5 positions: a prefill over cached context.
  expect_matches_reference(run_draft(*d, rc, 5, rc.hidden_width, captures(rc)), rc, "chunks-of-5");
}

// H-wide rows go in as the fused hidden itself (the draft's own output at its later steps): fed
// fc(aux) computed here, the draft gives the reference's outputs again.
TEST_P(Eagle3Reference, HiddenWideRowsSkipTheFc) {
  const DraftRefCase rc = test::load_draft_case(GetParam());
  auto d = load_draft(rc);
  const WeightStore store(rc.draft);
  const std::vector<float> fc = to_host(store.get("fc.weight"));  // [H, 3H]
  const uint32_t H = rc.hidden, K = rc.hidden_width;
  std::vector<std::vector<float>> fused(rc.seqs.size());
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    const auto& aux = rc.seqs[b].target_hidden;
    const size_t S = rc.seqs[b].tokens.size();
    fused[b].resize(S * H);
    for (size_t t = 0; t < S; ++t)
      for (uint32_t o = 0; o < H; ++o) {
        double acc = 0;
        for (uint32_t k = 0; k < K; ++k) acc += double(aux[t * K + k]) * fc[size_t(o) * K + k];
        fused[b][t * H + o] = float(acc);
      }
  }
  const DraftRun run = run_draft(
      *d, rc, 0, H, [&](size_t b, uint32_t p) { return fused[b].data() + size_t(p) * H; });
  expect_matches_reference(run, rc, "hidden-wide");
}

INSTANTIATE_TEST_SUITE_P(Cases, Eagle3Reference, ::testing::ValuesIn(test::case_ids("eagle3")),
                         case_name);

// ---- two data-parallel replicas ----------------------------------------------------------------

// The speculative shape of draft steps: step 0 over every row's first positions with the target's
// captures (logits for the last one), then one-token steps that read the previous step's own
// output rows and its greedy token. Returns every step's logits and hidden rows.
std::vector<std::vector<float>> speculative_steps(Eagle3Draft& d, const DraftRefCase& rc,
                                                  const std::vector<uint32_t>& splits, int K) {
  const size_t B = rc.seqs.size();
  std::vector<uint32_t> prompt, lengths;
  for (size_t b = 0; b < B; ++b) {
    prompt.push_back(uint32_t(rc.seqs[b].tokens.size()) / 2);
    lengths.push_back(prompt.back() + K);
  }
  const PageLayout pl = plan_pages(lengths, splits, 16);
  d.allocate_kv_cache(pl.pages, 16);
  StepInputs in;
  in.lookup_table = pl.table;
  in.pages_per_row = pl.pages_per_row;
  in.data_parallel_splits = splits;
  in.input_row_offsets = {0};
  for (size_t b = 0; b < B; ++b) {
    for (uint32_t p = 0; p < prompt[b]; ++p) in.tokens.push_back(rc.seqs[b].tokens[p + 1]);
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
  }
  in.logits_per_row.assign(B, 1);
  StepOutputs out = d.forward(in, upload_hidden(d, in, rc.hidden_width, captures(rc)), rc.hidden_width);
  std::vector<std::vector<float>> seen;
  for (int k = 0;; ++k) {
    const auto logits = out.read_logits();
    EXPECT_EQ(out.rows, B);
    seen.push_back(logits);
    seen.push_back(out.read_hidden());
    if (k == K) break;
    for (size_t b = 0; b < B; ++b) {
      in.cache_lengths[b] += in.row_length(b);
      in.tokens[b] = argmax(logits.data() + b * rc.vocab, rc.vocab);
    }
    in.tokens.resize(B);
    for (size_t b = 0; b <= B; ++b) in.input_row_offsets[b] = uint32_t(b);
    in.input_row_offsets.resize(B + 1);
    out = d.forward(in, out.hidden, out.hidden_width);
  }
  return seen;
}

class Eagle3DataParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(Eagle3DataParallel, TwoSubDevicesGiveOneDeviceRows) {
  const DraftRefCase rc = test::load_draft_case(GetParam());
  auto single = load_draft(rc);
  const DraftRun want = run_draft(*single, rc, 0, rc.hidden_width, captures(rc));
  const auto want_spec = speculative_steps(*single, rc, {}, 3);

  DeviceManager mgr(test::cpu_devices("2"));
  ASSERT_EQ(mgr.size(), 2u);
  auto d = eagle3_deepseek_v3::load(rc.target, rc.draft, replicas(mgr));
  EXPECT_EQ(d->devices().size(), 2u);
  // Rows 0, 1 on device 0 and row 2 on device 1; then all on device 1 (device 0 idle).
  for (const std::vector<uint32_t>& splits : {std::vector<uint32_t>{0, 2, 3}, {0, 0, 3}}) {
    const DraftRun got = run_draft(*d, rc, 0, rc.hidden_width, captures(rc), splits);
    const float dl = max_abs_diff(got.logits, want.logits),
                dh = max_abs_diff(got.hidden, want.hidden);
    std::cout << "[ eagle3 2 devices ] " << rc.id << " splits " << splits[1] << ": logits " << dl
              << ", hidden " << dh << "\n";
    // Each replica computes its rows as one device would, in the same order: bitwise equal.
    EXPECT_EQ(dl, 0.0f);
    EXPECT_EQ(dh, 0.0f);
    EXPECT_LT(compare(got, rc).logits, kTolerance);
    const DraftRun steps = run_draft(*d, rc, 1, rc.hidden_width, captures(rc), splits);
    EXPECT_LE(max_abs_diff(steps.logits, want.logits), kTolerance);
    // Step 0 with captures, then 3 steps on the draft's own rows, each replica's on its device.
    const auto spec = speculative_steps(*d, rc, splits, 3);
    ASSERT_EQ(spec.size(), want_spec.size());
    for (size_t i = 0; i < spec.size(); ++i)
      EXPECT_LE(max_abs_diff(spec[i], want_spec[i]), kSameTolerance) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Eagle3DataParallel,
                         ::testing::Values("deepseek-v3-tiny-grouped-bf16/short.eagle3",
                                           "deepseek-v3-tiny-grouped-fp8/short.eagle3mha"),
                         case_name);

// ---- a reduced draft vocabulary (d2t) ----------------------------------------------------------

std::filesystem::path reference_ckpt(const std::string& name) {
  return test::reference_dir() / "ckpt" / name;
}

// A copy of `src` with its config edited and its tensors replaced/added.
std::filesystem::path edited_draft(
    const std::string& name, const std::filesystem::path& src,
    const std::function<void(nlohmann::json&)>& edit_config,
    const std::function<void(std::vector<TensorToWrite>&)>& edit_tensors = {}) {
  const auto dir = test::temp_dir(name);
  auto cfg = read_json_file(src / "config.json");
  edit_config(cfg);
  std::ofstream(dir / "config.json") << cfg.dump(1);
  if (!edit_tensors) {
    std::filesystem::create_symlink(src / "model.safetensors", dir / "model.safetensors");
    return dir;
  }
  const WeightStore store(src);
  std::vector<TensorToWrite> tensors;
  for (const auto& n : store.names()) {
    const TensorView& v = store.get(n);
    tensors.push_back({n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.bytes)});
  }
  edit_tensors(tensors);
  write_safetensors(dir / "model.safetensors", tensors);
  return dir;
}

TensorToWrite& tensor(std::vector<TensorToWrite>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

template <class T>
TensorToWrite make_tensor(const std::string& name, DType dt, const std::vector<T>& v) {
  TensorToWrite t{name, dt, {int64_t(v.size())}, std::vector<uint8_t>(v.size() * sizeof(T))};
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

// A draft vocabulary of 200 of the target's 512 ids (spread out, sorted as d2t >= 0 wants), lm_head
// rows taken from the full draft: the logits at mapped ids are the full draft's, the rest -inf. In
// both kernel shapes (the GPU shape forced on PoCL: draft_vocab.cl's draft_to_target_vocab_wg).
class Eagle3DraftVocabulary : public test::BothShapes {};
TEST_P(Eagle3DraftVocabulary, D2tSpreadsTheDraftLogitsOverTargetIds) {
  const DraftRefCase rc = test::load_draft_case("deepseek-v3-tiny-grouped-bf16/short.eagle3");
  std::vector<int64_t> ids;  // sorted target ids, as d2t = target - draft >= 0
  for (int64_t t = 0; t < 512 && ids.size() < 200; ++t)
    if ((t * 5 + 1) % 13 < 5 || t % 2 == 0) ids.push_back(t);
  ASSERT_EQ(ids.size(), 200u);
  std::vector<int64_t> d2t;
  std::vector<uint8_t> t2d(512, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    d2t.push_back(ids[i] - int64_t(i));
    t2d[size_t(ids[i])] = 1;
  }
  auto vocab = [&](nlohmann::json& c) { c["draft_vocab_size"] = 200; };
  auto with_maps = [&](std::vector<TensorToWrite>& ts) {
    TensorToWrite& head = tensor(ts, "lm_head.weight");
    const size_t row = size_t(head.shape[1]) * 2;  // bf16
    std::vector<uint8_t> rows;
    for (int64_t t : ids)
      rows.insert(rows.end(), head.data.begin() + t * row, head.data.begin() + (t + 1) * row);
    head.data = rows;
    head.shape[0] = 200;
    ts.push_back(make_tensor("d2t", DType::I64, d2t));
    ts.push_back(make_tensor("t2d", DType::Bool, t2d));
  };
  const auto dir = edited_draft("eagle3-d2t", rc.draft, vocab, with_maps);
  auto d = eagle3_deepseek_v3::load(rc.target, dir, one_device());
  EXPECT_FALSE(d->vocab_map().identity);
  EXPECT_EQ(d->info().vocab_size, 512u);
  const DraftRun run = run_draft(*d, rc, 0, rc.hidden_width, captures(rc));
  float worst = 0;
  size_t unmapped = 0;
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    const auto& got = run.logits[b];
    const auto& want = rc.seqs[b].draft_logits;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (t2d[i % 512]) {
        worst = std::max(worst, std::abs(got[i] - want[i]));
      } else {
        EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << i;
        ++unmapped;
      }
    }
    EXPECT_LT(max_abs_diff(run.hidden[b], rc.seqs[b].draft_hidden), kTolerance);
  }
  std::cout << "[ eagle3 d2t ] max |logit diff| at mapped ids " << worst << "\n";
  EXPECT_LT(worst, kTolerance);
  EXPECT_GT(unmapped, 0u);

  // A t2d that disagrees with d2t, and a d2t pointing outside the target vocabulary.
  auto expect_error = [&](const std::string& name,
                          const std::function<void(std::vector<TensorToWrite>&)>& edit,
                          const std::string& want) {
    const auto bad = edited_draft(name, rc.draft, vocab, [&](std::vector<TensorToWrite>& ts) {
      with_maps(ts);
      edit(ts);
    });
    try {
      eagle3_deepseek_v3::load(rc.target, bad, one_device());
      ADD_FAILURE() << "expected an error containing " << want;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  expect_error(
      "eagle3-bad-t2d", [](auto& ts) { tensor(ts, "t2d").data[1] ^= 1; }, "'t2d'");
  expect_error(
      "eagle3-bad-d2t",
      [](auto& ts) {
        int64_t big = 1000;
        std::memcpy(tensor(ts, "d2t").data.data() + 8 * 199, &big, 8);
      },
      "outside the target vocabulary");
}
INSTANTIATE_TEST_SUITE_P(Shapes, Eagle3DraftVocabulary,
                         test::both_shapes(), test::ShapeParamName());

// ---- drafts that do not fit their target -------------------------------------------------------

void expect_load_error(const std::filesystem::path& target, const std::filesystem::path& draft,
                       const std::vector<std::string>& wants) {
  try {
    eagle3_deepseek_v3::load(target, draft, one_device());
    ADD_FAILURE() << "expected an error from " << draft;
  } catch (const std::runtime_error& e) {
    for (const auto& w : wants)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
          << "want '" << w << "' in: " << e.what();
  }
}

class Eagle3BadDraft : public ::testing::TestWithParam<std::string> {};

TEST_P(Eagle3BadDraft, ErrorsNameTheFileAndKey) {
  const auto src = reference_ckpt(GetParam());
  const auto target = reference_ckpt("deepseek-v3-tiny-grouped-bf16");
  const std::string tag = GetParam().find("mha") != std::string::npos ? "mha" : "mla";
  auto edited = [&](const std::string& what, const std::function<void(nlohmann::json&)>& e) {
    return edited_draft("eagle3-bad-" + tag + "-" + what, src, e);
  };
  const std::string cfg = "config.json";
  const std::string aux = "eagle_config.eagle_aux_hidden_state_layer_ids";
  expect_load_error(target, edited("hidden", [](auto& c) { c["hidden_size"] = 64; }),
                    {cfg, "'hidden_size'", "64", "target's hidden_size 128"});
  expect_load_error(target, edited("target-hidden", [](auto& c) { c["target_hidden_size"] = 96; }),
                    {cfg, "'target_hidden_size'", "96"});
  expect_load_error(target,
                    edited("vocab",
                           [](auto& c) {
                             c["vocab_size"] = 1024;
                             c["draft_vocab_size"] = 1024;
                           }),
                    {cfg, "'vocab_size'", "1024", "target's vocab_size 512"});
  expect_load_error(target, edited("draft-vocab", [](auto& c) { c["draft_vocab_size"] = 256; }),
                    {cfg, "'draft_vocab_size'", "256", "no 'd2t'"});
  expect_load_error(target,
                    edited("aux0",
                           [](auto& c) {
                             c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {0, 1, 2};
                           }),
                    {cfg, aux, "id 0", "embedding"});
  expect_load_error(target,
                    edited("aux4",
                           [](auto& c) {
                             c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 2, 4};
                           }),
                    {cfg, aux, "id 4 is out of range", "3 decoder layers"});
  expect_load_error(target, edited("aux-missing", [](auto& c) { c.erase("eagle_config"); }),
                    {cfg, aux, "missing"});
  expect_load_error(target,
                    edited("aux2",
                           [](auto& c) {
                             c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 3};
                           }),
                    {"model.safetensors", "'fc.weight' reads 3 x H", aux});
  // A Llama target has no DeepSeek-V3 config.
  expect_load_error(reference_ckpt("llama3-tiny-f32"), src,
                    {"config.json", "architectures", "needs a DeepSeek-V3 target"});
}

INSTANTIATE_TEST_SUITE_P(Drafts, Eagle3BadDraft,
                         ::testing::Values("deepseek-v3-tiny-grouped-eagle3-bf16",
                                           "deepseek-v3-tiny-grouped-eagle3mha-bf16"),
                         [](const auto& info) {
                           return std::string(info.param.find("mha") != std::string::npos ? "mha"
                                                                                          : "mla");
                         });

// The trained draft of ../shared/models (f32, kv_lora 48, captures of target layers 0, 1, 3) loads
// over its target; with made-up capture rows, a prefill step and one position per step agree.
TEST(Eagle3TrainedDraft, LoadsOverItsTargetAndPrefillEqualsSteps) {
  const auto target = test::shared_dir() / "models/dsv3-mtp-trained";
  const auto draft = test::shared_dir() / "models/dsv3-mtp-trained-eagle3";
  auto d = eagle3_deepseek_v3::load(target, draft, one_device());
  EXPECT_EQ(d->kind(), DraftKind::Mla);
  EXPECT_EQ(d->info().target_layers, (std::vector<uint32_t>{0, 1, 3}));
  EXPECT_EQ(d->info().target_hidden_width, 576u);
  EXPECT_EQ(d->info().vocab_size, 2048u);
  DraftRefCase rc;
  rc.vocab = 2048;
  rc.hidden = 192;
  rc.hidden_width = 576;
  for (int b = 0; b < 2; ++b) {
    test::DraftRefSequence s;
    for (int i = 0; i < 11 + 6 * b; ++i) s.tokens.push_back((i * 37 + b * 11) % 2000 + 3);
    for (size_t i = 0; i < s.tokens.size() * 576; ++i)
      s.target_hidden.push_back(std::sin(0.37f * i + b));
    rc.seqs.push_back(std::move(s));
  }
  const DraftRun all = run_draft(*d, rc, 0, rc.hidden_width, captures(rc));
  const DraftRun steps = run_draft(*d, rc, 1, rc.hidden_width, captures(rc));
  const float dl = max_abs_diff(all.logits, steps.logits);
  std::cout << "[ eagle3 trained draft ] prefill vs one per step: " << dl << "\n";
  EXPECT_LT(dl, 1e-4f);
  EXPECT_LT(max_abs_diff(all.hidden, steps.hidden), 1e-4f);
}

}  // namespace
}  // namespace clshard
