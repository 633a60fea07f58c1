// The in-process transport: every rank is an OpenCL device this process drives. A piece reaches its
// destination by one of three routes:
//   - same context: the destination reads the source's buffer directly (its consumer waits for the
//     source's "ready" signal, which makes the source's writes visible to it);
//   - different contexts, both devices sharing host memory (CL_DEVICE_HOST_UNIFIED_MEMORY, PoCL):
//     through one host arena wrapped as a buffer in each context (zero-copy: the source device
//     copies into it before it signals, the destination reads out of it);
//   - otherwise: the host reads from the source into the arena and writes into the destination's
//     staging buffer.
// Two arenas alternate by epoch parity, so a phase can fill one while the destinations of the
// previous phase still read the other; reuse waits for the "done" signals of the phase that last
// read it. Signals and deadlines are signals.h's.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "parallel/signals.h"
#include "parallel/transport.h"

namespace clshard::parallel {

struct OpenClTransportOptions {
  std::chrono::milliseconds timeout{30000};  // how long a peer may stay silent
  // Cross-context transfers through host reads/writes even where zero-copy staging would work, and
  // signal polling through reads: the paths discrete devices take, for tests.
  bool force_host_staging = false;
  bool force_read_polling = false;
};

class OpenClTransport final : public Transport {
 public:
  explicit OpenClTransport(std::vector<Device*> devices, OpenClTransportOptions options = {});
  ~OpenClTransport() override;
  OpenClTransport(const OpenClTransport&) = delete;
  OpenClTransport& operator=(const OpenClTransport&) = delete;

  size_t size() const override { return devices_.size(); }
  Device& device(size_t rank) const override { return *devices_.at(rank); }
  std::vector<View> open_phase(const std::string& name, const std::vector<Piece>& pieces) override;
  void close_phase(const std::string& name,
                   const std::vector<std::vector<cl::Event>>& readers_of) override;
  const Stats& stats() const override { return stats_; }
  void set_timeout(std::chrono::milliseconds t) override { signals_->set_timeout(t); }
  void silence_rank_for_test(std::optional<size_t> rank) override {
    signals_->silence_rank_for_test(rank);
  }

  SignalBuffers& signals() { return *signals_; }

 private:
  struct Arena;
  bool same_context(size_t a, size_t b) const;

  std::vector<Device*> devices_;
  std::vector<cl::Queue> queues_;  // retained: the destructor drains them even if a Device is gone
  OpenClTransportOptions options_;
  std::unique_ptr<SignalBuffers> signals_;
  std::vector<std::unique_ptr<Arena>> arenas_;  // two, alternating by epoch parity
  std::vector<cl::Mem> staging_in_;             // per rank: host-staged inputs (discrete devices)
  std::vector<size_t> staging_in_bytes_;
  // The open phase.
  uint32_t epoch_ = 0;
  bool arena_in_use_ = false;
  Stats stats_;
};

}  // namespace clshard::parallel
