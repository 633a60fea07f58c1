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
  void post(bool send, void* buf, size_t count, MPI_Datatype type, size_t rank, int tag,
            const std::string& name) {
    MPI_Request rq;
    const int rc = send ? MPI_Isend(buf, int(count), type, int(rank), tag, MPI_COMM_WORLD, &rq)
                        : MPI_Irecv(buf, int(count), type, int(rank), tag, MPI_COMM_WORLD, &rq);
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
  HostBuffer outbox;
  HostBuffer inbox[2];          // alternating by epoch parity
  cl::Event inbox_written[2];   // the staging write that last read each inbox
  cl::Mem staging;              // received pieces on the device
  size_t staging_bytes = 0;
};

MpiTransport::MpiTransport(Device& device, MpiTransportOptions options)
    : device_(&device), options_(options), buf_(std::make_unique<Buffers>()) {
  if (!mpi_initialized())
    throw std::logic_error("MpiTransport: MPI is not initialized (call parallel::mpi_init)");
  rank_ = size_t(mpi_world_rank());
  size_ = size_t(mpi_world_size());
  if (const char* t = std::getenv("CLSHARD_MPI_TIMEOUT_MS"); t && std::atol(t) > 0)
    options_.timeout = std::chrono::milliseconds(std::atol(t));
  if (const char* s = std::getenv("CLSHARD_TEST_MPI_STOP")) {
    unsigned long r = 0, e = 0;
    char how[8] = "";
    const int n = std::sscanf(s, "%lu:%lu:%7s", &r, &e, how);
    if (n >= 2) stop_at_ = {{size_t(r), uint32_t(e)}};
    stop_signal_ = n == 3 && std::string(how) == "kill" ? SIGKILL : SIGSTOP;
  }
}

MpiTransport::~MpiTransport() {
  // Staging writes may still read the inboxes.
  clFinish(device_->queue());
}

Device& MpiTransport::device(size_t r) const {
  if (r != rank_)
    throw std::logic_error("MpiTransport: rank " + std::to_string(r) +
                           "'s device lives in another process (this is rank " +
                           std::to_string(rank_) + ")");
  return *device_;
}

uint32_t MpiTransport::begin_exchange(const std::string& name) {
  if (broken_)
    throw std::runtime_error(name + ": the MPI transport failed in an earlier collective");
  ++epoch_;
  if (stop_at_ && stop_at_->first == rank_ && stop_at_->second == epoch_) std::raise(stop_signal_);
  return epoch_;
}

void MpiTransport::fail(const std::string& name, uint32_t epoch, const std::vector<size_t>& owing,
                        const std::string& why) {
  broken_ = true;
  std::ostringstream msg;
  msg << name << ": MPI rank " << rank_ << " of " << size_ << " at epoch " << epoch << ": ";
  std::string who = "MPI rank ";
  for (size_t i = 0; i < owing.size(); ++i) {
    msg << (i ? ", " : "") << "rank " << owing[i];
    who += (i ? "," : "") + std::to_string(owing[i]);
  }
  msg << " " << why;
  throw CollectiveError(name, epoch, who, msg.str());
}

std::vector<Transport::View> MpiTransport::open_phase(const std::string& name,
                                                      const std::vector<Piece>& pieces) {
  const uint32_t epoch = begin_exchange(name);
  const int tag = int(epoch % 32000) + 1;  // MPI guarantees tags up to 32767
  HostBuffer& inbox = buf_->inbox[epoch % 2];

  // Where each piece goes in host memory: outgoing ones in the outbox, incoming in the inbox.
  std::vector<size_t> at(pieces.size(), 0);
  size_t out_bytes = 0, in_bytes = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    const size_t bytes = pc.span.count_floats * sizeof(float);
    if (bytes == 0 || pc.src == pc.dst) continue;
    if (pc.src == rank_) {
      at[p] = out_bytes;
      out_bytes += round_up(bytes, kAlign);
    } else if (pc.dst == rank_) {
      at[p] = in_bytes;
      in_bytes += round_up(bytes, kAlign);
    }
  }
  // The staging write of the phase that last used this inbox must be done reading it.
  if (buf_->inbox_written[epoch % 2]) {
    cl_event e = buf_->inbox_written[epoch % 2].get();
    cl::check(clWaitForEvents(1, &e), name + ": waiting for an earlier staging write");
    buf_->inbox_written[epoch % 2] = cl::Event();
  }
  char* out = buf_->outbox.reserve(out_bytes);
  char* in = inbox.reserve(in_bytes);

  // Receives first, so a peer's send finds them posted.
  Requests rq;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    if (pc.span.count_floats == 0 || pc.dst != rank_ || pc.src == rank_) continue;
    rq.post(false, in + at[p], pc.span.count_floats, MPI_FLOAT, pc.src, tag, name);
  }
  // This rank's outgoing pieces to host memory (Device::read waits for the producers), then out.
  const bool silent = silent_ && *silent_ == rank_;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    if (pc.span.count_floats == 0 || pc.src != rank_ || pc.dst == rank_) continue;
    const size_t bytes = pc.span.count_floats * sizeof(float);
    device_->read(pc.span.buf, out + at[p], bytes, pc.span.offset_floats * sizeof(float));
    stats_.bytes_staged += bytes;
    if (!silent) rq.post(true, out + at[p], pc.span.count_floats, MPI_FLOAT, pc.dst, tag, name);
  }

  // Poll until every request is done or the deadline passes.
  const auto start = std::chrono::steady_clock::now();
  if (auto err = poll(rq.reqs, rq.peer, options_.timeout)) fail(name, epoch, err->owing, err->why);
  stats_.host_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Received pieces onto the device: one staging buffer, one write.
  std::vector<View> views(pieces.size());
  if (in_bytes > 0) {
    if (buf_->staging_bytes < in_bytes) {
      buf_->staging_bytes = round_up(std::max(in_bytes, buf_->staging_bytes * 2), 4096);
      buf_->staging = device_->alloc(buf_->staging_bytes);
    }
    cl_event ev = nullptr;
    cl::check(clEnqueueWriteBuffer(device_->queue(), buf_->staging.get(), CL_FALSE, 0, in_bytes,
                                   in, 0, nullptr, &ev),
              name + ": staging received pieces into " + device_->label());
    buf_->inbox_written[epoch % 2] = cl::Event(ev);
    stats_.bytes_staged += in_bytes;
  }
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    if (pc.dst != rank_) continue;  // consumed in another process
    if (pc.src == rank_ || pc.span.count_floats == 0) {
      views[p].span = pc.span;  // this rank's own buffer, on its own queue
    } else {
      views[p].span = {buf_->staging, at[p] / sizeof(float), pc.span.count_floats};
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
  const std::vector<uint32_t> mine = per_rank[rank_];
  // Point to point rather than MPI_Iallgather: a peer that never comes is then a request to name.
  Requests rq;
  for (size_t r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    per_rank[r].assign(mine.size(), 0);
    rq.post(false, per_rank[r].data(), mine.size(), MPI_UINT32_T, r, tag, name);
  }
  const bool silent = silent_ && *silent_ == rank_;
  for (size_t r = 0; r < size_ && !silent; ++r)
    if (r != rank_)
      rq.post(true, const_cast<uint32_t*>(mine.data()), mine.size(), MPI_UINT32_T, r, tag, name);
  const auto start = std::chrono::steady_clock::now();
  if (auto err = poll(rq.reqs, rq.peer, options_.timeout)) fail(name, epoch, err->owing, err->why);
  stats_.host_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t r = 0; r < size_; ++r)
    if (per_rank[r].size() != mine.size())
      throw std::logic_error(name + ": ranks disagree on the length");
}

void MpiTransport::close_phase(const std::string&, const std::vector<std::vector<cl::Event>>&) {
  // One device per process: the consumers are on the queue that runs this rank's later work, so
  // nothing can overwrite what they read; the peers' data arrived in host copies.
}

}  // namespace clshard::parallel
