// The collectives of parallel/collectives.h against their single-device twins (plain C++ over host
// vectors, summing in the same rank order, so the comparisons are bitwise), on 1-4 sub-devices of
// one context, on devices of different contexts (zero-copy and host-staged), on two PoCL root
// devices (in a child process), with uneven and empty shares; and the fault path: a silent peer
// ends in a CollectiveError naming the collective and the device within a bounded time.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "parallel/collectives.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "tests/test_util.h"

namespace clshard::parallel {
namespace {

using test::cpu_devices;


// PoCL gives a CPU device as many compute units as it has threads (2 here), and a split into N
// sub-devices needs N of them: ask for 4 threads before the first OpenCL call of the process.
// Static initialisation runs before main, so before any test touches the platform.
const bool kEnoughPoclThreads = [] {
  const char* v = std::getenv("POCL_MAX_PTHREAD_COUNT");
  if (!v || std::atoi(v) < 4) setenv("POCL_MAX_PTHREAD_COUNT", "4", 1);
  return true;
}();

constexpr float kSentinel = -12345.5f;  // fills the room around every span: stray writes show
constexpr size_t kGuard = 19;           // floats of sentinel after each span

// ---- the single-device twins ----------------------------------------------------------------

std::vector<float> twin_allgather(const std::vector<std::vector<float>>& send) {
  std::vector<float> out;
  for (const auto& s : send) out.insert(out.end(), s.begin(), s.end());
  return out;
}

// Element k of the sum is ((send[0][k] + send[1][k]) + send[2][k]) + ...
std::vector<float> twin_sum(const std::vector<std::vector<float>>& bufs) {
  std::vector<float> out = bufs.at(0);
  for (size_t r = 1; r < bufs.size(); ++r)
    for (size_t k = 0; k < out.size(); ++k) out[k] += bufs[r][k];
  return out;
}

std::vector<std::vector<float>> twin_reduce_scatter(const std::vector<std::vector<float>>& send,
                                                    const std::vector<size_t>& shards) {
  const auto sum = twin_sum(send);
  std::vector<std::vector<float>> out;
  size_t off = 0;
  for (size_t c : shards) {
    out.emplace_back(sum.begin() + long(off), sum.begin() + long(off + c));
    off += c;
  }
  return out;
}

std::vector<std::vector<float>> twin_all_to_all_rows(
    const std::vector<std::vector<std::vector<float>>>& send) {
  std::vector<std::vector<float>> recv(send.size());
  for (size_t j = 0; j < send.size(); ++j)
    for (size_t i = 0; i < send.size(); ++i)
      recv[j].insert(recv[j].end(), send[i][j].begin(), send[i][j].end());
  return recv;
}

// ---- device buffers with guards -------------------------------------------------------------

// A buffer holding `room` floats at `offset`, sentinel everywhere else, `values` written at the
// start of the span.
struct GuardedSpan {
  Device* dev = nullptr;
  DeviceSpan span;
  size_t total = 0;  // floats in the buffer
};

GuardedSpan make_span(Device& dev, const std::vector<float>& values, size_t offset, size_t room) {
  GuardedSpan g;
  g.dev = &dev;
  g.total = offset + room + kGuard;
  std::vector<float> init(g.total, kSentinel);
  std::copy(values.begin(), values.end(), init.begin() + long(offset));
  g.span = {dev.alloc(g.total * sizeof(float)), offset, room};
  dev.write(g.span.buf, init.data(), g.total * sizeof(float));
  return g;
}

std::vector<float> read_span(const GuardedSpan& g, size_t count) {
  std::vector<float> all(g.total);
  g.dev->read(g.span.buf, all.data(), g.total * sizeof(float));
  for (size_t k = 0; k < g.total; ++k) {
    if (k >= g.span.offset_floats && k < g.span.offset_floats + g.span.count_floats) continue;
    if (std::memcmp(&all[k], &kSentinel, sizeof(float)) != 0) {
      ADD_FAILURE() << "write outside the span at float " << k << " (span [" << g.span.offset_floats
                    << ", " << g.span.offset_floats + g.span.count_floats << "))";
      break;
    }
  }
  return {all.begin() + long(g.span.offset_floats),
          all.begin() + long(g.span.offset_floats + count)};
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    if (std::memcmp(&got[k], &want[k], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": first difference at " << k << ": " << got[k] << " vs "
                    << want[k];
      return;
    }
  }
}

// Values whose scale depends on the rank, so that the order of a sum changes its rounding.
std::vector<float> random_values(size_t n, size_t rank, uint32_t seed) {
  std::mt19937 rng(seed * 7919u + uint32_t(rank));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float scale = std::pow(10.0f, float(int(rank % 4) * 2 - 3));  // 1e-3, 10, 1e3, 1e5 ...
  std::vector<float> v(n);
  for (float& x : v) x = u(rng) * scale;
  return v;
}

// Counts per rank with an empty one and uneven others.
std::vector<size_t> uneven_counts(size_t n, size_t salt) {
  static const size_t pattern[] = {37, 0, 5, 64, 1, 23, 0, 16, 9, 48};
  std::vector<size_t> c(n);
  for (size_t i = 0; i < n; ++i) c[i] = pattern[(i + salt) % 10];
  return c;
}

// ---- one check per collective, on any device group ------------------------------------------

void check_allgather(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size();
  for (size_t salt = 0; salt < 3; ++salt) {  // three rounds: the staging arenas get reused
    const auto counts = uneven_counts(n, salt + seed);
    std::vector<std::vector<float>> values(n);
    std::vector<GuardedSpan> send, recv;
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      values[i] = random_values(counts[i], i, seed + uint32_t(salt));
      send.push_back(make_span(comm.device(i), values[i], 3 + i, counts[i]));
      total += counts[i];
    }
    for (size_t j = 0; j < n; ++j) recv.push_back(make_span(comm.device(j), {}, 11, total));
    std::vector<DeviceSpan> s, r;
    for (auto& g : send) s.push_back(g.span);
    for (auto& g : recv) r.push_back(g.span);
    comm.allgather(s, r, "test");
    const auto want = twin_allgather(values);
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(recv[j], total), want, "allgather on rank " + std::to_string(j));
  }

  // In place: every rank's own piece already sits at its place in its receive buffer.
  const auto counts = uneven_counts(n, seed + 5);
  size_t total = 0;
  std::vector<size_t> at(n);
  for (size_t i = 0; i < n; ++i) at[i] = total, total += counts[i];
  std::vector<std::vector<float>> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = random_values(counts[i], i, seed + 99);
  std::vector<GuardedSpan> recv;
  std::vector<DeviceSpan> s, r;
  for (size_t j = 0; j < n; ++j) {
    std::vector<float> init(total, 0.0f);
    std::copy(values[j].begin(), values[j].end(), init.begin() + long(at[j]));
    recv.push_back(make_span(comm.device(j), init, 2, total));
    s.push_back({recv[j].span.buf, recv[j].span.offset_floats + at[j], counts[j]});
    r.push_back(recv[j].span);
  }
  comm.allgather(s, r, "test in place");
  const auto want = twin_allgather(values);
  for (size_t j = 0; j < n; ++j)
    expect_bitwise(read_span(recv[j], total), want, "in-place allgather on rank " +
                                                        std::to_string(j));
}

// The column-sharded gather: rank i holds columns [c_0 + ... + c_{i-1}, ... + c_i) of every row.
void check_allgather_columns(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size(), rows = 5;
  for (size_t salt = 0; salt < 2; ++salt) {
    const auto cols = uneven_counts(n, salt + seed + 3);
    size_t total = 0;
    for (size_t c : cols) total += c;
    std::vector<std::vector<float>> blocks(n);
    std::vector<GuardedSpan> send, recv;
    std::vector<DeviceSpan> s, r;
    for (size_t i = 0; i < n; ++i) {
      blocks[i] = random_values(rows * cols[i], i, seed + 60 + uint32_t(salt));
      send.push_back(make_span(comm.device(i), blocks[i], 2 + i, rows * cols[i]));
      recv.push_back(make_span(comm.device(i), {}, 9, rows * total));
      s.push_back(send[i].span);
      r.push_back(recv[i].span);
    }
    comm.allgather_columns(s, r, rows, "test");
    std::vector<float> want;  // the twin: row by row, each rank's columns in rank order
    for (size_t row = 0; row < rows; ++row)
      for (size_t i = 0; i < n; ++i)
        want.insert(want.end(), blocks[i].begin() + long(row * cols[i]),
                    blocks[i].begin() + long((row + 1) * cols[i]));
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(recv[j], rows * total), want,
                     "allgather_columns on rank " + std::to_string(j));
  }
}

void check_reduce_scatter(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size();
  for (size_t salt = 0; salt < 2; ++salt) {
    const auto shards = uneven_counts(n, salt + seed + 1);
    size_t length = 0;
    for (size_t c : shards) length += c;
    std::vector<std::vector<float>> values(n);
    std::vector<GuardedSpan> send, recv;
    std::vector<DeviceSpan> s, r;
    for (size_t i = 0; i < n; ++i) {
      values[i] = random_values(length, i, seed + 10 + uint32_t(salt));
      send.push_back(make_span(comm.device(i), values[i], 1 + 2 * i, length));
      recv.push_back(make_span(comm.device(i), {}, 4, shards[i]));
      s.push_back(send[i].span);
      r.push_back(recv[i].span);
    }
    comm.reduce_scatter(s, shards, r, "test");
    const auto want = twin_reduce_scatter(values, shards);
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(recv[j], shards[j]), want[j],
                     "reduce_scatter shard of rank " + std::to_string(j));
  }
}

void check_allreduce(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size();
  // 5: fewer floats than ranks have 16-float blocks (empty shards); 1000: uneven shards with a
  // tail; 20000: several work-items per shard.
  for (size_t length : {size_t(5), size_t(1000), size_t(20000)}) {
    std::vector<std::vector<float>> values(n);
    std::vector<GuardedSpan> bufs;
    std::vector<DeviceSpan> b;
    for (size_t i = 0; i < n; ++i) {
      values[i] = random_values(length, i, seed + 20 + uint32_t(length));
      bufs.push_back(make_span(comm.device(i), values[i], 7 + i, length));
      b.push_back(bufs[i].span);
    }
    comm.allreduce(b, "test");
    const auto want = twin_sum(values);
    if (n >= 3 && length >= 1000) {
      // The data tells orders apart: summing from the last rank down rounds differently.
      std::vector<std::vector<float>> reversed(values.rbegin(), values.rend());
      EXPECT_NE(0, std::memcmp(twin_sum(reversed).data(), want.data(), length * sizeof(float)));
    }
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(bufs[j], length), want,
                     "allreduce of " + std::to_string(length) + " on rank " + std::to_string(j));
  }
}

void check_broadcast(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size();
  for (size_t root : {n - 1, size_t(0)}) {
    const size_t length = 333;
    std::vector<GuardedSpan> bufs;
    std::vector<DeviceSpan> b;
    const auto root_values = random_values(length, root, seed + 30);
    for (size_t i = 0; i < n; ++i) {
      bufs.push_back(make_span(comm.device(i), i == root ? root_values
                                                         : random_values(length, i, seed + 31),
                               5, length));
      b.push_back(bufs[i].span);
    }
    comm.broadcast(root, b, "test");
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(bufs[j], length), root_values,
                     "broadcast from " + std::to_string(root) + " on rank " + std::to_string(j));
  }
}

void check_all_to_all_rows(Communicator& comm, uint32_t seed) {
  const size_t n = comm.size(), width = 24;
  for (size_t round = 0; round < 3; ++round) {
    // Rows rank i sends to rank j: uneven, with zeros; in round 1 the last rank sends nothing at
    // all (a data-parallel replica with no requests in the step).
    std::vector<std::vector<std::vector<float>>> values(n, std::vector<std::vector<float>>(n));
    std::vector<std::vector<GuardedSpan>> send(n);
    std::vector<std::vector<DeviceSpan>> s(n);
    std::vector<size_t> rows_to(n, 0);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        size_t rows = (i * 3 + j * 5 + round + seed) % 4;
        if (round == 1 && i == n - 1) rows = 0;
        values[i][j] = random_values(rows * width, i, seed + 40 + uint32_t(round * 16 + j));
        send[i].push_back(make_span(comm.device(i), values[i][j], 2 * j + 1, rows * width));
        s[i].push_back(send[i][j].span);
        rows_to[j] += rows;
      }
    }
    std::vector<GuardedSpan> recv;
    std::vector<DeviceSpan> r;
    for (size_t j = 0; j < n; ++j) {
      recv.push_back(make_span(comm.device(j), {}, 6, rows_to[j] * width));
      r.push_back(recv[j].span);
    }
    comm.all_to_all_rows(s, r, width, "test");
    const auto want = twin_all_to_all_rows(values);
    for (size_t j = 0; j < n; ++j)
      expect_bitwise(read_span(recv[j], rows_to[j] * width), want[j],
                     "all_to_all_rows into rank " + std::to_string(j) + " (round " +
                         std::to_string(round) + ")");
  }
}

void check_all(Communicator& comm, uint32_t seed) {
  check_allgather(comm, seed);
  check_allgather_columns(comm, seed);
  check_reduce_scatter(comm, seed);
  check_allreduce(comm, seed);
  check_broadcast(comm, seed);
  check_all_to_all_rows(comm, seed);
}

// ---- device setups --------------------------------------------------------------------------

// Managers and communicators live for the whole process (devices open and programs build once
// per context). One registry holds both so that the communicators go first at exit; it opens the
// default device before it is built itself, so that device outlives it too.
struct Registry {
  std::map<std::string, std::unique_ptr<DeviceManager>> managers;
  std::map<size_t, std::unique_ptr<Communicator>> communicators;  // by setup
};

Registry& registry() {
  static Registry r = (test::default_device(), Registry{});
  return r;
}

DeviceManager& cpu_split(const std::string& split, int instance = 0) {
  auto& m = registry().managers[split + "#" + std::to_string(instance)];
  if (!m) m = std::make_unique<DeviceManager>(cpu_devices(split));
  return *m;
}

struct DeviceSetup {
  const char* name;
  std::function<std::vector<Device*>()> devices;
  bool shared_context;
  CommunicatorOptions options;
};

CommunicatorOptions host_staged() {
  CommunicatorOptions o;
  o.force_host_staging = true;
  o.force_read_polling = true;
  return o;
}

const std::vector<DeviceSetup>& setups() {
  static const std::vector<DeviceSetup> all = {
      {"OneDevice", [] { return std::vector<Device*>{&test::default_device()}; }, true, {}},
      {"TwoSubDevices", [] { return cpu_split("2").devices(); }, true, {}},
      {"ThreeSubDevices", [] { return cpu_split("3").devices(); }, true, {}},
      {"FourSubDevices", [] { return cpu_split("4").devices(); }, true, {}},
      // Three ranks over two contexts: the middle one is the default device's own context.
      {"ThreeDevicesTwoContexts",
       [] {
         auto& a = cpu_split("2");
         return std::vector<Device*>{&a[0], &test::default_device(), &a[1]};
       },
       false, {}},
      {"ThreeDevicesTwoContextsHostStaged",
       [] {
         auto& a = cpu_split("2");
         return std::vector<Device*>{&a[0], &test::default_device(), &a[1]};
       },
       false, host_staged()},
      // Four ranks, alternating between two contexts of two sub-devices each.
      {"FourDevicesTwoContexts",
       [] {
         auto& a = cpu_split("2");
         auto& b = cpu_split("2", 1);
         return std::vector<Device*>{&a[0], &b[0], &a[1], &b[1]};
       },
       false, {}},
  };
  return all;
}

class CollectivesOn : public ::testing::TestWithParam<size_t> {
 protected:
  const DeviceSetup& setup() const { return setups()[GetParam()]; }
  Communicator& comm() {
    auto devices = setup().devices();  // opens the managers before the slot below is made
    auto& c = registry().communicators[GetParam()];
    if (!c) c = std::make_unique<Communicator>(devices, setup().options);
    return *c;
  }
};

TEST_P(CollectivesOn, SetupIsWhatItSays) {
  Communicator& c = comm();
  bool shared = true;
  for (size_t i = 0; i < c.size(); ++i) shared = shared && c.same_context(0, i);
  EXPECT_EQ(shared, setup().shared_context);
  if (std::string(setup().name).find("Sub") != std::string::npos) {
    for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(c.device(i).info().is_sub_device);
  }
}

TEST_P(CollectivesOn, AllgatherMatchesTwin) { check_allgather(comm(), 1); }
TEST_P(CollectivesOn, AllgatherColumnsMatchesTwin) { check_allgather_columns(comm(), 9); }
TEST_P(CollectivesOn, ReduceScatterMatchesTwin) { check_reduce_scatter(comm(), 2); }
TEST_P(CollectivesOn, AllreduceMatchesTwin) { check_allreduce(comm(), 3); }
TEST_P(CollectivesOn, BroadcastMatchesTwin) { check_broadcast(comm(), 4); }
TEST_P(CollectivesOn, AllToAllRowsMatchesTwin) { check_all_to_all_rows(comm(), 5); }

TEST_P(CollectivesOn, StagesThroughHostOnlyAcrossContexts) {
  Communicator& c = comm();
  const auto before = c.stats();
  check_allgather(c, 6);
  const auto after = c.stats();
  EXPECT_GT(after.phases, before.phases);
  if (setup().shared_context) {
    EXPECT_EQ(after.bytes_staged, before.bytes_staged);
  } else {
    EXPECT_GT(after.bytes_staged, before.bytes_staged);
  }
}

// The caller does not wait: the payloads are still being written (asynchronous 4 MiB uploads)
// when the collectives are called, and right after each call the caller overwrites its send
// buffers (as the next layer would). The signals must hold the consumers back until the payload
// is there, and the barriers must hold the overwrite back until the peers have read it.
TEST_P(CollectivesOn, WaitsForProducersAndHoldsBackLaterOverwrites) {
  Communicator& c = comm();
  const size_t n = c.size(), length = size_t(1) << 20;
  std::vector<std::vector<float>> values(n);
  std::vector<cl::Mem> send(n), recv(n), partial(n);
  for (size_t i = 0; i < n; ++i) {
    values[i] = random_values(length, i, 50);
    send[i] = c.device(i).alloc(length * sizeof(float));
    recv[i] = c.device(i).alloc(n * length * sizeof(float));
    partial[i] = c.device(i).alloc(length * sizeof(float));
  }
  auto upload = [&] {
    for (size_t i = 0; i < n; ++i)
      cl::check(clEnqueueWriteBuffer(c.device(i).queue(), send[i].get(), CL_FALSE, 0,
                                     length * sizeof(float), values[i].data(), 0, nullptr,
                                     nullptr),
                "upload");
  };
  auto overwrite = [&] {
    const float junk = 7.0f;
    for (size_t i = 0; i < n; ++i)
      cl::check(clEnqueueFillBuffer(c.device(i).queue(), send[i].get(), &junk, sizeof junk, 0,
                                    length * sizeof(float), 0, nullptr, nullptr),
                "overwrite");
  };
  std::vector<DeviceSpan> s(n), r(n), p(n);
  for (size_t i = 0; i < n; ++i) {
    s[i] = {send[i], 0, length};
    r[i] = {recv[i], 0, n * length};
  }

  upload();
  c.allgather(s, r, "async allgather");
  overwrite();
  const auto gathered = twin_allgather(values);
  std::vector<float> got(n * length);
  for (size_t j = 0; j < n; ++j) {
    c.device(j).read(recv[j], got.data(), got.size() * sizeof(float));
    expect_bitwise(got, gathered, "async allgather on rank " + std::to_string(j));
  }

  upload();
  const auto shards = Communicator::even_shards(length, n);
  for (size_t i = 0; i < n; ++i) p[i] = {partial[i], 0, shards[i]};
  c.reduce_scatter(s, shards, p, "async reduce_scatter");
  overwrite();
  const auto want = twin_reduce_scatter(values, shards);
  for (size_t j = 0; j < n; ++j) {
    std::vector<float> shard(shards[j]);
    c.device(j).read(partial[j], shard.data(), shard.size() * sizeof(float));
    expect_bitwise(shard, want[j], "async reduce_scatter on rank " + std::to_string(j));
  }
  for (size_t i = 0; i < n; ++i) c.device(i).finish();  // the uploads read `values`
}

INSTANTIATE_TEST_SUITE_P(Setups, CollectivesOn, ::testing::Range(size_t(0), setups().size()),
                         [](const ::testing::TestParamInfo<size_t>& i) {
                           return std::string(setups()[i.param].name);
                         });

// More ranks than one reduction launch takes (8): the partial sums go through a scratch buffer
// and must still be the same left fold. Ten ranks over two sub-devices, each device several ranks.
TEST(Collectives, TenRanksOnTwoSubDevicesMatchTwins) {
  auto& m = cpu_split("2");
  std::vector<Device*> ten;
  for (int i = 0; i < 10; ++i) ten.push_back(&m[size_t(i % 2)]);
  Communicator comm(ten);
  check_reduce_scatter(comm, 7);
  check_allreduce(comm, 8);
}

TEST(Collectives, EvenShardsCoverTheVectorInWholeBlocks) {
  EXPECT_EQ(Communicator::even_shards(1000, 3), (std::vector<size_t>{336, 336, 328}));
  EXPECT_EQ(Communicator::even_shards(5, 4), (std::vector<size_t>{5, 0, 0, 0}));
  EXPECT_EQ(Communicator::even_shards(40, 4), (std::vector<size_t>{16, 24, 0, 0}));
  EXPECT_EQ(Communicator::even_shards(64, 4), (std::vector<size_t>{16, 16, 16, 16}));
  EXPECT_EQ(Communicator::even_shards(0, 2), (std::vector<size_t>{0, 0}));
}

TEST(Collectives, BadSpansAreClearErrors) {
  auto& m = cpu_split("2");
  Communicator comm(m.devices());
  GuardedSpan a = make_span(m[0], {}, 0, 10), b = make_span(m[1], {}, 0, 10);
  GuardedSpan big = make_span(m[0], {}, 0, 20);
  // A receive buffer too small for the gather.
  try {
    comm.allgather({a.span, b.span}, {big.span, {b.span.buf, 0, 15}}, "small recv");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("allgather(small recv): recv[1]"), std::string::npos)
        << e.what();
  }
  // A span past its buffer's end.
  try {
    comm.broadcast(0, {{a.span.buf, 0, 10}, {b.span.buf, 30, 10}}, "past the end");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("of a buffer of 29"), std::string::npos) << e.what();
  }
  // A buffer of another context than its rank's device.
  try {
    GuardedSpan other = make_span(test::default_device(), {}, 0, 10);
    comm.allreduce({a.span, other.span}, "foreign buffer");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("another OpenCL context"), std::string::npos) << e.what();
  }
}

// ---- a peer that never signals --------------------------------------------------------------

void expect_silent_peer_error(Communicator& comm, size_t silent,
                              const std::function<void()>& collective, const std::string& name) {
  comm.set_timeout(std::chrono::milliseconds(1000));
  comm.silence_rank_for_test(silent);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    collective();
    ADD_FAILURE() << name << " returned although rank " << silent << " never signalled";
  } catch (const CollectiveError& e) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 3.0) << "the error took " << s << " s with a 1 s timeout";
    EXPECT_GE(s, 0.9) << "the host gave up before the timeout";
    EXPECT_EQ(e.collective(), name);
    EXPECT_EQ(e.device(), comm.device(silent).label());
    EXPECT_GT(e.epoch(), 0u);
    const std::string what = e.what();
    EXPECT_NE(what.find(name), std::string::npos) << what;
    EXPECT_NE(what.find(comm.device(silent).label()), std::string::npos) << what;
    EXPECT_NE(what.find("epoch " + std::to_string(e.epoch())), std::string::npos) << what;
  }
  comm.silence_rank_for_test(std::nullopt);
}

TEST(CollectiveFaults, SilentPeerInAllgatherIsANamedErrorNotAHang) {
  auto& m = cpu_split("2");
  Communicator comm(m.devices());
  GuardedSpan s0 = make_span(m[0], random_values(8, 0, 1), 0, 8);
  GuardedSpan s1 = make_span(m[1], random_values(8, 1, 1), 0, 8);
  GuardedSpan r0 = make_span(m[0], {}, 0, 16), r1 = make_span(m[1], {}, 0, 16);
  expect_silent_peer_error(
      comm, 1, [&] { comm.allgather({s0.span, s1.span}, {r0.span, r1.span}, "layer 3 logits"); },
      "allgather(layer 3 logits)");
  // The communicator carries on once the peer speaks again.
  comm.set_timeout(std::chrono::milliseconds(30000));
  check_allgather(comm, 11);
}

TEST(CollectiveFaults, SilentPeerInAllToAllAcrossContextsIsANamedError) {
  auto& a = cpu_split("2");
  Communicator comm({&a[0], &test::default_device(), &a[1]});
  const size_t width = 4;
  std::vector<std::vector<GuardedSpan>> send(3);
  std::vector<std::vector<DeviceSpan>> s(3);
  std::vector<GuardedSpan> recv;
  std::vector<DeviceSpan> r;
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 3; ++j) {
      send[i].push_back(make_span(comm.device(i), random_values(width, i, 2), 0, width));
      s[i].push_back(send[i][j].span);
    }
    recv.push_back(make_span(comm.device(i), {}, 0, 3 * width));
    r.push_back(recv[i].span);
  }
  expect_silent_peer_error(
      comm, 2, [&] { comm.all_to_all_rows(s, r, width, "dispatch layer 1"); },
      "all_to_all_rows(dispatch layer 1)");
  comm.set_timeout(std::chrono::milliseconds(30000));
  check_all_to_all_rows(comm, 12);
}

TEST(CollectiveFaults, SilentPeerWithReadPollingIsANamedError) {
  auto& m = cpu_split("3");
  Communicator comm(m.devices(), host_staged());
  std::vector<GuardedSpan> bufs;
  std::vector<DeviceSpan> b;
  for (size_t i = 0; i < 3; ++i) {
    bufs.push_back(make_span(m[i], random_values(100, i, 3), 0, 100));
    b.push_back(bufs[i].span);
  }
  expect_silent_peer_error(comm, 0, [&] { comm.allreduce(b, "mlp out"); },
                           "allreduce(mlp out) reduce-scatter");
}

// ---- separate PoCL root devices (one shared thread pool) ------------------------------------

// POCL_DEVICES is read when the platform initialises, which in this process happened long ago:
// the test runs itself again in a child process with "pthread pthread" (two root devices that do
// not run concurrently, so any device-side wait for a peer would deadlock there), and the child
// runs every collective against its twin.
constexpr const char* kChildEnv = "CLSHARD_COLLECTIVES_ROOT_DEVICES_CHILD";

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  return std::string(buf, size_t(n));
}

TEST(CollectivesOnRootDevices, TwoPthreadRootDevicesMatchTwins) {
  if (std::getenv(kChildEnv)) {
    DeviceManager m(cpu_devices("", true));
    ASSERT_EQ(m.size(), 2u) << "POCL_DEVICES=\"pthread pthread\" should give two CPU devices";
    EXPECT_FALSE(m[0].info().is_sub_device);
    EXPECT_FALSE(m[1].info().is_sub_device);
    Communicator comm(m.devices());
    EXPECT_TRUE(comm.same_context(0, 1));
    check_all(comm, 21);
    Communicator staged(m.devices(), host_staged());
    check_allreduce(staged, 22);
    return;
  }
  const std::string cmd = std::string(kChildEnv) + "=1 POCL_DEVICES='pthread pthread' '" +
                          self_exe() +
                          "' --gtest_filter=CollectivesOnRootDevices.TwoPthreadRootDevicesMatchTwins"
                          " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t k = fread(buf, 1, sizeof buf, p)) out.append(buf, k);
  const int status = pclose(p);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
}

}  // namespace
}  // namespace clshard::parallel
