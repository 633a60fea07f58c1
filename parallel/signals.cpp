#include "parallel/signals.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "runtime/device.h"

namespace clshard::parallel {

namespace {

// Epochs wrap after 2^32 phases; compare the way TCP compares sequence numbers.
bool reached(uint32_t value, uint32_t epoch) { return int32_t(value - epoch) >= 0; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

// Wakes a waiting host thread when any signal fill completes (an OpenCL event callback), so the
// wait loop re-reads the slots at once instead of sleeping out its poll interval.
struct SignalBuffers::Waker {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;

  void bump() {
    {
      std::lock_guard lock(mu);
      ++generation;
    }
    cv.notify_all();
  }
  static void CL_CALLBACK on_complete(cl_event, cl_int, void* user) {
    auto* owner = static_cast<std::shared_ptr<Waker>*>(user);
    (*owner)->bump();
    delete owner;  // one registration, one callback
  }
};

// One rank's buffer. Where the device shares host memory the buffer wraps our own page-aligned
// allocation (CL_MEM_USE_HOST_PTR is zero-copy on PoCL), and the host loads the words directly;
// otherwise the host reads them through a second queue on the same device, so a poll never queues
// behind the device's own work.
struct SignalBuffers::Slot {
  std::unique_ptr<void, FreeDeleter> host;  // declared before `buf`: freed after it
  cl::Mem buf;
  cl::Queue side_queue;                      // read polling only
  std::vector<cl::Event> last_store;         // per word: the fill that last wrote it
  bool zero_copy = false;
  size_t words = 0;

  uint32_t* host_words() const { return static_cast<uint32_t*>(host.get()); }
};

SignalBuffers::SignalBuffers(std::vector<Device*> devices, SignalOptions options)
    : devices_(std::move(devices)), options_(options), waker_(std::make_shared<Waker>()) {
  const size_t n = devices_.size();
  const size_t words = SignalBuffers::words(n);
  const size_t bytes = (words * sizeof(uint32_t) + 4095) / 4096 * 4096;
  for (size_t r = 0; r < n; ++r) {
    Device& dev = *devices_[r];
    queues_.push_back(cl::Queue::retain(dev.queue()));
    auto slot = std::make_unique<Slot>();
    slot->words = words;
    slot->last_store.resize(words);
    cl_int err = CL_SUCCESS;
    if (dev.info().host_unified_memory && !options_.force_read_polling) {
      slot->host.reset(std::aligned_alloc(4096, bytes));
      if (!slot->host) throw std::bad_alloc();
      std::memset(slot->host.get(), 0, bytes);
      slot->buf = cl::Mem(clCreateBuffer(dev.context(), CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR,
                                         bytes, slot->host.get(), &err));
      cl::check(err, "creating the signal buffer of " + dev.label());
      // Probe that the driver really stores into our memory (the spec allows a cached copy): a
      // store made by the device must show in host memory once it completed.
      const uint32_t probe = 0xC0FFEE01u, zero = 0;
      cl::check(clEnqueueFillBuffer(dev.queue(), slot->buf.get(), &probe, 4, 0, 4, 0, nullptr,
                                    nullptr),
                "probing the signal buffer of " + dev.label());
      dev.finish();
      slot->zero_copy =
          std::atomic_ref<uint32_t>(slot->host_words()[0]).load(std::memory_order_acquire) == probe;
      cl::check(clEnqueueFillBuffer(dev.queue(), slot->buf.get(), &zero, 4, 0, 4, 0, nullptr,
                                    nullptr),
                "clearing the signal buffer of " + dev.label());
      dev.finish();
      if (std::atomic_ref<uint32_t>(slot->host_words()[0]).load(std::memory_order_acquire) != 0)
        slot->zero_copy = false;
    } else {
      slot->buf = cl::Mem(clCreateBuffer(dev.context(), CL_MEM_READ_WRITE, bytes, nullptr, &err));
      cl::check(err, "creating the signal buffer of " + dev.label());
      dev.fill_zero(slot->buf, bytes);
      dev.finish();
    }
    if (!slot->zero_copy) {
      cl_queue_properties props[] = {0};
      slot->side_queue =
          cl::Queue(clCreateCommandQueueWithProperties(dev.context(), dev.id(), props, &err));
      cl::check(err, "creating the signal polling queue of " + dev.label());
    }
    slots_.push_back(std::move(slot));
  }
}

SignalBuffers::~SignalBuffers() {
  // Pending fills write into our host memory: let them land before it is freed.
  for (const cl::Queue& q : queues_) clFinish(q.get());
}

bool SignalBuffers::zero_copy(size_t rank) const { return slots_.at(rank)->zero_copy; }

cl::Event SignalBuffers::store(size_t rank, size_t first_word, size_t n_words, uint32_t epoch) {
  Device& dev = *devices_.at(rank);
  Slot& slot = *slots_[rank];
  cl_event ev = nullptr;
  cl::check(clEnqueueFillBuffer(dev.queue(), slot.buf.get(), &epoch, sizeof epoch,
                                first_word * sizeof(uint32_t), n_words * sizeof(uint32_t), 0,
                                nullptr, &ev),
            "signalling epoch " + std::to_string(epoch) + " on " + dev.label());
  cl::Event event(ev);
  // Without a flush a driver may hold the fill back until the host next waits on this queue,
  // and the host is about to wait on the fill itself.
  cl::check(clFlush(dev.queue()), "flushing " + dev.label());
  auto* owner = new std::shared_ptr<Waker>(waker_);
  if (clSetEventCallback(ev, CL_COMPLETE, &Waker::on_complete, owner) != CL_SUCCESS) delete owner;
  for (size_t w = first_word; w < first_word + n_words; ++w) slot.last_store[w] = event;
  return event;
}

cl::Event SignalBuffers::signal_ready(size_t rank, uint32_t epoch, std::optional<size_t> peer) {
  if (silent_rank_ && *silent_rank_ == rank) return {};
  if (peer) return store(rank, 1 + *peer, 1, epoch);
  return store(rank, 1, ranks(), epoch);
}

cl::Event SignalBuffers::signal_done(size_t rank, uint32_t epoch) { return store(rank, 0, 1, epoch); }

uint32_t SignalBuffers::load(size_t rank, size_t word) {
  Slot& slot = *slots_.at(rank);
  if (slot.zero_copy)
    return std::atomic_ref<uint32_t>(slot.host_words()[word]).load(std::memory_order_acquire);
  // Read polling: a slot whose last fill has not completed still holds its old value, so only a
  // completed fill is worth a read; the read names the fill in its wait list, which is what makes
  // the fill's store visible to another queue.
  const cl::Event& ev = slot.last_store[word];
  if (!ev) return 0;
  cl_int status = CL_QUEUED;
  cl::check(clGetEventInfo(ev.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status,
                           nullptr),
            "polling a signal of " + devices_[rank]->label());
  if (status < 0)
    throw cl::Error(status, "a signal of " + devices_[rank]->label() + " failed");
  if (status != CL_COMPLETE) return 0;
  uint32_t value = 0;
  cl_event wait = ev.get();
  cl::check(clEnqueueReadBuffer(slot.side_queue.get(), slot.buf.get(), CL_TRUE,
                                word * sizeof(uint32_t), sizeof value, &value, 1, &wait, nullptr),
            "reading a signal of " + devices_[rank]->label());
  return value;
}

void SignalBuffers::wait_words(const std::vector<std::pair<size_t, size_t>>& rank_words,
                               uint32_t epoch, const std::string& collective,
                               const char* what_slot) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + options_.timeout;
  // The callbacks make this loop event-driven; the interval only bounds the cost of a callback
  // that a driver never delivers.
  constexpr auto poll_interval = std::chrono::milliseconds(2);
  std::vector<bool> seen(rank_words.size(), false);
  for (;;) {
    uint64_t generation;
    {
      std::lock_guard lock(waker_->mu);
      generation = waker_->generation;
    }
    bool all = true;
    for (size_t i = 0; i < rank_words.size(); ++i) {
      if (seen[i]) continue;
      seen[i] = reached(load(rank_words[i].first, rank_words[i].second), epoch);
      all = all && seen[i];
    }
    if (all) return;
    const auto now = clock::now();
    if (now >= deadline) {
      for (size_t i = 0; i < rank_words.size(); ++i) {
        if (seen[i]) continue;
        const auto [rank, word] = rank_words[i];
        const Device& dev = *devices_[rank];
        std::ostringstream msg;
        msg << collective << ": " << dev.label() << " did not signal " << what_slot;
        if (word > 0) msg << " for rank " << (word - 1);
        msg << " at epoch " << epoch << " within " << options_.timeout.count()
            << " ms (its slot holds epoch " << load(rank, word)
            << "); the peer stalled or never reached this collective";
        throw CollectiveError(collective, epoch, dev.label(), msg.str());
      }
    }
    std::unique_lock lock(waker_->mu);
    waker_->cv.wait_until(lock, std::min(deadline, now + poll_interval),
                          [&] { return waker_->generation != generation; });
  }
}

void SignalBuffers::wait_ready(const std::vector<ReadySlot>& slots, uint32_t epoch,
                               const std::string& collective) {
  std::vector<std::pair<size_t, size_t>> words;
  words.reserve(slots.size());
  for (const auto& s : slots) words.emplace_back(s.rank, 1 + s.peer);
  wait_words(words, epoch, collective, "ready");
}

void SignalBuffers::wait_done(const std::vector<size_t>& ranks, uint32_t epoch,
                              const std::string& collective) {
  std::vector<std::pair<size_t, size_t>> words;
  for (size_t r : ranks) words.emplace_back(r, 0);
  wait_words(words, epoch, collective, "done");
}

}  // namespace clshard::parallel
