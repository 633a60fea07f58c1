// Host-driven collectives over a group of devices: allgather, reduce-scatter, allreduce, broadcast
// and the expert-parallel all-to-all of rows. Rank i is devices[i].
//
// How one exchange phase runs (every collective is one or two phases): the collective says which
// pieces of payload each destination reads; its Transport (transport.h) makes them readable there,
// waiting for the peers' signals (a silent peer is a CollectiveError after the timeout, never a
// hang: no kernel waits on another device); the collective enqueues the consumers on each
// destination's queue — device-side copies (clEnqueueCopyBuffer) and rank-order reductions
// (kernels_cl/collectives.cl); the transport then orders each source after the consumers that
// read its buffers in place, so work the caller enqueues next on that rank cannot overwrite data a
// peer is still reading, and every rank signals "done". The caller enqueues the producers first,
// then calls the collective. The calls return once the work is enqueued; results are ordered on
// each destination's queue, so the caller just keeps enqueuing there (finish or read to see them
// on the host).
//
// In one process the transport is OpenClTransport (opencl_transport.h): same-context copies, a
// zero-copy host arena between contexts on host-memory devices, host staging otherwise. Between
// processes it is MpiTransport (mpi_transport.h): each process passes every rank's spans (a remote
// rank's with its length only) and runs the consumers of its own rank.
//
// Sums are rank-ordered (((r0 + r1) + r2) + r3) and each element is summed once by one device, so
// every rank ends with bitwise the same values, equal to the single-device twin in the same order.
//
// Not thread-safe: one host thread drives a Communicator. Spans of one call must not overlap except
// where a collective says (in-place allgather and allreduce).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/opencl_transport.h"
#include "parallel/signals.h"  // CollectiveError
#include "parallel/transport.h"
#include "runtime/cl.h"

namespace clshard {
class Device;
}

namespace clshard::parallel {

// The in-process transport's options (timeout, forced host staging and read polling for tests).
using CommunicatorOptions = OpenClTransportOptions;

class Communicator {
 public:
  // Over the devices of this process (OpenClTransport).
  explicit Communicator(std::vector<Device*> devices, CommunicatorOptions options = {});
  explicit Communicator(std::unique_ptr<Transport> transport);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  size_t size() const { return transport_->size(); }
  // Whether this process drives rank `rank`: always in process; over MPI, its own rank only. The
  // spans of remote ranks carry only their lengths (the other process holds the data).
  bool is_local(size_t rank) const { return transport_->is_local(rank); }
  Device& device(size_t rank) const { return transport_->device(rank); }
  bool same_context(size_t a, size_t b) const;

  // recv[j] = send[0] ++ send[1] ++ ... (rank order) on every rank j. Counts may differ and be 0;
  // recv[j] needs room for their sum. In place: send[j] may already sit at its place in recv[j].
  void allgather(const std::vector<DeviceSpan>& send, const std::vector<DeviceSpan>& recv,
                 const char* what);

  // Every send[i] has the same length L = sum(shard_counts); recv[j] (shard_counts[j] floats)
  // gets sum_i send[i][off_j, off_j + shard_counts[j]) in rank order, off_j = the shards before j.
  // Shards may be uneven or 0. recv[j] may be send[j]'s own shard j (in place).
  void reduce_scatter(const std::vector<DeviceSpan>& send, const std::vector<size_t>& shard_counts,
                      const std::vector<DeviceSpan>& recv, const char* what);

  // In place, equal lengths: every bufs[j] becomes sum_i bufs[i] in rank order. Reduce-scatter
  // (each rank sums one shard) then allgather: two phases, each rank moves about 2L floats.
  void allreduce(const std::vector<DeviceSpan>& bufs, const char* what);

  // The column-sharded allgather (vocab-parallel lm_head and embedding): send[i] is a row-major
  // [rows, cols_i] block (cols_i = count / rows, may be 0); recv[j] gets the row-major
  // [rows, sum_i cols_i] matrix whose column block i is send[i], in rank order.
  void allgather_columns(const std::vector<DeviceSpan>& send, const std::vector<DeviceSpan>& recv,
                         size_t rows, const char* what);

  // bufs[j] = bufs[root] for every j (equal lengths).
  void broadcast(size_t root, const std::vector<DeviceSpan>& bufs, const char* what);

  // Expert-parallel exchange of rows of `width` floats. send[i][j]: the rows rank i sends to rank
  // j (a span on device i, a whole number of rows, possibly 0). recv[j] gets, in source-rank
  // order, every row sent to j: send[0][j] ++ send[1][j] ++ ... Dispatch and combine are both
  // this call (combine with the roles of the spans swapped).
  void all_to_all_rows(const std::vector<std::vector<DeviceSpan>>& send,
                       const std::vector<DeviceSpan>& recv, size_t width, const char* what);

  // Host values of equal length per rank (the counts of an exchange): per_rank[r] is set for the
  // local ranks; afterwards every entry is. Only MPI has anything to move.
  void share_host(std::vector<std::vector<uint32_t>>& per_rank, const char* what) {
    transport_->share_host(what, per_rank);
  }

  // The shard of each rank that allreduce uses for a vector of `count` floats: as even as
  // possible in whole 16-float blocks (the reduction kernel's vector width), the remainder spread
  // over the first ranks.
  static std::vector<size_t> even_shards(size_t count, size_t ranks);

  void set_timeout(std::chrono::milliseconds t) { transport_->set_timeout(t); }
  // Test hook: this rank's "ready" signal is never enqueued (a peer that stalls).
  void silence_rank_for_test(std::optional<size_t> rank) {
    transport_->silence_rank_for_test(rank);
  }

  // What the collectives did so far (for perf/ and `clshard bench`).
  struct Stats {
    uint64_t collectives = 0;
    uint64_t phases = 0;
    uint64_t bytes_moved = 0;      // payload bytes copied or read by reductions from peers
    uint64_t bytes_staged = 0;     // of which through host memory (different contexts)
    double host_wait_seconds = 0;  // time the host spent waiting for signals
  };
  const Stats& stats() const { return stats_; }

 private:
  struct Copy {
    size_t src, dst;
    DeviceSpan from, to;  // `to` spans the destination's first row .. last row when rows > 0
    // A block of `rows` rows of `cols` floats (from: contiguous) into rows `dst_pitch` apart.
    size_t rows = 0, cols = 0, dst_pitch = 0;
  };
  struct Reduce {
    size_t dst;
    std::vector<DeviceSpan> inputs;  // inputs[i] on rank i, equal counts
    DeviceSpan out;
  };
  void run_phase(const std::string& name, const std::vector<Copy>& copies,
                 const std::vector<Reduce>& reduces);
  void check_span(const std::string& name, const char* role, size_t rank, size_t index,
                  const DeviceSpan& s) const;
  cl::Mem& reduce_temp(size_t rank, size_t floats);

  std::unique_ptr<Transport> transport_;
  std::vector<cl::Mem> reduce_temp_;            // per rank: partial sums when ranks > 8
  std::vector<size_t> reduce_temp_floats_;
  Stats stats_;
};

}  // namespace clshard::parallel
