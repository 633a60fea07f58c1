#include "parallel/opencl_transport.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <stdexcept>

#include "runtime/device.h"

namespace clshard::parallel {

namespace {

constexpr size_t kStagingAlign = 64;  // bytes: staged pieces start on cache lines

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace

// Host memory that cross-context transfers pass through.
struct OpenClTransport::Arena {
  std::unique_ptr<void, FreeDeleter> host;
  size_t bytes = 0;
  std::map<cl_context, cl::Mem> wrapped;  // the arena as a zero-copy buffer in each context
  uint32_t last_use = 0;                  // epoch whose consumers read it (0: none pending)
};

OpenClTransport::OpenClTransport(std::vector<Device*> devices, OpenClTransportOptions options)
    : devices_(std::move(devices)), options_(options) {
  if (devices_.empty()) throw std::invalid_argument("Communicator: no devices");
  for (size_t i = 0; i < devices_.size(); ++i)
    if (!devices_[i]) throw std::invalid_argument("Communicator: device " + std::to_string(i) +
                                                  " is null");
  for (Device* d : devices_) queues_.push_back(cl::Queue::retain(d->queue()));
  SignalOptions so;
  so.timeout = options_.timeout;
  so.force_read_polling = options_.force_read_polling;
  signals_ = std::make_unique<SignalBuffers>(devices_, so);
  for (int i = 0; i < 2; ++i) arenas_.push_back(std::make_unique<Arena>());
  staging_in_.resize(size());
  staging_in_bytes_.assign(size(), 0);
}

OpenClTransport::~OpenClTransport() {
  // Enqueued copies may still read or write the arenas' host memory.
  for (const cl::Queue& q : queues_) clFinish(q.get());
}

bool OpenClTransport::same_context(size_t a, size_t b) const {
  return devices_.at(a)->context() == devices_.at(b)->context();
}

std::vector<Transport::View> OpenClTransport::open_phase(const std::string& name,
                                                         const std::vector<Piece>& pieces) {
  const size_t n = size();
  epoch_ = signals_->next_epoch();
  Arena& arena = *arenas_[epoch_ % 2];

  // The route of every piece, and its place in the arena when it goes through host memory.
  enum class Route { Direct, ZeroCopy, HostStaged };
  std::vector<Route> route(pieces.size(), Route::Direct);
  std::vector<size_t> arena_off(pieces.size(), 0);  // bytes
  size_t arena_bytes = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& in = pieces[p];
    if (in.span.count_floats == 0 || same_context(in.src, in.dst)) continue;
    const bool zero_copy = !options_.force_host_staging && signals_->zero_copy(in.src) &&
                           signals_->zero_copy(in.dst);
    route[p] = zero_copy ? Route::ZeroCopy : Route::HostStaged;
    arena_off[p] = arena_bytes;
    arena_bytes += round_up(in.span.count_floats * sizeof(float), kStagingAlign);
  }
  arena_in_use_ = arena_bytes > 0;

  if (arena_bytes > 0) {
    // The destinations that last read this arena must be done with it.
    if (arena.last_use) {
      std::vector<size_t> all(n);
      for (size_t r = 0; r < n; ++r) all[r] = r;
      signals_->wait_done(all, arena.last_use, name);
      arena.last_use = 0;
    }
    if (arena.bytes < arena_bytes) {
      // Pieces of a phase that failed may still be on their way into the old memory.
      for (Device* d : devices_) d->finish();
      const size_t bytes = round_up(std::max(arena_bytes, arena.bytes * 2), 4096);
      arena.wrapped.clear();
      arena.host.reset(std::aligned_alloc(4096, bytes));
      if (!arena.host) throw std::bad_alloc();
      arena.bytes = bytes;
    }
    // The sources copy their pieces into the zero-copy arena before they signal.
    for (size_t p = 0; p < pieces.size(); ++p) {
      if (route[p] != Route::ZeroCopy) continue;
      const Piece& in = pieces[p];
      for (size_t r : {in.src, in.dst}) {
        cl_context ctx = devices_[r]->context();
        if (arena.wrapped.count(ctx)) continue;
        cl_int err = CL_SUCCESS;
        arena.wrapped.emplace(ctx, cl::Mem(clCreateBuffer(ctx, CL_MEM_READ_WRITE |
                                                                   CL_MEM_USE_HOST_PTR,
                                                          arena.bytes, arena.host.get(), &err)));
        cl::check(err, name + ": wrapping the staging arena for " + devices_[r]->label());
      }
      Device& src = *devices_[in.src];
      cl::check(clEnqueueCopyBuffer(src.queue(), in.span.buf.get(),
                                    arena.wrapped.at(src.context()).get(),
                                    in.span.offset_floats * sizeof(float), arena_off[p],
                                    in.span.count_floats * sizeof(float), 0, nullptr, nullptr),
                name + ": staging a piece of " + src.label());
    }
  }

  // Every rank vouches for its payload; the host waits for the ranks and pairs it needs.
  std::vector<cl::Event> ready(n);
  for (size_t r = 0; r < n; ++r) ready[r] = signals_->signal_ready(r, epoch_);
  std::vector<SignalBuffers::ReadySlot> needed;
  for (size_t r = 0; r < n; ++r) needed.push_back({r, r});
  for (const Piece& in : pieces)
    if (in.span.count_floats && in.src != in.dst) needed.push_back({in.src, in.dst});
  const auto wait_start = std::chrono::steady_clock::now();
  signals_->wait_ready(needed, epoch_, name);
  stats_.host_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();

  // Where each destination finds its pieces.
  std::vector<size_t> staged_bytes(n, 0);
  for (size_t p = 0; p < pieces.size(); ++p)
    if (route[p] == Route::HostStaged)
      staged_bytes[pieces[p].dst] +=
          round_up(pieces[p].span.count_floats * sizeof(float), kStagingAlign);
  for (size_t r = 0; r < n; ++r) {
    if (staging_in_bytes_[r] < staged_bytes[r]) {
      staging_in_[r] = devices_[r]->alloc(staged_bytes[r]);
      staging_in_bytes_[r] = staged_bytes[r];
    }
  }
  std::vector<size_t> staged_at(n, 0);
  std::vector<View> views(pieces.size());
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& in = pieces[p];
    View& v = views[p];
    const size_t bytes = in.span.count_floats * sizeof(float);
    switch (route[p]) {
      case Route::Direct:
        v.span = in.span;
        // A consumer reading a peer's buffer in the same context lists the peer's signal (that
        // is what makes the peer's writes visible to it).
        if (in.src != in.dst) {
          v.wait = ready[in.src];
          v.reads_source_buffer = true;
        }
        break;
      case Route::ZeroCopy:
        v.span = {arena.wrapped.at(devices_[in.dst]->context()), arena_off[p] / sizeof(float),
                  in.span.count_floats};
        stats_.bytes_staged += bytes;
        break;
      case Route::HostStaged: {
        // The source is idle past its signal, so this blocking read returns at once; the write
        // into the destination's scratch is asynchronous and reads the arena until it completes,
        // which this arena's "done" wait covers before the arena is refilled.
        char* host = static_cast<char*>(arena.host.get()) + arena_off[p];
        devices_[in.src]->read(in.span.buf, host, bytes, in.span.offset_floats * sizeof(float));
        Device& dst = *devices_[in.dst];
        cl::check(clEnqueueWriteBuffer(dst.queue(), staging_in_[in.dst].get(), CL_FALSE,
                                       staged_at[in.dst], bytes, host, 0, nullptr, nullptr),
                  name + ": staging a piece into " + dst.label());
        v.span = {staging_in_[in.dst], staged_at[in.dst] / sizeof(float), in.span.count_floats};
        staged_at[in.dst] += round_up(bytes, kStagingAlign);
        stats_.bytes_staged += bytes;
        break;
      }
    }
  }
  return views;
}

void OpenClTransport::close_phase(const std::string& name,
                                  const std::vector<std::vector<cl::Event>>& readers_of) {
  const size_t n = size();
  // Sources wait for their readers before running what the caller enqueues next; everyone
  // signals that it is done with this phase.
  for (size_t r = 0; r < n && r < readers_of.size(); ++r) {
    if (readers_of[r].empty()) continue;
    std::vector<cl_event> w;
    for (const auto& e : readers_of[r]) w.push_back(e.get());
    cl::check(clEnqueueBarrierWithWaitList(devices_[r]->queue(), cl_uint(w.size()), w.data(),
                                           nullptr),
              name + ": ordering " + devices_[r]->label() + " after its readers");
  }
  for (size_t r = 0; r < n; ++r) signals_->signal_done(r, epoch_);
  if (arena_in_use_) arenas_[epoch_ % 2]->last_use = epoch_;
}

}  // namespace clshard::parallel
