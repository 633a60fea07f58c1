#include "parallel/mpi_transport.h"

#include <mpi.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "parallel/signals.h"  // CollectiveError
#include "runtime/device.h"

namespace clshard::parallel {

namespace {

constexpr size_t kAlign = 64;  // bytes: pieces start on cache lines
size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Host memory that grows to the largest phase and is then reused.
struct HostBuffer {
  std::unique_ptr<char, FreeDeleter> data;
  size_t bytes = 0;
  char* reserve(size_t need) {
    if (need > bytes) {
      const size_t n = round_up(std::max(need, bytes * 2), 4096);
      data.reset(static_cast<char*>(std::aligned_alloc(4096, n)));
      if (!data) throw std::bad_alloc();
      bytes = n;
    }
    return data.get();
  }
};

void check_mpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw std::runtime_error(what + ": " + std::string(msg, size_t(len)));
}

struct PollFailure {
  std::vector<size_t> owing;  // the ranks still owed, ascending
  std::string why;
};

// Polls the requests (peer[i]: the rank request i waits on) with MPI_Test until all are done or
// `timeout` passes; on failure cancels what is left and says who is owed.
std::optional<PollFailure> poll(std::vector<MPI_Request>& reqs, const std::vector<size_t>& peer,
                                std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<bool> done(reqs.size(), false);
  size_t remaining = reqs.size();
  auto pause = std::chrono::microseconds(0);
  while (remaining > 0) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (done[i]) continue;
      int flag = 0;
      const int rc = MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        return PollFailure{{peer[i]}, "failed: " + std::string(msg, size_t(len))};
      }
      if (flag) {
        done[i] = true;
        --remaining;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      PollFailure f;
      for (size_t i = 0; i < reqs.size(); ++i)
        if (!done[i] && std::find(f.owing.begin(), f.owing.end(), peer[i]) == f.owing.end())
          f.owing.push_back(peer[i]);
      std::sort(f.owing.begin(), f.owing.end());
      // The job ends after this error (abort_world); the requests are given back as far as MPI
      // allows.
      for (size_t i = 0; i < reqs.size(); ++i)
        if (!done[i]) MPI_Cancel(&reqs[i]);
      f.why = "did not answer within " + std::to_string(timeout.count()) +
              " ms; the peer died, stalled or never reached this collective";
      return f;
    }
    // Spin briefly, then back off to at most 200 us so a waiting rank leaves the cores to peers.
    if (pause.count() > 0) std::this_thread::sleep_for(pause);
    pause = std::min(std::chrono::microseconds(200), pause + std::chrono::microseconds(10));
  }
  return std::nullopt;
}

// The nonblocking requests of one exchange, each with the rank it waits on.
struct Requests {
  std::vector<MPI_Request> reqs;
  std::vector<size_t> peer;
  // `rank`: the peer process in `comm`.
  void post(MPI_Comm comm, bool send, void* buf, size_t count, MPI_Datatype type, size_t rank,
            int tag, const std::string& name) {
    MPI_Request rq;
    const int rc = send ? MPI_Isend(buf, int(count), type, int(rank), tag, comm, &rq)
                        : MPI_Irecv(buf, int(count), type, int(rank), tag, comm, &rq);
    check_mpi(rc, name + (send ? ": MPI_Isend to rank " : ": MPI_Irecv from rank ") +
                      std::to_string(rank));
    reqs.push_back(rq);
    peer.push_back(rank);
  }
};

void finalize_at_exit() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}

}  // namespace

void mpi_init(int* argc, char*** argv) {
  if (mpi_initialized()) return;
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  // Errors come back as codes (and become exceptions naming the call), not as aborts.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  std::atexit(finalize_at_exit);
}

bool mpi_initialized() {
  int init = 0;
  MPI_Initialized(&init);
  return init != 0;
}

int mpi_world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int mpi_world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

int mpi_local_rank() {
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_free(&node);
  return r;
}

int mpirun_processes() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return 0;
}

void abort_world(int code) {
  std::cerr << std::flush;
  std::cout << std::flush;
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void mpi_broadcast_bytes(std::vector<char>& bytes, int root) {
  unsigned long long n = bytes.size();
  check_mpi(MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, MPI_COMM_WORLD), "MPI_Bcast (length)");
  bytes.resize(size_t(n));
  if (n) check_mpi(MPI_Bcast(bytes.data(), int(n), MPI_CHAR, root, MPI_COMM_WORLD), "MPI_Bcast");
}

void mpi_barrier() { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }

std::vector<std::vector<uint32_t>> mpi_allgather_u32(const std::vector<uint32_t>& mine) {
  const int n = mpi_world_size();
  std::vector<int> counts(static_cast<size_t>(n)), displs(static_cast<size_t>(n), 0);
  int c = int(mine.size());
  check_mpi(MPI_Allgather(&c, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD),
            "MPI_Allgather (counts)");
  for (int i = 1; i < n; ++i) displs[size_t(i)] = displs[size_t(i) - 1] + counts[size_t(i) - 1];
  std::vector<uint32_t> all(size_t(displs.back() + counts.back()));
  check_mpi(MPI_Allgatherv(mine.data(), c, MPI_UINT32_T, all.data(), counts.data(), displs.data(),
                           MPI_UINT32_T, MPI_COMM_WORLD),
            "MPI_Allgatherv");
  std::vector<std::vector<uint32_t>> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    out[size_t(i)].assign(all.begin() + displs[size_t(i)],
                          all.begin() + displs[size_t(i)] + counts[size_t(i)]);
  return out;
}

struct MpiTransport::Buffers {
  MPI_Comm comm = MPI_COMM_NULL;  // the group's
  HostBuffer outbox;
  HostBuffer inbox[2];  // alternating by epoch parity; one region per local device
  // Per local device: the staging write that last read each inbox, and the staging buffer.
  std::vector<cl::Event> inbox_written[2];
  std::vector<cl::Mem> staging;
  std::vector<size_t> staging_bytes;
};

MpiTransport::MpiTransport(Device& device, MpiTransportOptions options)
    : MpiTransport(std::vector<Device*>{&device}, 0, options) {}

MpiTransport::MpiTransport(std::vector<Device*> devices, int color, MpiTransportOptions options)
    : devices_(std::move(devices)), options_(options), buf_(std::make_unique<Buffers>()) {
  if (!mpi_initialized())
    throw std::logic_error("MpiTransport: MPI is not initialized (call parallel::mpi_init)");
  if (devices_.empty()) throw std::invalid_argument("MpiTransport: no device");
  const int world = mpi_world_rank();
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, color, world, &buf_->comm), "MPI_Comm_split");
  MPI_Comm_set_errhandler(buf_->comm, MPI_ERRORS_RETURN);
  int p = 0, n = 1;
  MPI_Comm_rank(buf_->comm, &p);
  MPI_Comm_size(buf_->comm, &n);
  process_ = size_t(p);
  processes_ = size_t(n);
  // Every process of the group says its world rank and device count.
  const int mine[2] = {world, int(devices_.size())};
  std::vector<int> all(size_t(2 * n));
  check_mpi(MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, buf_->comm), "MPI_Allgather");
  for (int i = 0; i < n; ++i) {
    world_rank_.push_back(all[size_t(2 * i)]);
    if (all[size_t(2 * i + 1)] != int(devices_.size()))
      throw std::invalid_argument("MpiTransport: MPI rank " + std::to_string(all[size_t(2 * i)]) +
                                  " drives " + std::to_string(all[size_t(2 * i + 1)]) +
                                  " device(s), MPI rank " + std::to_string(world) + " " +
                                  std::to_string(devices_.size()) +
                                  "; every process of a group needs the same count");
  }
  rank_ = process_ * devices_.size();
  size_ = processes_ * devices_.size();
  for (auto& w : buf_->inbox_written) w.resize(devices_.size());
  buf_->staging.resize(devices_.size());
  buf_->staging_bytes.assign(devices_.size(), 0);
  if (const char* t = std::getenv("CLSHARD_MPI_TIMEOUT_MS"); t && std::atol(t) > 0)
    options_.timeout = std::chrono::milliseconds(std::atol(t));
  if (const char* s = std::getenv("CLSHARD_TEST_MPI_STOP")) {
    unsigned long r = 0, e = 0;
    char how[8] = "";
    const int k = std::sscanf(s, "%lu:%lu:%7s", &r, &e, how);
    if (k >= 2) stop_at_ = {{size_t(r), uint32_t(e)}};
    stop_signal_ = k == 3 && std::string(how) == "kill" ? SIGKILL : SIGSTOP;
  }
}

MpiTransport::~MpiTransport() {
  // Staging writes may still read the inboxes.
  for (Device* d : devices_) clFinish(d->queue());
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin && buf_->comm != MPI_COMM_NULL) MPI_Comm_free(&buf_->comm);
}

Device& MpiTransport::device(size_t r) const {
  if (!is_local(r))
    throw std::logic_error("MpiTransport: rank " + std::to_string(r) +
                           "'s device lives in another process (this one holds ranks " +
                           std::to_string(rank_) + ".." +
                           std::to_string(rank_ + devices_.size() - 1) + ")");
  return *devices_[local_index(r)];
}

uint32_t MpiTransport::begin_exchange(const std::string& name) {
  if (broken_)
    throw std::runtime_error(name + ": the MPI transport failed in an earlier collective");
  ++epoch_;
  if (stop_at_ && stop_at_->first == size_t(world_rank_[process_]) && stop_at_->second == epoch_)
    std::raise(stop_signal_);
  return epoch_;
}

void MpiTransport::fail(const std::string& name, uint32_t epoch, const std::vector<size_t>& owing,
                        const std::string& why) {
  broken_ = true;
  std::ostringstream msg;
  msg << name << ": MPI rank " << world_rank_[process_] << " of " << mpi_world_size()
      << " at epoch " << epoch << ": ";
  std::string who = "MPI rank ";
  for (size_t i = 0; i < owing.size(); ++i) {
    const int w = world_rank_.at(owing[i]);
    msg << (i ? ", " : "") << "rank " << w;
    who += (i ? "," : "") + std::to_string(w);
  }
  msg << " " << why;
  throw CollectiveError(name, epoch, who, msg.str());
}

std::vector<Transport::View> MpiTransport::open_phase(const std::string& name,
                                                      const std::vector<Piece>& pieces) {
  const uint32_t epoch = begin_exchange(name);
  const int tag = int(epoch % 32000) + 1;  // MPI guarantees tags up to 32767
  const size_t k = devices_.size();
  HostBuffer& inbox = buf_->inbox[epoch % 2];
  auto& inbox_written = buf_->inbox_written[epoch % 2];

  // How each piece travels: between processes (outbox / inbox), between local devices of one
  // context (the destination reads the source's buffer), or of two (through the inbox).
  enum class Route { None, Send, Receive, Direct, Host };
  std::vector<Route> route(pieces.size(), Route::None);
  std::vector<size_t> at(pieces.size(), 0);  // byte offset in the outbox or the inbox region
  std::vector<size_t> region_bytes(k, 0);
  size_t out_bytes = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    const size_t bytes = round_up(pc.span.count_floats * sizeof(float), kAlign);
    if (bytes == 0 || pc.src == pc.dst) continue;
    const bool src_here = is_local(pc.src), dst_here = is_local(pc.dst);
    if (src_here && !dst_here) {
      route[p] = Route::Send;
      at[p] = out_bytes;
      out_bytes += bytes;
    } else if (dst_here) {
      const bool direct = src_here && devices_[local_index(pc.src)]->context() ==
                                          devices_[local_index(pc.dst)]->context();
      route[p] = direct ? Route::Direct : src_here ? Route::Host : Route::Receive;
      if (direct) continue;
      at[p] = region_bytes[local_index(pc.dst)];
      region_bytes[local_index(pc.dst)] += bytes;
    }
  }
  std::vector<size_t> region_at(k, 0);
  size_t in_bytes = 0;
  for (size_t i = 0; i < k; ++i) {
    region_at[i] = in_bytes;
    in_bytes += region_bytes[i];
  }
  // The staging writes of the phase that last used this inbox must be done reading it.
  for (auto& ev : inbox_written) {
    if (!ev) continue;
    cl_event e = ev.get();
    cl::check(clWaitForEvents(1, &e), name + ": waiting for an earlier staging write");
    ev = cl::Event();
  }
  char* out = buf_->outbox.reserve(out_bytes);
  char* in = inbox.reserve(in_bytes);
  auto in_at = [&](size_t p) { return in + region_at[local_index(pieces[p].dst)] + at[p]; };

  // Receives first, so a peer's send finds them posted.
  Requests rq;
  for (size_t p = 0; p < pieces.size(); ++p)
    if (route[p] == Route::Receive)
      rq.post(buf_->comm, false, in_at(p), pieces[p].span.count_floats, MPI_FLOAT,
              process_of(pieces[p].src), tag, name);
  // This process's outgoing pieces to host memory (Device::read waits for the producers), then
  // out; pieces between local devices of different contexts straight into the inbox.
  const bool silent = silent_ && is_local(*silent_);
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    if (route[p] != Route::Send && route[p] != Route::Host) continue;
    const size_t bytes = pc.span.count_floats * sizeof(float);
    char* host = route[p] == Route::Send ? out + at[p] : in_at(p);
    devices_[local_index(pc.src)]->read(pc.span.buf, host, bytes,
                                        pc.span.offset_floats * sizeof(float));
    stats_.bytes_staged += bytes;
    if (route[p] == Route::Send && !silent)
      rq.post(buf_->comm, true, host, pc.span.count_floats, MPI_FLOAT, process_of(pc.dst), tag,
              name);
  }

  // Poll until every request is done or the deadline passes.
  const auto start = std::chrono::steady_clock::now();
  if (auto err = poll(rq.reqs, rq.peer, options_.timeout)) fail(name, epoch, err->owing, err->why);
  stats_.host_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Received pieces onto each local device: one staging buffer, one write.
  for (size_t i = 0; i < k; ++i) {
    if (region_bytes[i] == 0) continue;
    Device& dev = *devices_[i];
    if (buf_->staging_bytes[i] < region_bytes[i]) {
      buf_->staging_bytes[i] =
          round_up(std::max(region_bytes[i], buf_->staging_bytes[i] * 2), 4096);
      buf_->staging[i] = dev.alloc(buf_->staging_bytes[i]);
    }
    cl_event ev = nullptr;
    cl::check(clEnqueueWriteBuffer(dev.queue(), buf_->staging[i].get(), CL_FALSE, 0,
                                   region_bytes[i], in + region_at[i], 0, nullptr, &ev),
              name + ": staging received pieces into " + dev.label());
    inbox_written[i] = cl::Event(ev);
    stats_.bytes_staged += region_bytes[i];
  }
  std::vector<View> views(pieces.size());
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    if (!is_local(pc.dst)) continue;  // consumed in another process
    switch (route[p]) {
      case Route::None:  // this rank's own buffer (or nothing), on its own queue
        views[p].span = pc.span;
        break;
      case Route::Direct: {
        // The destination reads the source's buffer once the source's producers are done; the
        // source waits for those readers in close_phase.
        cl_event marker = nullptr;
        Device& src = *devices_[local_index(pc.src)];
        cl::check(clEnqueueMarkerWithWaitList(src.queue(), 0, nullptr, &marker),
                  name + ": marking the payload on " + src.label());
        src.flush();
        views[p].span = pc.span;
        views[p].wait = cl::Event(marker);
        views[p].reads_source_buffer = true;
        break;
      }
      default:
        views[p].span = {buf_->staging[local_index(pc.dst)], at[p] / sizeof(float),
                         pc.span.count_floats};
    }
  }
  return views;
}

void MpiTransport::share_host(const std::string& name,
                              std::vector<std::vector<uint32_t>>& per_rank) {
  if (per_rank.size() != size_)
    throw std::invalid_argument(name + ": " + std::to_string(per_rank.size()) + " entries for " +
                                std::to_string(size_) + " ranks");
  const uint32_t epoch = begin_exchange(name);
  const int tag = int(epoch % 32000) + 1;
  const size_t k = devices_.size(), L = per_rank[rank_].size();
  // This process's ranks' values, one after another; the same from every peer.
  std::vector<uint32_t> mine;
  for (size_t i = 0; i < k; ++i) {
    if (per_rank[rank_ + i].size() != L)
      throw std::logic_error(name + ": the local ranks disagree on the length");
    mine.insert(mine.end(), per_rank[rank_ + i].begin(), per_rank[rank_ + i].end());
  }
  std::vector<std::vector<uint32_t>> theirs(processes_);
  // Point to point rather than MPI_Iallgather: a peer that never comes is then a request to name.
  Requests rq;
  for (size_t q = 0; q < processes_; ++q) {
    if (q == process_) continue;
    theirs[q].assign(mine.size(), 0);
    rq.post(buf_->comm, false, theirs[q].data(), mine.size(), MPI_UINT32_T, q, tag, name);
  }
  const bool silent = silent_ && is_local(*silent_);
  for (size_t q = 0; q < processes_ && !silent; ++q)
    if (q != process_)
      rq.post(buf_->comm, true, mine.data(), mine.size(), MPI_UINT32_T, q, tag, name);
  const auto start = std::chrono::steady_clock::now();
  if (auto err = poll(rq.reqs, rq.peer, options_.timeout)) fail(name, epoch, err->owing, err->why);
  stats_.host_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t q = 0; q < processes_; ++q) {
    if (q == process_) continue;
    for (size_t i = 0; i < k; ++i)
      per_rank[q * k + i].assign(theirs[q].begin() + std::ptrdiff_t(i * L),
                                 theirs[q].begin() + std::ptrdiff_t((i + 1) * L));
  }
}

void MpiTransport::close_phase(const std::string& name,
                               const std::vector<std::vector<cl::Event>>& readers_of) {
  // Between processes the peers' data arrived in host copies, and each local device's consumers
  // of staged pieces are on its own queue. A local source whose buffer another local device read
  // in place waits for those readers before its later work can overwrite it.
  for (size_t i = 0; i < devices_.size(); ++i) {
    const auto& readers = readers_of.at(rank_ + i);
    if (readers.empty()) continue;
    std::vector<cl_event> w;
    for (const auto& e : readers) w.push_back(e.get());
    cl::check(clEnqueueBarrierWithWaitList(devices_[i]->queue(), cl_uint(w.size()), w.data(),
                                           nullptr),
              name + ": ordering " + devices_[i]->label() + " after its readers");
  }
}

}  // namespace clshard::parallel
