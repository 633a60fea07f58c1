#include "runtime/engine/mpi_steps.h"

#include <cstring>
#include <stdexcept>

#include "parallel/mpi_transport.h"

namespace clshard {

namespace {

enum class Message : char { Stop = 0, Forward = 1, AllocateCache = 2 };

// Appends n bytes at p. resize + memcpy rather than vector::insert of a byte range, which GCC 12
// at -O2 flags with a false -Warray-bounds (a one-byte message grown by four).
void put_bytes(std::vector<char>& b, const void* p, size_t n) {
  const size_t at = b.size();
  b.resize(at + n);
  if (n) std::memcpy(b.data() + at, p, n);
}
void put_u32(std::vector<char>& b, uint32_t v) { put_bytes(b, &v, 4); }
template <class T>
void put_vec(std::vector<char>& b, const std::vector<T>& v) {
  put_u32(b, uint32_t(v.size()));
  put_bytes(b, v.data(), v.size() * sizeof(T));
}

struct Reader {
  const std::vector<char>& b;
  size_t at = 1;  // past the message kind
  uint32_t u32() {
    if (at + 4 > b.size()) throw std::runtime_error("MPI step message: truncated");
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    at += 4;
    return v;
  }
  template <class T>
  std::vector<T> vec() {
    const size_t n = u32();
    if (at + n * sizeof(T) > b.size()) throw std::runtime_error("MPI step message: truncated");
    std::vector<T> v(n);
    if (n) std::memcpy(v.data(), b.data() + at, n * sizeof(T));
    at += n * sizeof(T);
    return v;
  }
};

void broadcast(std::vector<char>& message) {
#ifdef CLSHARD_HAVE_MPI
  parallel::mpi_broadcast_bytes(message, 0);
#else
  throw std::logic_error("this build has no MPI transport (OpenMPI not found at build time)");
#endif
}

}  // namespace

std::vector<char> serialize_step(const StepInputs& s) {
  std::vector<char> b{char(Message::Forward)};
  put_vec(b, s.tokens);
  put_vec(b, s.input_row_offsets);
  put_vec(b, s.cache_lengths);
  put_vec(b, s.lookup_table);
  put_u32(b, s.pages_per_row);
  put_u32(b, uint32_t(s.return_logits));
  put_u32(b, s.return_n_logits);
  put_vec(b, s.logits_per_row);
  put_u32(b, uint32_t(s.return_hidden));
  put_vec(b, s.hidden_layers);
  put_vec(b, s.data_parallel_splits);
  return b;
}

StepInputs deserialize_step(const std::vector<char>& bytes) {
  if (bytes.empty() || bytes[0] != char(Message::Forward))
    throw std::runtime_error("MPI step message: not a step");
  Reader r{bytes};
  StepInputs s;
  s.tokens = r.vec<int32_t>();
  s.input_row_offsets = r.vec<uint32_t>();
  s.cache_lengths = r.vec<uint32_t>();
  s.lookup_table = r.vec<uint32_t>();
  s.pages_per_row = r.u32();
  s.return_logits = ReturnLogits(r.u32());
  s.return_n_logits = r.u32();
  s.logits_per_row = r.vec<uint32_t>();
  s.return_hidden = ReturnHidden(r.u32());
  s.hidden_layers = r.vec<uint32_t>();
  s.data_parallel_splits = r.vec<uint32_t>();
  return s;
}

void StepLeader::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  std::vector<char> m{char(Message::AllocateCache)};
  put_u32(m, num_pages);
  put_u32(m, page_size);
  broadcast(m);
  model_->allocate_kv_cache(num_pages, page_size);
}

StepOutputs StepLeader::forward(const StepInputs& step) {
  std::vector<char> m = serialize_step(step);
  broadcast(m);
  return model_->forward(step);
}

void serve_steps(CausalLM& model) {
  for (;;) {
    std::vector<char> m;
    broadcast(m);
    if (m.empty() || m[0] == char(Message::Stop)) return;
    if (m[0] == char(Message::AllocateCache)) {
      Reader r{m};
      const uint32_t pages = r.u32(), page_size = r.u32();
      model.allocate_kv_cache(pages, page_size);
    } else {
      model.forward(deserialize_step(m));
    }
  }
}

void stop_followers() {
  std::vector<char> m{char(Message::Stop)};
  broadcast(m);
}

}  // namespace clshard
