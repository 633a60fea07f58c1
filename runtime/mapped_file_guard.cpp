#include "runtime/mapped_file_guard.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

namespace clshard {
namespace {

// A fixed table the handler can read without locks or allocation: a slot is published by
// writing `base` last and cleared by zeroing it first.
struct Slot {
  std::atomic<const char*> base{nullptr};
  size_t size = 0;
  char message[1024] = {};
};
constexpr size_t kSlots = 4096;  // shards of one deployment: DeepSeek-V3 has 163
std::array<Slot, kSlots> g_slots;
std::mutex g_register;
struct sigaction g_previous {};

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const char* at = static_cast<const char*>(info->si_addr);
  for (const Slot& slot : g_slots) {
    const char* base = slot.base.load(std::memory_order_acquire);
    if (base && at >= base && at < base + slot.size) {
      (void)!::write(STDERR_FILENO, slot.message, std::strlen(slot.message));
      ::_exit(kExitCheckpointChanged);
    }
  }
  // Not ours: the default action (or whoever was there before).
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
  ::raise(SIGBUS);
}

}  // namespace

void guard_mapped_file(const void* base, size_t size, const std::filesystem::path& path) {
  std::lock_guard lock(g_register);
  static bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    return ::sigaction(SIGBUS, &action, &g_previous) == 0;
  }();
  if (!installed) return;
  for (Slot& slot : g_slots) {
    if (slot.base.load(std::memory_order_relaxed)) continue;
    slot.size = size;
    const std::string text = "clshard: checkpoint file " + path.string() +
                             " changed while in use (truncated or replaced?); restore it and "
                             "rerun (a batch job resumes where it stopped)\n";
    std::strncpy(slot.message, text.c_str(), sizeof slot.message - 2);
    slot.message[sizeof slot.message - 2] = '\n';
    slot.base.store(static_cast<const char*>(base), std::memory_order_release);
    return;
  }
  // More mappings than slots: the rest keep the plain SIGBUS.
}

void unguard_mapped_file(const void* base) {
  std::lock_guard lock(g_register);
  for (Slot& slot : g_slots)
    if (slot.base.load(std::memory_order_relaxed) == base) {
      slot.base.store(nullptr, std::memory_order_release);
      return;
    }
}

}  // namespace clshard
