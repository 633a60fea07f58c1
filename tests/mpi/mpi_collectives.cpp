// The collectives over MpiTransport, one rank per process: run under
//   mpirun -np N clshard_mpi_collectives check         every collective against host sums, bitwise
//   mpirun -np N clshard_mpi_collectives stall R       rank R stops (SIGSTOP) before a collective:
//                                                      the others end with the naming error
//   mpirun -np N clshard_mpi_collectives kill R        rank R is killed (SIGKILL) mid-run
// Prints "mpi collectives: N ranks OK" on rank 0 when every check passed; exits non-zero otherwise.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "parallel/collectives.h"
#include "parallel/mpi_transport.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"

using namespace clshard;
using namespace clshard::parallel;

namespace {

int failures = 0;
size_t me = 0, n = 1;

void expect_equal(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  if (got.size() != want.size()) {
    std::cerr << "rank " << me << ": " << what << ": " << got.size() << " values, expected "
              << want.size() << "\n";
    ++failures;
    return;
  }
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {  // bitwise: sums run in rank order on both sides
      std::cerr << "rank " << me << ": " << what << ": [" << i << "] = " << got[i]
                << ", expected " << want[i] << "\n";
      ++failures;
      return;
    }
}

float value(size_t rank, size_t i) { return float(rank + 1) * 0.37f + float(i) * 0.0011f; }

std::vector<float> values(size_t rank, size_t count, size_t salt = 0) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = value(rank, i + salt);
  return v;
}

cl::Mem upload(Device& dev, const std::vector<float>& v) {
  cl::Mem m = dev.alloc(std::max<size_t>(v.size(), 1) * sizeof(float));
  if (!v.empty()) dev.write(m, v.data(), v.size() * sizeof(float));
  return m;
}

std::vector<float> download(Device& dev, const cl::Mem& m, size_t offset, size_t count) {
  std::vector<float> v(count);
  if (count) dev.read(m, v.data(), count * sizeof(float), offset * sizeof(float));
  return v;
}

// Spans of every rank: this rank's real buffer, the others' lengths only.
std::vector<DeviceSpan> spans(const cl::Mem& mine, const std::vector<size_t>& counts) {
  std::vector<DeviceSpan> s(n);
  for (size_t r = 0; r < n; ++r) s[r] = {r == me ? mine : cl::Mem(), 0, counts[r]};
  return s;
}

// Rows rank i sends to rank j in the all-to-all (some are 0).
size_t rows_between(size_t i, size_t j, size_t round) { return (i + 2 * j + round) % 3; }

void round_of_checks(Communicator& comm, Device& dev, size_t round) {
  // allgather: uneven counts, one of them 0.
  {
    std::vector<size_t> counts(n);
    size_t total = 0;
    for (size_t r = 0; r < n; ++r) total += counts[r] = (r + round) % 3 == 0 ? 0 : 5 + r * 7;
    cl::Mem send = upload(dev, values(me, counts[me], round));
    cl::Mem recv = dev.alloc(total * sizeof(float) + 4);
    std::vector<size_t> totals(n, total);
    comm.allgather(spans(send, counts), spans(recv, totals), "test");
    std::vector<float> want;
    for (size_t r = 0; r < n; ++r) {
      auto v = values(r, counts[r], round);
      want.insert(want.end(), v.begin(), v.end());
    }
    expect_equal(download(dev, recv, 0, total), want, "allgather");
  }
  // allreduce: rank-ordered sums, a length that is not a multiple of 16.
  {
    const size_t L = 1000 + round;
    cl::Mem buf = upload(dev, values(me, L, round));
    comm.allreduce(spans(buf, std::vector<size_t>(n, L)), "test");
    std::vector<float> want = values(0, L, round);
    for (size_t r = 1; r < n; ++r) {
      auto v = values(r, L, round);
      for (size_t i = 0; i < L; ++i) want[i] = want[i] + v[i];
    }
    expect_equal(download(dev, buf, 0, L), want, "allreduce");
  }
  // broadcast from the last rank.
  {
    const size_t L = 77;
    const size_t root = n - 1;
    cl::Mem buf = upload(dev, values(me, L, round));
    comm.broadcast(root, spans(buf, std::vector<size_t>(n, L)), "test");
    expect_equal(download(dev, buf, 0, L), values(root, L, round), "broadcast");
  }
  // all_to_all_rows: rows of width 3, counts that differ per pair.
  {
    const size_t W = 3;
    std::vector<size_t> off(n + 1, 0);
    for (size_t j = 0; j < n; ++j) off[j + 1] = off[j] + rows_between(me, j, round) * W;
    std::vector<float> mine(off[n]);
    for (size_t j = 0; j < n; ++j)
      for (size_t x = off[j]; x < off[j + 1]; ++x)
        mine[x] = float(1000 * me + 100 * j) + float(x - off[j]);
    cl::Mem send = upload(dev, mine);
    std::vector<std::vector<DeviceSpan>> s(n, std::vector<DeviceSpan>(n));
    std::vector<size_t> rows_to(n, 0);
    for (size_t i = 0; i < n; ++i)
      for (size_t j = 0; j < n; ++j) {
        const size_t c = rows_between(i, j, round) * W;
        s[i][j] = i == me ? DeviceSpan{send, off[j], c} : DeviceSpan{cl::Mem(), 0, c};
        rows_to[j] += c;
      }
    cl::Mem recv = dev.alloc((rows_to[me] + 1) * sizeof(float));
    comm.all_to_all_rows(s, spans(recv, rows_to), W, "test");
    std::vector<float> want;
    for (size_t i = 0; i < n; ++i)
      for (size_t x = 0; x < rows_between(i, me, round) * W; ++x)
        want.push_back(float(1000 * i + 100 * me) + float(x));
    expect_equal(download(dev, recv, 0, rows_to[me]), want, "all_to_all_rows");
  }
}

// A line on stderr in one write: std::cerr writes each << piece on its own, and mpirun's banner
// for the abort that follows once landed between "rank " and the rest (the stalled-rank test's
// expected line then did not match).
void say_on_stderr(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

int main(int argc, char** argv) {
  mpi_init(&argc, &argv);
  me = size_t(mpi_world_rank());
  n = size_t(mpi_world_size());
  const std::string mode = argc > 1 ? argv[1] : "check";
  const long victim = argc > 2 ? std::atol(argv[2]) : -1;
  try {
    DeviceManager devices(DeviceSelection{});
    Device& dev = devices[0];
    MpiTransportOptions opts;
    if (mode != "check") opts.timeout = std::chrono::milliseconds(3000);
    Communicator comm(std::make_unique<MpiTransport>(dev, opts));
    for (size_t round = 0; round < 4; ++round) {
      if (round == 2 && long(me) == victim) {
        if (mode == "stall") std::raise(SIGSTOP);
        if (mode == "kill") std::raise(SIGKILL);
      }
      round_of_checks(comm, dev, round);
    }
  } catch (const CollectiveError& e) {
    say_on_stderr("rank " + std::to_string(me) + ": collective error: " + e.what() + "\n");
    abort_world(3);
  } catch (const std::exception& e) {
    say_on_stderr("rank " + std::to_string(me) + ": " + e.what() + "\n");
    abort_world(2);
  }
  int bad = failures, all_bad = 0;
  (void)bad;
  std::vector<uint32_t> mine{uint32_t(failures)};
  for (const auto& v : mpi_allgather_u32(mine)) all_bad += int(v.at(0));
  if (me == 0) {
    if (all_bad == 0) std::cout << "mpi collectives: " << n << " ranks OK\n";
    else std::cout << "mpi collectives: " << all_bad << " failure(s)\n";
  }
  return all_bad == 0 ? 0 : 1;
}
