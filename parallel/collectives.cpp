#include "parallel/collectives.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/device.h"

namespace clshard::parallel {

namespace {

constexpr size_t kMaxReduceInputs = 8;  // buffer arguments of reduce_ranks_f32

std::string named(const char* collective, const char* what) {
  return std::string(collective) + "(" + (what ? what : "") + ")";
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace

Communicator::Communicator(std::vector<Device*> devices, CommunicatorOptions options)
    : Communicator(std::make_unique<OpenClTransport>(std::move(devices), options)) {}

Communicator::Communicator(std::unique_ptr<Transport> transport)
    : transport_(std::move(transport)) {
  if (!transport_) throw std::invalid_argument("Communicator: no transport");
  reduce_temp_.resize(size());
  reduce_temp_floats_.assign(size(), 0);
}

Communicator::~Communicator() {
  // The transport drains the queues before the reduction scratch is released.
  transport_.reset();
}

bool Communicator::same_context(size_t a, size_t b) const {
  return device(a).context() == device(b).context();
}

std::vector<size_t> Communicator::even_shards(size_t count, size_t ranks) {
  if (ranks == 0) throw std::invalid_argument("even_shards: no ranks");
  constexpr size_t block = 16;
  const size_t blocks = count / block, tail = count % block;
  std::vector<size_t> shards(ranks);
  for (size_t r = 0; r < ranks; ++r)
    shards[r] = (blocks / ranks + (r < blocks % ranks ? 1 : 0)) * block;
  // The last few floats go to the last rank whose shard ends where the tail begins.
  size_t last = ranks - 1;
  while (last > 0 && shards[last] == 0) --last;
  shards[last] += tail;
  return shards;
}

void Communicator::check_span(const std::string& name, const char* role, size_t rank,
                              size_t index, const DeviceSpan& s) const {
  // A remote rank's span (another process's, MpiTransport) carries only its length.
  if (s.count_floats == 0 || !is_local(rank)) return;
  const std::string where = name + ": " + role + "[" + std::to_string(index) + "] (on rank " +
                            std::to_string(rank) + ", " + device(rank).label() + ")";
  if (!s.buf) throw std::invalid_argument(where + " has " + std::to_string(s.count_floats) +
                                          " floats but no buffer");
  size_t bytes = 0;
  cl_context ctx = nullptr;
  cl::check(clGetMemObjectInfo(s.buf.get(), CL_MEM_SIZE, sizeof bytes, &bytes, nullptr),
            where + ": querying the buffer");
  cl::check(clGetMemObjectInfo(s.buf.get(), CL_MEM_CONTEXT, sizeof ctx, &ctx, nullptr),
            where + ": querying the buffer");
  if ((s.offset_floats + s.count_floats) * sizeof(float) > bytes)
    throw std::invalid_argument(where + " spans floats [" + std::to_string(s.offset_floats) + ", " +
                                std::to_string(s.offset_floats + s.count_floats) +
                                ") of a buffer of " + std::to_string(bytes / sizeof(float)));
  if (ctx != device(rank).context())
    throw std::invalid_argument(where + " is a buffer of another OpenCL context than its device's");
}

cl::Mem& Communicator::reduce_temp(size_t rank, size_t floats) {
  if (reduce_temp_floats_[rank] < floats) {
    // Commands already enqueued keep the old buffer alive until they finish.
    reduce_temp_[rank] = device(rank).alloc(floats * sizeof(float));
    reduce_temp_floats_[rank] = floats;
  }
  return reduce_temp_[rank];
}

void Communicator::run_phase(const std::string& name, const std::vector<Copy>& copies,
                             const std::vector<Reduce>& reduces) {
  const size_t n = size();
  ++stats_.phases;

  // Every piece of data a destination consumes, in the order the consumers below take them.
  std::vector<Transport::Piece> pieces;
  for (const Copy& c : copies) pieces.push_back({c.src, c.dst, c.from});
  for (const Reduce& r : reduces)
    for (size_t i = 0; i < r.inputs.size(); ++i) pieces.push_back({i, r.dst, r.inputs[i]});
  const std::vector<Transport::View> views = transport_->open_phase(name, pieces);
  stats_.bytes_staged = transport_->stats().bytes_staged;
  stats_.host_wait_seconds = transport_->stats().host_wait_seconds;

  // The consumers, on the destinations' queues. Each lists its view's wait event; one that reads
  // a source's own buffer is remembered, so the transport can make the source's queue wait for it
  // before anything overwrites the data.
  std::vector<std::vector<cl::Event>> readers_of(n);
  auto waits_for = [](const Transport::View& v) {
    std::vector<cl_event> w;
    if (v.wait) w.push_back(v.wait.get());
    return w;
  };
  size_t next_input = 0;
  for (const Copy& c : copies) {
    const Transport::View& in = views[next_input++];
    const size_t bytes = c.from.count_floats * sizeof(float);
    if (bytes == 0 || !is_local(c.dst)) continue;  // a remote rank consumes it in its process
    const bool block = c.rows > 0;
    if (in.span.buf.get() == c.to.buf.get() && in.span.offset_floats == c.to.offset_floats &&
        (!block || c.dst_pitch == c.cols))
      continue;  // already in place
    Device& dst = device(c.dst);
    auto w = waits_for(in);
    cl_event ev = nullptr;
    if (block) {
      // Origins are byte offsets along x; the rows of the source block are contiguous.
      const size_t src_origin[3] = {in.span.offset_floats * sizeof(float), 0, 0};
      const size_t dst_origin[3] = {c.to.offset_floats * sizeof(float), 0, 0};
      const size_t region[3] = {c.cols * sizeof(float), c.rows, 1};
      cl::check(clEnqueueCopyBufferRect(dst.queue(), in.span.buf.get(), c.to.buf.get(),
                                        src_origin, dst_origin, region, c.cols * sizeof(float), 0,
                                        c.dst_pitch * sizeof(float), 0, cl_uint(w.size()),
                                        w.empty() ? nullptr : w.data(), &ev),
                name + ": copying a column block from rank " + std::to_string(c.src) + " into " +
                    dst.label());
    } else {
      cl::check(clEnqueueCopyBuffer(dst.queue(), in.span.buf.get(), c.to.buf.get(),
                                    in.span.offset_floats * sizeof(float),
                                    c.to.offset_floats * sizeof(float), bytes, cl_uint(w.size()),
                                    w.empty() ? nullptr : w.data(), &ev),
                name + ": copying from rank " + std::to_string(c.src) + " into " + dst.label());
    }
    cl::Event event(ev);
    if (in.reads_source_buffer) readers_of[c.src].push_back(event);
    if (c.src != c.dst) stats_.bytes_moved += bytes;
  }
  for (const Reduce& r : reduces) {
    const size_t k = r.inputs.size();
    std::vector<const Transport::View*> ins(k);
    for (size_t i = 0; i < k; ++i) ins[i] = &views[next_input++];
    const size_t count = r.out.count_floats;
    if (count == 0 || !is_local(r.dst)) continue;
    if (count > UINT32_MAX)
      throw std::invalid_argument(name + ": a shard of " + std::to_string(count) +
                                  " floats is more than one reduction launch takes (2^32 - 1)");
    Device& dst = device(r.dst);
    std::vector<cl_event> w;
    for (const Transport::View* in : ins)
      for (cl_event e : waits_for(*in)) w.push_back(e);
    cl::Kernel kernel = dst.kernel("collectives.cl", "reduce_ranks_f32");
    // A few contiguous chunks per compute unit, whole 16-float vectors.
    const size_t cus = std::max<uint32_t>(1, dst.info().compute_units);
    const size_t chunk =
        std::max<size_t>(256, round_up((count + 4 * cus - 1) / (4 * cus), 16));
    const size_t items = (count + chunk - 1) / chunk;
    // More than 8 ranks: partial sums in a scratch buffer (the output may alias an input), then
    // one copy out.
    const bool via_temp = k > kMaxReduceInputs;
    const DeviceSpan out = via_temp ? DeviceSpan{reduce_temp(r.dst, count), 0, count} : r.out;
    cl::Event last;
    for (size_t first = 0; first < k; first += kMaxReduceInputs) {
      const size_t m = std::min(kMaxReduceInputs, k - first);
      cl::set_args(kernel, out.buf, cl_ulong(out.offset_floats), cl_uint(count), cl_uint(chunk),
                   cl_uint(m), cl_uint(first > 0 ? 1 : 0));
      for (size_t a = 0; a < kMaxReduceInputs; ++a) {
        const DeviceSpan& v = ins[first + std::min(a, m - 1)]->span;  // unused slots repeat one
        cl::detail::set_one(kernel.get(), cl_uint(6 + 2 * a), v.buf);
        cl::detail::set_one(kernel.get(), cl_uint(7 + 2 * a), cl_ulong(v.offset_floats));
      }
      last = dst.launch_after(kernel, items, first == 0 ? w : std::vector<cl_event>{}, name);
    }
    if (via_temp) {
      cl_event copy = nullptr;
      cl::check(clEnqueueCopyBuffer(dst.queue(), out.buf.get(), r.out.buf.get(), 0,
                                    r.out.offset_floats * sizeof(float), count * sizeof(float), 0,
                                    nullptr, &copy),
                name + ": copying partial sums on " + dst.label());
      last = cl::Event(copy);
    }
    const cl::Event& event = last;  // in-order queue: its completion covers the launches before it
    for (size_t i = 0; i < k; ++i) {
      if (r.inputs[i].count_floats == 0 || i == r.dst) continue;
      if (ins[i]->reads_source_buffer) readers_of[i].push_back(event);
      stats_.bytes_moved += r.inputs[i].count_floats * sizeof(float);
    }
  }

  transport_->close_phase(name, readers_of);
}

void Communicator::allgather(const std::vector<DeviceSpan>& send,
                             const std::vector<DeviceSpan>& recv, const char* what) {
  const std::string name = named("allgather", what);
  const size_t n = size();
  if (send.size() != n || recv.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) +
                                " send and recv spans, got " + std::to_string(send.size()) +
                                " and " + std::to_string(recv.size()));
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    check_span(name, "send", i, i, send[i]);
    total += send[i].count_floats;
  }
  for (size_t j = 0; j < n; ++j) {
    check_span(name, "recv", j, j, recv[j]);
    if (is_local(j) && recv[j].count_floats < total)
      throw std::invalid_argument(name + ": recv[" + std::to_string(j) + "] holds " +
                                  std::to_string(recv[j].count_floats) + " floats, the gather is " +
                                  std::to_string(total));
  }
  std::vector<Copy> copies;
  for (size_t j = 0; j < n; ++j) {
    size_t at = recv[j].offset_floats;
    for (size_t i = 0; i < n; ++i) {
      copies.push_back({i, j, send[i], {recv[j].buf, at, send[i].count_floats}});
      at += send[i].count_floats;
    }
  }
  ++stats_.collectives;
  run_phase(name, copies, {});
}

void Communicator::allgather_columns(const std::vector<DeviceSpan>& send,
                                     const std::vector<DeviceSpan>& recv, size_t rows,
                                     const char* what) {
  const std::string name = named("allgather_columns", what);
  const size_t n = size();
  if (send.size() != n || recv.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) +
                                " send and recv spans, got " + std::to_string(send.size()) +
                                " and " + std::to_string(recv.size()));
  if (rows == 0) throw std::invalid_argument(name + ": 0 rows");
  std::vector<size_t> cols(n);
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    check_span(name, "send", i, i, send[i]);
    if (send[i].count_floats % rows)
      throw std::invalid_argument(name + ": send[" + std::to_string(i) + "] has " +
                                  std::to_string(send[i].count_floats) + " floats, not " +
                                  std::to_string(rows) + " whole rows");
    cols[i] = send[i].count_floats / rows;
    total += cols[i];
  }
  std::vector<Copy> copies;
  for (size_t j = 0; j < n; ++j) {
    check_span(name, "recv", j, j, recv[j]);
    if (is_local(j) && recv[j].count_floats < rows * total)
      throw std::invalid_argument(name + ": recv[" + std::to_string(j) + "] holds " +
                                  std::to_string(recv[j].count_floats) + " floats, the gather is " +
                                  std::to_string(rows) + " x " + std::to_string(total));
    size_t col = 0;
    for (size_t i = 0; i < n; ++i) {
      Copy c{i, j, send[i], {recv[j].buf, recv[j].offset_floats + col, send[i].count_floats}};
      c.rows = rows;
      c.cols = cols[i];
      c.dst_pitch = total;
      copies.push_back(std::move(c));
      col += cols[i];
    }
  }
  ++stats_.collectives;
  run_phase(name, copies, {});
}

void Communicator::reduce_scatter(const std::vector<DeviceSpan>& send,
                                  const std::vector<size_t>& shard_counts,
                                  const std::vector<DeviceSpan>& recv, const char* what) {
  const std::string name = named("reduce_scatter", what);
  const size_t n = size();
  if (send.size() != n || recv.size() != n || shard_counts.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) +
                                " send spans, shard counts and recv spans");
  size_t length = 0;
  for (size_t c : shard_counts) length += c;
  for (size_t i = 0; i < n; ++i) {
    check_span(name, "send", i, i, send[i]);
    if (send[i].count_floats != length)
      throw std::invalid_argument(name + ": send[" + std::to_string(i) + "] has " +
                                  std::to_string(send[i].count_floats) +
                                  " floats; the shard counts add up to " + std::to_string(length));
  }
  std::vector<Reduce> reduces;
  size_t off = 0;
  for (size_t j = 0; j < n; ++j) {
    check_span(name, "recv", j, j, recv[j]);
    if (is_local(j) && recv[j].count_floats < shard_counts[j])
      throw std::invalid_argument(name + ": recv[" + std::to_string(j) + "] holds " +
                                  std::to_string(recv[j].count_floats) + " floats, its shard is " +
                                  std::to_string(shard_counts[j]));
    Reduce r{j, {}, {recv[j].buf, recv[j].offset_floats, shard_counts[j]}};
    for (size_t i = 0; i < n; ++i)
      r.inputs.push_back({send[i].buf, send[i].offset_floats + off, shard_counts[j]});
    reduces.push_back(std::move(r));
    off += shard_counts[j];
  }
  ++stats_.collectives;
  run_phase(name, {}, reduces);
}

void Communicator::allreduce(const std::vector<DeviceSpan>& bufs, const char* what) {
  const std::string name = named("allreduce", what);
  const size_t n = size();
  if (bufs.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) + " buffers, got " +
                                std::to_string(bufs.size()));
  const size_t length = bufs[0].count_floats;
  for (size_t i = 0; i < n; ++i) {
    check_span(name, "bufs", i, i, bufs[i]);
    if (bufs[i].count_floats != length)
      throw std::invalid_argument(name + ": bufs[" + std::to_string(i) + "] has " +
                                  std::to_string(bufs[i].count_floats) + " floats, bufs[0] has " +
                                  std::to_string(length));
  }
  ++stats_.collectives;
  if (n == 1 || length == 0) return;  // the sum of one rank is itself
  const auto shards = even_shards(length, n);
  std::vector<size_t> shard_off(n, 0);
  for (size_t j = 1; j < n; ++j) shard_off[j] = shard_off[j - 1] + shards[j - 1];
  // Phase 1: rank j sums shard j in place. Phase 2: everyone copies the other shards.
  std::vector<Reduce> reduces;
  for (size_t j = 0; j < n; ++j) {
    Reduce r{j, {}, {bufs[j].buf, bufs[j].offset_floats + shard_off[j], shards[j]}};
    for (size_t i = 0; i < n; ++i)
      r.inputs.push_back({bufs[i].buf, bufs[i].offset_floats + shard_off[j], shards[j]});
    reduces.push_back(std::move(r));
  }
  run_phase(name + " reduce-scatter", {}, reduces);
  std::vector<Copy> copies;
  for (size_t j = 0; j < n; ++j)
    for (size_t i = 0; i < n; ++i)
      if (i != j)
        copies.push_back({i, j, {bufs[i].buf, bufs[i].offset_floats + shard_off[i], shards[i]},
                          {bufs[j].buf, bufs[j].offset_floats + shard_off[i], shards[i]}});
  run_phase(name + " allgather", copies, {});
}

void Communicator::broadcast(size_t root, const std::vector<DeviceSpan>& bufs, const char* what) {
  const std::string name = named("broadcast", what);
  const size_t n = size();
  if (root >= n)
    throw std::invalid_argument(name + ": root " + std::to_string(root) + " of " +
                                std::to_string(n) + " ranks");
  if (bufs.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) + " buffers, got " +
                                std::to_string(bufs.size()));
  for (size_t i = 0; i < n; ++i) {
    check_span(name, "bufs", i, i, bufs[i]);
    if (bufs[i].count_floats != bufs[root].count_floats)
      throw std::invalid_argument(name + ": bufs[" + std::to_string(i) + "] has " +
                                  std::to_string(bufs[i].count_floats) + " floats, the root's " +
                                  std::to_string(bufs[root].count_floats));
  }
  ++stats_.collectives;
  if (n == 1) return;
  std::vector<Copy> copies;
  for (size_t j = 0; j < n; ++j)
    if (j != root) copies.push_back({root, j, bufs[root], bufs[j]});
  run_phase(name, copies, {});
}

void Communicator::all_to_all_rows(const std::vector<std::vector<DeviceSpan>>& send,
                                   const std::vector<DeviceSpan>& recv, size_t width,
                                   const char* what) {
  const std::string name = named("all_to_all_rows", what);
  const size_t n = size();
  if (width == 0) throw std::invalid_argument(name + ": rows of width 0");
  if (send.size() != n || recv.size() != n)
    throw std::invalid_argument(name + ": expected " + std::to_string(n) + " x " +
                                std::to_string(n) + " send spans and " + std::to_string(n) +
                                " recv spans");
  std::vector<size_t> rows_to(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (send[i].size() != n)
      throw std::invalid_argument(name + ": send[" + std::to_string(i) + "] has " +
                                  std::to_string(send[i].size()) + " destinations, expected " +
                                  std::to_string(n));
    for (size_t j = 0; j < n; ++j) {
      check_span(name, "send", i, i * n + j, send[i][j]);
      if (send[i][j].count_floats % width)
        throw std::invalid_argument(name + ": send[" + std::to_string(i) + "][" +
                                    std::to_string(j) + "] has " +
                                    std::to_string(send[i][j].count_floats) +
                                    " floats, not whole rows of " + std::to_string(width));
      rows_to[j] += send[i][j].count_floats / width;
    }
  }
  std::vector<Copy> copies;
  for (size_t j = 0; j < n; ++j) {
    check_span(name, "recv", j, j, recv[j]);
    if (is_local(j) && recv[j].count_floats < rows_to[j] * width)
      throw std::invalid_argument(name + ": recv[" + std::to_string(j) + "] holds " +
                                  std::to_string(recv[j].count_floats / width) + " rows, rank " +
                                  std::to_string(j) + " is sent " + std::to_string(rows_to[j]));
    size_t at = recv[j].offset_floats;
    for (size_t i = 0; i < n; ++i) {
      copies.push_back({i, j, send[i][j], {recv[j].buf, at, send[i][j].count_floats}});
      at += send[i][j].count_floats;
    }
  }
  ++stats_.collectives;
  run_phase(name, copies, {});
}

}  // namespace clshard::parallel
