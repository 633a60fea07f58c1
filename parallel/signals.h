// Signal buffers: how the host learns that a device has reached a point in its in-order queue,
// without any kernel ever waiting for another device.
//
// Every device of a group owns one small buffer of uint32 words:
//   word 0       "done": the last epoch whose consumer work this device has finished;
//   word 1 + p   "ready for peer p": the last epoch at which this device's data for peer p was
//                ready (its payload work, enqueued before the signal, had completed).
// A device signals by a 4-byte clEnqueueFillBuffer of the epoch into its own slots, enqueued on
// its own in-order queue behind the work it vouches for. The host waits for the slots it needs by
// polling them (a load from the mapped buffer where the device shares host memory, a read through
// a side queue where it does not) until a deadline; an event callback on the fill wakes the
// waiter early, so the host neither spins nor sleeps longer than it must. A slot that does not
// reach the epoch in time is a CollectiveError naming the collective, the epoch and the device.
//
// Why host-driven: separate PoCL root devices share one thread pool, so a kernel spinning on a
// peer's flag can hold the pool and deadlock (../shared/design/opencl-on-pocl.md). The host is the
// only party that waits; devices only ever store.
#pragma once

#include <CL/cl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/cl.h"

namespace clshard {
class Device;
}

namespace clshard::parallel {

// A collective did not complete: a peer never signalled within the timeout.
class CollectiveError : public std::runtime_error {
 public:
  CollectiveError(std::string collective, uint32_t epoch, std::string device,
                  const std::string& message)
      : std::runtime_error(message),
        collective_(std::move(collective)),
        device_(std::move(device)),
        epoch_(epoch) {}
  const std::string& collective() const { return collective_; }
  const std::string& device() const { return device_; }  // the silent device's label()
  uint32_t epoch() const { return epoch_; }

 private:
  std::string collective_;
  std::string device_;
  uint32_t epoch_;
};

struct SignalOptions {
  // How long the host waits for a peer before it gives up with a CollectiveError.
  std::chrono::milliseconds timeout{30000};
  // Poll the slots through a side queue even where the device shares host memory (tests use it to
  // exercise the path that discrete devices take).
  bool force_read_polling = false;
};

class SignalBuffers {
 public:
  // Word 0 is "done", words 1..ranks are "ready for peer p".
  static size_t words(size_t ranks) { return 1 + ranks; }

  SignalBuffers(std::vector<Device*> devices, SignalOptions options = {});
  ~SignalBuffers();
  SignalBuffers(const SignalBuffers&) = delete;
  SignalBuffers& operator=(const SignalBuffers&) = delete;

  size_t ranks() const { return devices_.size(); }
  const SignalOptions& options() const { return options_; }
  void set_timeout(std::chrono::milliseconds t) { options_.timeout = t; }
  // Whether the host reads rank r's slots straight from host memory (zero-copy).
  bool zero_copy(size_t rank) const;

  // The next epoch (1, 2, ...). Slots start at 0, which no epoch uses.
  uint32_t next_epoch() { return ++epoch_; }
  uint32_t epoch() const { return epoch_; }

  // Enqueues on rank's queue, behind everything queued there, the store of `epoch` into its
  // "ready" slots (all peers, or one) and flushes the queue. The returned event completes when the
  // slot holds the epoch; consumers in the same context may use it in their wait lists.
  cl::Event signal_ready(size_t rank, uint32_t epoch, std::optional<size_t> peer = std::nullopt);
  // The same for the "done" slot.
  cl::Event signal_done(size_t rank, uint32_t epoch);

  // Host wait until every listed (rank, peer) "ready" slot has reached `epoch` (peer == rank means
  // "rank took part"). Throws CollectiveError for the first slot still short at the deadline.
  struct ReadySlot {
    size_t rank;
    size_t peer;
  };
  void wait_ready(const std::vector<ReadySlot>& slots, uint32_t epoch,
                  const std::string& collective);
  // Host wait until every listed rank's "done" slot has reached `epoch`.
  void wait_done(const std::vector<size_t>& ranks, uint32_t epoch, const std::string& collective);

  // The current value of a slot (word index as in the layout above), as the host sees it now.
  uint32_t load(size_t rank, size_t word);

  // Test hook: while set, signal_ready() on this rank enqueues nothing, as if the device had
  // stalled or crashed before reaching the collective.
  void silence_rank_for_test(std::optional<size_t> rank) { silent_rank_ = rank; }

 private:
  struct Slot;
  struct Waker;
  cl::Event store(size_t rank, size_t first_word, size_t n_words, uint32_t epoch);
  void wait_words(const std::vector<std::pair<size_t, size_t>>& rank_words, uint32_t epoch,
                  const std::string& collective, const char* what_slot);

  std::vector<Device*> devices_;
  std::vector<cl::Queue> queues_;  // retained: the destructor drains them even if a Device is gone
  SignalOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::shared_ptr<Waker> waker_;
  uint32_t epoch_ = 0;
  std::optional<size_t> silent_rank_;
};

}  // namespace clshard::parallel
