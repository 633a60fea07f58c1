#include "runtime/engine/structured/byte_dfa.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace clshard::structured {

namespace {

// Thompson NFA: a state either reads one byte out of a set (to `next`) or has epsilon edges.
struct Nfa {
  struct State {
    int32_t set = -1;  // index into sets, or -1 for an epsilon-only state
    int32_t next = -1;
    std::vector<int32_t> eps;
  };
  std::vector<State> states;
  std::vector<std::bitset<256>> sets;
  std::unordered_map<std::bitset<256>, int32_t> set_index;  // dedup of byte sets
  size_t limit = 0;

  int32_t add() {
    if (states.size() >= limit)
      throw std::invalid_argument("the expression is too large: its automaton would exceed " +
                                  std::to_string(limit) + " NFA states");
    states.emplace_back();
    return int32_t(states.size() - 1);
  }
  int32_t set_id(const std::bitset<256>& b) {
    auto [it, fresh] = set_index.emplace(b, int32_t(sets.size()));
    if (fresh) sets.push_back(b);
    return it->second;
  }
  void link(int32_t from, int32_t to) { states[size_t(from)].eps.push_back(to); }

  struct Frag {
    int32_t in, out;  // `out` has no edges yet
  };

  // Makes exactly r->nfa_states states (regex_ast.cpp counts them the same way).
  Frag build(const Regex& r) {
    switch (r->kind) {
      case RegexNode::Kind::Empty: {
        const int32_t s = add();
        return {s, s};
      }
      case RegexNode::Kind::Bytes: {
        const int32_t s = add(), e = add();
        states[size_t(s)].set = set_id(r->bytes);
        states[size_t(s)].next = e;
        return {s, e};
      }
      case RegexNode::Kind::Concat: {
        Frag f = build(r->children[0]);
        for (size_t i = 1; i < r->children.size(); ++i) {
          Frag g = build(r->children[i]);
          link(f.out, g.in);
          f.out = g.out;
        }
        return f;
      }
      case RegexNode::Kind::Alt: {
        const int32_t s = add(), e = add();
        for (const Regex& c : r->children) {
          Frag g = build(c);
          link(s, g.in);
          link(g.out, e);
        }
        return {s, e};
      }
      case RegexNode::Kind::Repeat:
        return build_repeat(r->children[0], r->children.size() > 1 ? r->children[1] : nullptr,
                            r->min, r->max);
    }
    throw std::logic_error("unknown regex node");
  }

  // item{min,max}, items separated by `sep` when given.
  Frag build_repeat(const Regex& item, const Regex& sep, uint32_t min, uint32_t max) {
    const int32_t s = add();
    Frag f{s, s};
    auto append = [&](const Frag& g) {
      link(f.out, g.in);
      f.out = g.out;
    };
    uint32_t made = 0;
    // Mandatory copies, keeping the last one back when the tail is a loop (it becomes the loop).
    const uint32_t fixed = max == kUnbounded && min > 0 ? min - 1 : min;
    for (; made < fixed; ++made) {
      if (made > 0 && sep) append(build(sep));
      append(build(item));
    }
    if (max == kUnbounded) {
      // One copy of the item with a back edge (through the separator): item (sep item)*.
      const int32_t e = add();
      const int32_t entry = add();
      if (made > 0 && sep) {
        Frag sp = build(sep);
        link(entry, sp.in);
        Frag it = build(item);
        link(sp.out, it.in);
        link(it.out, e);
        link(it.out, entry);
      } else {
        Frag it = build(item);
        link(entry, it.in);
        link(it.out, e);
        if (sep) {
          Frag sp = build(sep);
          link(it.out, sp.in);
          link(sp.out, it.in);
        } else {
          link(it.out, it.in);
        }
      }
      link(f.out, entry);
      if (min == 0) link(f.out, e);  // zero items
      f.out = e;
      return f;
    }
    // Optional copies: (item (item (...)?)?)?, every one can stop.
    const int32_t e = add();
    for (; made < max; ++made) {
      link(f.out, e);
      if (made > 0 && sep) append(build(sep));
      append(build(item));
    }
    link(f.out, e);
    f.out = e;
    return f;
  }
};

struct VecHash {
  size_t operator()(const std::vector<int32_t>& v) const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int32_t x : v) h = (h ^ uint32_t(x)) * 0x100000001b3ull;
    return size_t(h);
  }
};

}  // namespace

namespace {
thread_local uint64_t build_steps = 0;
}  // namespace

uint64_t ByteDfa::last_build_steps() { return build_steps; }

ByteDfa ByteDfa::build(const Regex& re, uint32_t max_states, uint64_t max_steps) {
  build_steps = 0;
  Nfa nfa;
  nfa.limit = size_t(max_states) * kNfaStatesPerState;
  // The tree knows its expanded size (RegexNode::nfa_states): one that shares subtrees can stand
  // for an automaton far larger than itself, refused here before any state is made.
  if (re->nfa_states > nfa.limit)
    throw std::invalid_argument("the expression is too large: its automaton would exceed " +
                                std::to_string(nfa.limit) + " NFA states");
  // Building the NFA is work the closures below do not count: charged here, before it is done
  // (((a{500}){1000}), 1,002,002 states, took 3.8-5.5 s in the fuzz build before the DFA
  // construction refused it; refused here now).
  if (re->nfa_states > max_steps / kStepsPerNfaState)
    throw std::invalid_argument(
        "the expression is too large: its automaton's " + std::to_string(re->nfa_states) +
        " NFA states would take more than " + std::to_string(max_steps) + " steps to build");
  // Exactly this many states are made (regex_ast.cpp counts them as Nfa::build makes them): one
  // allocation instead of a table grown and moved by doubling, which was most of the time above.
  nfa.states.reserve(size_t(re->nfa_states));
  const Nfa::Frag top = nfa.build(re);
  const int32_t accept = top.out;
  const size_t N = nfa.states.size();

  ByteDfa dfa;
  dfa.nfa_states_ = uint32_t(N);
  // Byte classes: bytes no set tells apart behave the same everywhere.
  {
    std::array<uint32_t, 256> cls{};
    uint32_t count = 1;
    for (const auto& set : nfa.sets) {
      std::map<std::pair<uint32_t, bool>, uint32_t> split;
      uint32_t next = 0;
      for (int b = 0; b < 256; ++b) {
        auto [it, fresh] = split.emplace(std::make_pair(cls[size_t(b)], bool(set[size_t(b)])), next);
        if (fresh) ++next;
        cls[size_t(b)] = it->second;
      }
      count = next;
    }
    dfa.num_classes_ = count;
    for (int b = 0; b < 256; ++b) dfa.class_of_[size_t(b)] = uint16_t(cls[size_t(b)]);
  }
  const uint32_t C = dfa.num_classes_;
  std::vector<uint8_t> class_rep(C);
  for (int b = 255; b >= 0; --b) class_rep[dfa.class_of_[size_t(b)]] = uint8_t(b);

  // Epsilon closure, keeping the states that read a byte and the accept state. Past its seeds a
  // closure pushes each state once, so its stack and its kept states fit N slots more than the
  // seeds: buffers grown to that before the walk and filled by index (a push_back per state had
  // been a tenth of the fuzz build's time in api_request).
  std::vector<uint32_t> mark(N, 0);
  uint32_t epoch = 0;
  std::vector<int32_t> stack, kept;
  uint64_t steps = re->nfa_states * kStepsPerNfaState;  // <= max_steps (checked above)
  build_steps = steps;
  auto spend = [&](uint64_t n) {
    steps += n;
    build_steps = steps;
    if (steps > max_steps)
      throw std::invalid_argument("the expression is too large: building its automaton would "
                                  "take more than " + std::to_string(max_steps) + " steps");
  };
  // Into `out` (reused: no allocation per transition once the buffers have grown).
  auto closure = [&](const std::vector<int32_t>& seeds, std::vector<int32_t>& out) {
    ++epoch;
    if (stack.size() < N + seeds.size()) {
      stack.resize(N + seeds.size());
      kept.resize(N + seeds.size());
    }
    size_t top = 0, n_kept = 0;
    uint64_t visited = 0;
    for (int32_t s : seeds) {
      mark[size_t(s)] = epoch;
      stack[top++] = s;
    }
    while (top > 0) {
      const int32_t s = stack[--top];
      ++visited;
      const auto& st = nfa.states[size_t(s)];
      if (st.set >= 0 || s == accept) kept[n_kept++] = s;
      for (int32_t t : st.eps)
        if (mark[size_t(t)] != epoch) {
          mark[size_t(t)] = epoch;
          stack[top++] = t;
        }
    }
    spend(visited);
    std::sort(kept.begin(), kept.begin() + ptrdiff_t(n_kept));
    out.assign(kept.begin(), kept.begin() + ptrdiff_t(n_kept));
  };

  std::unordered_map<std::vector<int32_t>, int32_t, VecHash> ids;
  std::vector<std::vector<int32_t>> sets;
  std::vector<int32_t> seeds = {top.in}, target;
  closure(seeds, target);
  sets.push_back(target);
  ids.emplace(sets[0], 0);
  std::vector<int32_t> trans;
  std::vector<uint8_t> accepting;
  for (size_t d = 0; d < sets.size(); ++d) {
    accepting.push_back(std::binary_search(sets[d].begin(), sets[d].end(), accept));
    for (uint32_t c = 0; c < C; ++c) {
      const uint8_t b = class_rep[c];
      // A transition costs more than the NFA states it reads: counted (byte_dfa.h).
      spend(sets[d].size() + kStepsPerTransition);
      seeds.clear();
      for (int32_t s : sets[d]) {
        const auto& st = nfa.states[size_t(s)];
        if (st.set >= 0 && nfa.sets[size_t(st.set)][b]) seeds.push_back(st.next);
      }
      if (seeds.empty()) {
        trans.push_back(kDead);
        continue;
      }
      closure(seeds, target);
      auto it = ids.find(target);
      if (it == ids.end()) {
        if (sets.size() >= max_states)
          throw std::invalid_argument("the expression is too large: its automaton would exceed " +
                                      std::to_string(max_states) + " states");
        it = ids.emplace(target, int32_t(sets.size())).first;
        sets.push_back(target);
      }
      trans.push_back(it->second);
    }
  }
  const size_t D = sets.size();

  // Keep only the states from which an accepting state can be reached.
  std::vector<std::vector<int32_t>> preds(D);
  for (size_t d = 0; d < D; ++d)
    for (uint32_t c = 0; c < C; ++c)
      if (trans[d * C + c] != kDead) preds[size_t(trans[d * C + c])].push_back(int32_t(d));
  std::vector<uint8_t> live(D, 0);
  std::vector<int32_t> todo;
  for (size_t d = 0; d < D; ++d)
    if (accepting[d]) {
      live[d] = 1;
      todo.push_back(int32_t(d));
    }
  while (!todo.empty()) {
    const int32_t d = todo.back();
    todo.pop_back();
    for (int32_t p : preds[size_t(d)])
      if (!live[size_t(p)]) {
        live[size_t(p)] = 1;
        todo.push_back(p);
      }
  }
  if (!live[0]) throw std::invalid_argument("the expression matches no string");
  std::vector<int32_t> renum(D, kDead);
  int32_t n = 0;
  for (size_t d = 0; d < D; ++d)
    if (live[d]) renum[d] = n++;
  dfa.trans_.assign(size_t(n) * C, kDead);
  dfa.accepting_.assign(size_t(n), 0);
  dfa.has_next_.assign(size_t(n), 0);
  for (size_t d = 0; d < D; ++d) {
    if (!live[d]) continue;
    const size_t nd = size_t(renum[d]);
    dfa.accepting_[nd] = accepting[d];
    for (uint32_t c = 0; c < C; ++c) {
      const int32_t t = trans[d * C + c];
      const int32_t nt = t == kDead ? kDead : renum[size_t(t)];
      dfa.trans_[nd * C + c] = nt;
      if (nt != kDead) dfa.has_next_[nd] = 1;
    }
  }
  return dfa;
}

}  // namespace clshard::structured
