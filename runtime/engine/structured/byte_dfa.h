// A deterministic automaton over bytes, built from a Regex tree (regex_ast.h): Thompson NFA, then
// the subset construction over byte equivalence classes, then every state that cannot reach an
// accepting state is removed, so any path the DFA allows can still be completed.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "runtime/engine/structured/regex_ast.h"

namespace clshard::structured {

class ByteDfa {
 public:
  static constexpr int32_t kDead = -1;

  // The subset construction's work, counted in NFA states visited (about 10 ns each) plus
  // kStepsPerTransition for each DFA transition computed: at most about 0.5 s of CPU (".{1000}"
  // five times, 18.4 M steps: 0.46 s user + system); any JSON object takes 1.26 M. Few
  // enough states can still each hold hundreds of NFA states (an exploding branch beside a long
  // optional run), and many states can each hold a few (".{1000}" ten times: 190,000 states,
  // which took 2.3 s when transitions were not counted), so the steps bound the time and memory
  // (states x byte classes <= steps) where the state count alone does not.
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  static constexpr uint64_t kMaxBuildSteps = 20'000'000;
#else
  // The fuzz build (ASan, UBSan and libFuzzer's coverage) took 90-430 ns a step in the fuzz
  // campaigns, against 3-10 ns in a clang -O2 build: the budget shrinks so that an input which
  // spends it (any JSON object still compiles) stays inside the fuzzers' 1 s hang limit at the
  // slowest step rate (0.65 s), and that limit still catches any work the steps do not count.
  static constexpr uint64_t kMaxBuildSteps = 1'500'000;
#endif
  // What one DFA transition costs beyond the NFA states it reads (setting up the closure, looking
  // up the target state, often a cache miss), in steps' time: measured 100-150 ns in Release.
  static constexpr uint64_t kStepsPerTransition = 12;
  // What one NFA state costs, charged for the whole tree (RegexNode::nfa_states) before any is
  // made: building it, measured 26-68 ns in Release once the state table is reserved (3-10 steps'
  // time; 360-570 ns before, when ((a{500}){1000})'s 1,002,002 states took 0.54 s). At 10 the
  // Release budget pays for more than kMaxNfaStates, so only the fuzz build (1,500,000 steps:
  // 150,000 NFA states) refuses a tree for it; 20 would refuse a 3,000-property object schema
  // (147,782 NFA states and 17.7 M steps of DFA construction) in Release.
  static constexpr uint64_t kStepsPerNfaState = 10;

  // The most DFA states build() makes by default, and the NFA states it allows per DFA state;
  // kMaxNfaStates is the largest tree (RegexNode::nfa_states) build() takes by default, and the
  // JSON schema compiler's budget too (json_schema.h).
  static constexpr uint32_t kMaxStates = 200'000;
  static constexpr uint64_t kNfaStatesPerState = 8;
  static constexpr uint64_t kMaxNfaStates = uint64_t(kMaxStates) * kNfaStatesPerState;
  // The largest tree build() takes with its default limits: within kMaxNfaStates, and no more
  // NFA states than kMaxBuildSteps pays for at kStepsPerNfaState each (kMaxNfaStates in Release,
  // 150,000 in the fuzz build). The JSON schema compiler refuses past it too (json_schema.h),
  // naming where the schema passed it.
  static constexpr uint64_t kMaxBuildNfaStates =
      kMaxNfaStates < kMaxBuildSteps / kStepsPerNfaState ? kMaxNfaStates
                                                          : kMaxBuildSteps / kStepsPerNfaState;

  // Throws std::invalid_argument when the expression matches no string at all, or when the
  // automaton would exceed max_states states (max_states * kNfaStatesPerState NFA states) or
  // max_steps steps (the message gives the limit). The tree's NFA states are charged
  // (kStepsPerNfaState each) before the NFA is built: a tree too large for the steps is refused
  // before any state is made.
  static ByteDfa build(const Regex& re, uint32_t max_states = kMaxStates,
                       uint64_t max_steps = kMaxBuildSteps);
  // Steps the last build() on this thread took (for the tests and benchmarks).
  static uint64_t last_build_steps();

  int32_t start() const { return 0; }
  int32_t next(int32_t state, uint8_t byte) const {
    return trans_[size_t(state) * num_classes_ + class_of_[byte]];
  }
  // kDead when any byte leads out of the language.
  int32_t walk(int32_t state, std::string_view bytes) const {
    for (unsigned char c : bytes) {
      if (state == kDead) return kDead;
      state = next(state, c);
    }
    return state;
  }
  bool accepting(int32_t state) const { return accepting_[size_t(state)] != 0; }
  // Some byte leads on from this state.
  bool has_next(int32_t state) const { return has_next_[size_t(state)] != 0; }
  // Whether the whole byte string is in the language.
  bool matches(std::string_view bytes) const {
    const int32_t s = walk(start(), bytes);
    return s != kDead && accepting(s);
  }
  uint32_t num_states() const { return uint32_t(accepting_.size()); }
  uint32_t num_classes() const { return num_classes_; }
  uint32_t nfa_states() const { return nfa_states_; }
  // The memory its tables hold: the transitions, the per-state flags and the byte classes.
  size_t table_bytes() const {
    return sizeof(class_of_) + trans_.capacity() * sizeof(int32_t) + accepting_.capacity() +
           has_next_.capacity();
  }

 private:
  std::array<uint16_t, 256> class_of_{};
  uint32_t num_classes_ = 0;
  std::vector<int32_t> trans_;  // [state][class] -> state or kDead
  std::vector<uint8_t> accepting_, has_next_;
  uint32_t nfa_states_ = 0;
};

}  // namespace clshard::structured
