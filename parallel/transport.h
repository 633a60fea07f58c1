// How the payload of a collective's exchange phase reaches the ranks that consume it. The
// collectives (collectives.h) are written once against this interface: they say which pieces each
// destination reads, enqueue the consumers (copies, rank-ordered reductions) on the destinations'
// queues, and leave the transport to move the data and to know when it is safe to.
//
// One phase:
//   open_phase   every rank vouches for its payload (a "ready" signal behind the work that wrote
//                it); the transport makes each piece readable on its destination device and
//                returns where (a View), waiting on the host for the peers it needs — a peer that
//                stays silent past the deadline is a CollectiveError, never a hang;
//   (the collective enqueues its consumers, each listing its View's wait event)
//   close_phase  the transport orders each source's later work after the consumers that read its
//                buffers in place, and every rank signals that it is done with the phase.
//
// OpenClTransport (opencl_transport.h) is the in-process implementation over OpenCL: same-context
// device copies, a zero-copy host arena between contexts on host-memory devices, and host staging
// otherwise. MpiTransport (mpi_transport.h) implements the same calls between processes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cl.h"

namespace clshard {
class Device;
}

namespace clshard::parallel {

// A run of f32 values in a device buffer.
struct DeviceSpan {
  cl::Mem buf;
  size_t offset_floats = 0;
  size_t count_floats = 0;
};

class Transport {
 public:
  // A piece of payload rank `dst` consumes: `span`, on rank `src`.
  struct Piece {
    size_t src = 0, dst = 0;
    DeviceSpan span;
  };
  // Where the destination reads a piece.
  struct View {
    DeviceSpan span;   // a buffer of the destination's context
    cl::Event wait;    // a consumer lists it in its wait list when set
    // The view is the source's own buffer: the consumers that read it must be handed back to
    // close_phase (readers_of[src]) so the source does not overwrite it under them.
    bool reads_source_buffer = false;
  };
  struct Stats {
    uint64_t bytes_staged = 0;     // payload bytes that passed through host memory
    double host_wait_seconds = 0;  // time the host spent waiting for peers
  };

  virtual ~Transport() = default;

  virtual size_t size() const = 0;  // ranks
  // Whether this process drives rank `rank` (its device, its consumers). Every rank is local in
  // process; over MPI (mpi_transport.h) only this process's own. device() is for local ranks.
  virtual bool is_local(size_t rank) const { return true; }
  virtual Device& device(size_t rank) const = 0;

  // Starts a phase: one View per piece, in order. `name` names the collective in errors.
  virtual std::vector<View> open_phase(const std::string& name,
                                       const std::vector<Piece>& pieces) = 0;
  // Ends the phase open_phase started: readers_of[r] are the consumer events that read rank r's
  // buffers in place (the pieces whose View reads_source_buffer).
  virtual void close_phase(const std::string& name,
                           const std::vector<std::vector<cl::Event>>& readers_of) = 0;

  // Host values of equal length per rank: per_rank[r] is filled for the local ranks; the call fills
  // the others' (from their processes), under the same deadline as a phase. Nothing to do when
  // every rank is local.
  virtual void share_host(const std::string& name, std::vector<std::vector<uint32_t>>& per_rank) {}

  virtual const Stats& stats() const = 0;
  // How long a peer may stay silent before a phase fails.
  virtual void set_timeout(std::chrono::milliseconds t) = 0;
  // Test hook: while set, this rank never vouches for its payload (a peer that stalls).
  virtual void silence_rank_for_test(std::optional<size_t> rank) = 0;
};

}  // namespace clshard::parallel
