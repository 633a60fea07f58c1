// The transport between processes (launched by mpirun), each driving one or more OpenCL devices:
// the payload between processes moves over MPI, between the devices of one process by the
// in-process routes (the destination reads the source's buffer where they share a context, else
// through host memory). Built only when CMake found OpenMPI (CLSHARD_HAVE_MPI); mpi.h stays out of
// this header.
//
// Ranks: the transport's processes (its group, in world-rank order) each drive k devices, the same
// k everywhere; process p holds ranks [p * k, p * k + k), so over the whole world (color 0) rank
// d is the deployment's device d as parallel::Topology numbers them. A Communicator over an
// MpiTransport has that many ranks, but only this process's are local (Transport::is_local): the
// collectives take a span per rank as before, the spans of remote ranks carrying only their
// lengths (no buffer), and consumers run on the local devices only.
//
// One phase (open_phase): receives from every peer process that sends this one a piece are posted
// first; the local pieces bound for peers are read to host memory (Device::read, behind the
// producers the caller enqueued) and sent; the host polls the requests (MPI_Test, nonblocking)
// until all are done or the deadline passes — a peer that died or never answers is a
// CollectiveError naming the collective, the epoch and the MPI rank(s) still owed, never a hang.
// Received pieces are written into one device staging buffer per local device and the consumers
// read them there. Pieces between processes are matched by (source, tag = epoch) and MPI's in-order
// delivery, so both ends enumerate a phase's pieces in the same order (the Communicator builds them
// from every rank's lengths).
//
// Host buffers (one outbox, two inboxes alternating by epoch parity) and the device staging
// buffers grow to the largest phase seen and are then reused: no allocation per step. After an
// error the transport refuses further phases (the peers' state is unknown); the process should end
// with abort_world().
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/transport.h"

namespace clshard::parallel {

struct MpiTransportOptions {
  std::chrono::milliseconds timeout{30000};  // how long a peer may stay silent
};

// MPI_Init_thread once per process (MPI_THREAD_FUNNELED), finalized at exit. Safe to call twice.
void mpi_init(int* argc, char*** argv);
bool mpi_initialized();
int mpi_world_rank();
int mpi_world_size();
// This process's index among the ranks on its node (MPI_COMM_TYPE_SHARED): which of the node's
// devices it drives when a deployment's selection names several.
int mpi_local_rank();
// How many processes mpirun started with this one (OpenMPI's or PMI's environment, readable
// before MPI_Init); 0 when not started by mpirun.
int mpirun_processes();
// Ends every rank of the job with `code` (MPI_Abort): after a collective failed, peers may be
// blocked in a phase this rank will never enter.
[[noreturn]] void abort_world(int code);
// Host-side collectives the ranks' drivers use outside the device data path (step inputs, plan
// counts). Blocking, without a deadline of their own beyond MPI's; `name` names them in errors.
void mpi_broadcast_bytes(std::vector<char>& bytes, int root);
void mpi_barrier();
std::vector<std::vector<uint32_t>> mpi_allgather_u32(const std::vector<uint32_t>& mine);

class MpiTransport final : public Transport {
 public:
  // This process is MPI rank mpi_world_rank() of mpi_world_size() and drives `device`.
  explicit MpiTransport(Device& device, MpiTransportOptions options = {});
  // This process drives `devices` (the same count in every process of the group). The group is
  // the processes that pass the same `color` (MPI_Comm_split, collective over the world: every
  // process constructs its MpiTransports in the same order, each passing one color).
  MpiTransport(std::vector<Device*> devices, int color, MpiTransportOptions options = {});
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  size_t size() const override { return size_; }
  // The first local rank (this process's index in the group times devices_per_process()).
  size_t rank() const { return rank_; }
  size_t devices_per_process() const { return devices_.size(); }
  bool is_local(size_t r) const override { return r >= rank_ && r < rank_ + devices_.size(); }
  Device& device(size_t r) const override;
  std::vector<View> open_phase(const std::string& name, const std::vector<Piece>& pieces) override;
  void close_phase(const std::string& name,
                   const std::vector<std::vector<cl::Event>>& readers_of) override;
  void share_host(const std::string& name, std::vector<std::vector<uint32_t>>& per_rank) override;
  const Stats& stats() const override { return stats_; }
  void set_timeout(std::chrono::milliseconds t) override { options_.timeout = t; }
  // While set to a local rank, the phase posts no sends (a peer that never answers).
  void silence_rank_for_test(std::optional<size_t> r) override { silent_ = r; }

 private:
  struct Buffers;
  // Refuses after a failure, counts the epoch (and runs the stop hook); returns the epoch.
  uint32_t begin_exchange(const std::string& name);
  // The CollectiveError naming the collective, the epoch and the ranks still owed.
  [[noreturn]] void fail(const std::string& name, uint32_t epoch, const std::vector<size_t>& owing,
                         const std::string& why);
  size_t process_of(size_t r) const { return r / devices_.size(); }
  size_t local_index(size_t r) const { return r - rank_; }
  std::vector<Device*> devices_;  // this process's: ranks rank_ .. rank_ + devices_.size() - 1
  MpiTransportOptions options_;
  size_t rank_ = 0, size_ = 1;
  size_t process_ = 0, processes_ = 1;  // this process in the group, the group's processes
  std::vector<int> world_rank_;         // of each process of the group (errors name them)
  // Test hook (CLSHARD_TEST_MPI_STOP="rank:epoch[:kill]"): that rank stops (SIGSTOP: a peer that
  // never answers mid-step) or is killed (SIGKILL) as it opens that epoch's exchange.
  std::optional<std::pair<size_t, uint32_t>> stop_at_;
  int stop_signal_ = 0;
  std::unique_ptr<Buffers> buf_;
  uint32_t epoch_ = 0;
  bool broken_ = false;
  std::optional<size_t> silent_;
  Stats stats_;
};

}  // namespace clshard::parallel
