// Devices: an OpenCL device (or sub-device) with its context, in-order queue, compiled programs and
// a pool of scratch buffers. Everything that runs on a device goes through one of these.
#pragma once

#include <CL/cl.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/cl.h"

namespace clshard {

enum class DeviceKind { Cpu, Gpu, Accelerator, Other };

// How kernels split their work on a device: CPU OpenCL wants one work-item per contiguous chunk
// (local size 1, wide vector loads); GPUs want work-groups of lanes reading neighbouring
// elements. Ops with two variants pick by this.
enum class KernelShape { Chunks, WorkGroups };
const char* device_kind_name(DeviceKind k);
const char* kernel_shape_name(KernelShape s);  // "cpu" | "gpu", as devices.kernel_shape says
// Whether a launch that names no local size runs in work-groups of one work-item: on CPUs, and on
// any device running the CPU shape. Kernels of that shape own their chunk alone, and some keep a
// work-item's scratch in local memory (bf16_packed.cl's panel), which the work-items of a larger
// group would share and overwrite. Elsewhere the driver chooses.
bool single_work_item_groups(DeviceKind kind, KernelShape shape);

// The parameters of the WorkGroups-shaped kernels on one device: host launch sizes and kernel
// constants both come from here (the kernels get them as -D build options). Looked up by device
// type, vendor and name in runtime/kernel_tuning.cpp; tests and benchmarks may set others.
struct KernelTuning {
  uint32_t norm_wg = 256;         // RMSNorm: lanes per row
  uint32_t rope_wg = 64;          // RoPE + KV store: lanes per token
  uint32_t linear_wg = 64;        // linear_wg.cl: lanes per output feature
  uint32_t linear_rows = 4;       // linear_wg.cl: rows per work-group (fewer where M is)
  // linear_wg.cl and the grouped experts' GPU shape (wg_dots.cl): weights each lane reads per
  // step, side by side (1, 2, 4 or 8); 1 is the plain one-element stride.
  uint32_t linear_vector = 1;
  uint32_t attn_wg = 64;          // paged attention: lanes per (token, head group, split)
  uint32_t attn_tile = 32;        // positions per local-memory tile (MHA)
  uint32_t attn_heads = 8;        // query heads sharing one KV head per work-group, at most
  uint32_t attn_split = 512;      // positions per split-K work-group (rounded to the tile)
  // Prefill attention (attention.cl's paged_attention_prefill_wg, steps whose longest row brings
  // more than kPrefillAttentionFrom tokens): lanes, query tokens per tile, KV positions per
  // local-memory tile, query heads per work-group at most (the tiles shrink to the device's
  // local memory).
  uint32_t prefill_wg = 64;
  uint32_t prefill_q = 8;
  uint32_t prefill_tile = 16;
  uint32_t prefill_heads = 4;
  uint32_t mla_wg = 128;          // MLA decode: lanes per work-group
  uint32_t mla_tile = 8;          // MLA decode: cache rows per tile (576 floats each)
  // MLA decode: query heads per work-group (the CPU shape: per work-item), at most.
  uint32_t mla_heads = 8;
  uint32_t route_wg = 64;         // MoE router: lanes per token (over the experts)
  // The per-row kernels (embedding, silu_mul, moe_combine, and mla.cl's *_wg: gather, RoPE +
  // cache store, query absorption, the per-head up-projection): lanes per work-group (a power of
  // two); and tokens per work-group of MLA's two per-head GEMMs from 4 tokens on.
  uint32_t row_wg = 64;
  uint32_t mla_row_tokens = 4;
  // Decode GEMVs on the CPU shape (linear.cl, one-row tiles) read the weight rows one after
  // another, not four side by side, while K is at most this (the x row stays in L1).
  uint32_t gemv_stream_k = 4096;
  // The same bound for FP8 weights (fp8_tile.cl's tiles in turn: linear_fp8, the grouped experts,
  // MLA's up-projection), whose private x row is this long. Apart from gemv_stream_k because the
  // two differ: on the Zen 5 EPYC, K = 4608 and 7168 ran 1.45-1.80x faster in turn in FP8 and
  // 0.82-0.89x at K = 7168 in bf16.
  uint32_t fp8_stream_k = 4096;
  // CPU-shape GEMMs (linear.cl, moe.cl's grouped tile) prefetch the rows of a work-item's next
  // column tile while the current one streams (linear_tile.cl's tile_dots); MLA's decode
  // attention the cache row two positions on (mla.cl) and the attention tiles the next block's
  // keys and values (attention.cl): 1 on, 0 off. Takes effect only on PoCL's CPU device on an x86
  // host (ops::weight_prefetch_option).
  uint32_t weight_prefetch = 1;
  // FP8 decode GEMVs on the CPU shape (fp8_tile.cl's tiles in turn) prefetch the line this many
  // bytes ahead in their weight stream (0: off); as weight_prefetch, only on PoCL's CPU device on
  // an x86 host (ops::columns_in_turn_option).
  uint32_t stream_prefetch = 0;
  // The same for the decode GEMVs over f32, bf16 and f16 weights (linear_tile.cl's one-row tiles
  // in turn, but for gate/up, which prefetch their next tile): bytes ahead, 0 off. Apart from
  // stream_prefetch because the two CPUs measured here differ on it (kernel_tuning.cpp).
  uint32_t gemv_stream_prefetch = 0;
  // Both streams, FP8's and these, also prefetch the line this many bytes ahead into L1
  // (prefetcht0; 0: off), beside their prefetch into L2, so that fewer loads wait on L2.
  uint32_t stream_prefetch_l1 = 0;
  // Whether the f32 / bf16 / f16 one-row tiles read their weight rows two at a time (1) or one
  // after another (0): each row's sum is the same FMAs in the same order either way, but two rows
  // keep two independent FMA chains in flight, where one row's chain (4 cycles per 16 weights)
  // had bounded the stream (linear_tile.cl, kernel_tuning.cpp).
  uint32_t gemv_row_pairs = 0;
  // Rows per tile of linear.cl's tiles (compute f32: f32 / bf16 / f16 weights; CPU shape) for
  // batches of this many to 64 rows (decode batches, which stream the weights; fewer rows, and
  // prefill's, take 4): each weight vector loaded and widened once for all of a tile's rows.
  uint32_t linear_batch_tm = 4;
  // The bf16-compute GEMM (linear_bf16.cl, model.compute_dtype: bf16; CPU shape): tile rows and
  // weight rows (even: GLU splits them into gate and up), the same for batches below one
  // work-item's rows (decode, which streams the weights), rows per work-item, and whether PoCL
  // on a host with AVX-512 BF16 uses vdpbf16ps (1) or the portable FMA micro-kernel (0).
  uint32_t gemm_bf16_tm = 4;
  uint32_t gemm_bf16_tn = 4;
  uint32_t gemm_bf16_batch_tm = 4;
  uint32_t gemm_bf16_batch_tn = 4;
  uint32_t gemm_bf16_rows = 64;
  uint32_t gemm_bf16_dot = 1;
  // Whether bf16 compute's GEMVs (below kGemmRowsFrom rows) sum in bf16 too where the host has
  // vdpbf16ps and no AMX (ops::bf16_gemv): 1, or 0 for the f32 GEMV.
  uint32_t gemm_bf16_gemv = 1;
  // From gemm_bf16_packed_rows rows (0: never), bf16 and FP8 weights take the packed GEMM instead
  // (linear_bf16.cl's linear_bf16_packed, bf16_packed.cl): a work-item packs its column tile's
  // weight pairs once and runs tiles of gemm_bf16_packed_tm rows x gemm_bf16_packed_nv vectors of
  // 16 columns over them (with GLU an even number of vectors, half gate and half up).
  uint32_t gemm_bf16_packed_rows = 128;
  // The grouped experts' (moe.cl, bf16 compute) threshold of the same, per expert: experts of this
  // many rows or more (0: never) take the packed GEMM, the others the dot-product tiles. Apart
  // from gemm_bf16_packed_rows because the two differ: on the EPYC a 512-token prefill's experts
  // of ~48 rows ran faster packed, where a dense 32-row decode batch ran slower
  // (kernel_tuning.cpp).
  uint32_t moe_bf16_packed_rows = 128;
  // The same for FP8 experts, whose panels dequantize e4m3 codes as they pack them. Apart from
  // moe_bf16_packed_rows because the two differ: on the Xeon without AMX a 128-token prefill's
  // bf16 experts ran faster packed from 8 rows, its FP8 experts slower (kernel_tuning.cpp).
  uint32_t moe_fp8_packed_rows = 128;
  uint32_t gemm_bf16_packed_tm = 4;
  uint32_t gemm_bf16_packed_nv = 3;
  // The pair steps (two elements of K each) of a packed panel at once: longer rows are packed and
  // run in chunks of this many (rounded down to a multiple of 16, at least 16), a work-item's rows
  // then at most 512, whose partial sums wait in local memory between chunks. A panel of 1024
  // steps x 64 columns is 256 KiB: the chunk decides whether the panel stays in L2 or nearer.
  uint32_t gemm_bf16_packed_kp = 1024;
  // Whether the packed GEMM's portable micro-kernel (no vdpbf16ps, no AMX) reads a panel of the
  // weights widened to f32 (1: twice the local memory, taken where it fits; the pack widens each
  // weight once), or of bf16 pairs that each step widens (0).
  uint32_t gemm_bf16_packed_wf32 = 0;
  // Whether the packed GEMM takes AMX's bf16 tiles where the host has them (ops::bf16_amx): 1, or
  // 0 for gemm_bf16_dot's micro-kernel. With AMX its tile is 16 rows (one tile register) x at
  // most 5 of gemm_bf16_packed_nv's vectors (4 with GLU). With AMX the packed GEMM takes bf16
  // compute from gemm_bf16_amx_rows rows where that is fewer than gemm_bf16_packed_rows (0 there
  // still turns the packed GEMM off): its tiles leave even batched decode bound by the weight
  // reads, where the dot-product tiles were bound by their products.
  uint32_t gemm_bf16_amx = 1;
  uint32_t gemm_bf16_amx_rows = 8;
  // With AMX, batches of at most gemm_bf16_amx_stream_rows rows (0: none; at most 32) over bf16
  // weights take the GEMM that reads the weights where they lie as AMX's A operand
  // (bf16_amx_stream.cl) instead of packing them: units of gemm_bf16_amx_stream_na groups of 16
  // weight rows (2 or 4: read together against each load of the batch's rows; 1: one group at a
  // time, with GLU its gate rows, then its up rows). One group at a time streams 16 rows at once,
  // and llama3-1b's batch-8 step ran 1.19x faster so than with 2 (4: 0.81x of 2).
  uint32_t gemm_bf16_amx_stream_rows = 32;
  uint32_t gemm_bf16_amx_stream_na = 1;
  // With AMX (gemm_bf16_amx), compute_dtype f32 GEMMs over bf16 weights of gemm_f32_amx_rows rows
  // and more (0: never) run on AMX's bf16 tiles with each f32 row as three bf16 terms whose sum is
  // the row exactly (linear_bf16.cl's bf16_terms): each product exact, the sums in f32, as the f32
  // FMA kernels give them but in AMX's order. Up to gemm_bf16_amx_stream_rows rows the streaming
  // GEMM, the packed one beyond. On the 2-core Xeon with AMX, llama3-1b's decode step
  // (bench_decode_breakdown --tuning-ab, 4-6 rounds in turn) took at 32 rows 314 against 655 ms
  // with the f32 kernels, at 16 193 against 369, at 8 197 against 209 and at 4 207 against 113
  // (AMX bound by its products there, not by the weight reads), hence 16.
  uint32_t gemm_f32_amx_rows = 16;
  // GPU-shape GEMMs of at least this many rows go to CLBlast's tuned SGEMM (ops_blas.h; bf16
  // weights widened to f32 first); 0: never. Set in the rows of devices where it measured faster.
  uint32_t blas_gemm_rows = 0;
  uint64_t split_scratch_bytes = 64ull << 20;  // cap on split-K partials per launch
  bool operator==(const KernelTuning&) const = default;
};

// Where a device sits in the machine, as hwloc sees it.
struct DeviceLocality {
  std::vector<int> numa_nodes;  // NUMA node os indexes
  int cores = 0;                // cores under the device's locality
  std::string pci_bus;          // "dddd:bb:dd.f" for GPUs when known
};

struct DeviceInfo {
  std::string platform;
  std::string platform_version;
  std::string name;
  std::string vendor;
  std::string driver_version;
  std::string opencl_version;
  DeviceKind kind = DeviceKind::Other;
  uint32_t compute_units = 0;
  uint64_t global_mem = 0;
  uint64_t max_alloc = 0;
  uint64_t local_mem = 0;            // CL_DEVICE_LOCAL_MEM_SIZE
  bool host_unified_memory = false;  // buffers can wrap host memory without a copy
  bool fp16 = false;
  bool fp64 = false;
  DeviceLocality locality;
  bool is_sub_device = false;
};

DeviceInfo query_device_info(cl_device_id id, cl_platform_id platform);
// PoCL's CPU device: kernels compiled by its clang for the host and run on the host's cores.
bool pocl_cpu(const DeviceInfo& info);

// The table's entry for a device (runtime/kernel_tuning.cpp): the first row whose type, vendor
// and name match, else the default.
KernelTuning lookup_kernel_tuning(const DeviceInfo& info);

// clCreateBuffer, but with host_huge_pages (PoCL's CPU device, whose buffers are host memory) a
// buffer of 2 MiB or more (and no host-pointer flags) lies in memory of its own: whole 2 MiB pages
// on a 2 MiB boundary, advised to transparent huge pages (MADV_HUGEPAGE) and given to the driver
// as CL_MEM_USE_HOST_PTR, unmapped when the buffer is released. PoCL's own allocations sit in
// 4 KiB pages where the kernel gives huge pages only where advised (THP "madvise", Debian's
// default). There a KV cache sized to its requests (one K and one V row of a head every 2 KiB,
// each layer's pages after the weights' stream) made llama3-1b's decode attention at 1024 cached
// positions take 714-907 us per layer, 269-279 us in huge pages (bench_step_breakdown --timeline,
// 2-core Zen 5, 2026-12-02); `clshard bench` with a 12-page pool decoded 1.08-1.15x and prefilled
// 1.06x faster (1024-token prompt). With the default pool (90% of free memory) it measured no
// difference; why the larger buffers were spared was not found.
cl_mem create_buffer(cl_context ctx, cl_mem_flags flags, size_t bytes, bool host_huge_pages,
                     cl_int* err);

// A buffer pool: scratch buffers are reused across steps by size class (powers of two), so a
// decode loop does not allocate. Buffers go back to the pool when their Scratch handle dies.
class BufferPool {
 public:
  BufferPool(cl_context ctx, bool host_huge_pages) : ctx_(ctx), host_huge_pages_(host_huge_pages) {}
  cl::Mem take(size_t bytes);
  void give_back(cl::Mem m, size_t bytes);
  size_t bytes_held() const { return held_; }

 private:
  static size_t size_class(size_t bytes);
  cl_context ctx_;
  bool host_huge_pages_;  // create_buffer's
  std::multimap<size_t, cl::Mem> free_;
  size_t held_ = 0;
  std::mutex mu_;
};

class Device {
 public:
  Device(cl_platform_id platform, cl_device_id id, cl::Context ctx, int index);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceInfo& info() const { return info_; }
  int index() const { return index_; }
  cl_device_id id() const { return id_; }
  cl_context context() const { return ctx_.get(); }
  cl_command_queue queue() const { return queue_.get(); }
  bool is_cpu() const { return info_.kind == DeviceKind::Cpu; }
  // Chunks on CPUs, WorkGroups elsewhere; tests and benchmarks may force the other shape to check
  // or time both variants on one device.
  KernelShape kernel_shape() const { return shape_; }
  void set_kernel_shape(KernelShape s) { shape_ = s; }
  // Launch parameters of the WorkGroups shape (lookup_kernel_tuning unless set).
  const KernelTuning& tuning() const { return tuning_; }
  void set_tuning(const KernelTuning& t) { tuning_ = t; }
  // A short label for messages: "device 0 (pthread-skylake-avx512 on Portable Computing Language)".
  std::string label() const;

  // Kernels by name from a kernels_cl/ file, built with the given build options (-D...).
  // Each is a program of its own, built once per (file, options, name) and cached on disk
  // (program_cache.h).
  cl::Kernel kernel(const std::string& file, const std::string& name,
                    const std::string& options = "");
  // Kernels this device has built or read from the cache so far (serving's warm-up is checked by
  // it: the requests after it build none).
  size_t kernels_built() const { return kernels_.size(); }

  // Buffers.
  cl::Mem alloc(size_t bytes, cl_mem_flags flags = CL_MEM_READ_WRITE) const;
  // A read-only buffer over host memory that outlives it: wraps it where the device shares host
  // memory (no copy), uploads it otherwise.
  cl::Mem wrap_host(const void* data, size_t bytes) const;
  void write(const cl::Mem& m, const void* src, size_t bytes, size_t offset = 0) const;
  void read(const cl::Mem& m, void* dst, size_t bytes, size_t offset = 0) const;
  void fill_zero(const cl::Mem& m, size_t bytes, size_t offset = 0) const;
  void finish() const;
  // Submits what is queued without waiting, so this device works while the host feeds others.
  void flush() const;

  // Enqueues an NDRange with local size 1 in every dimension where single_work_item_groups says
  // so (CPUs, and the CPU shape anywhere), else lets the driver choose, unless `local` is given.
  void launch(const cl::Kernel& k, std::array<size_t, 3> global, int dims = 1,
              const size_t* local = nullptr) const;
  // A one-dimensional launch as above, after the events in `wait` (of this device's context);
  // returns the launch's event. `what` (the caller's work, e.g. a collective's name) leads an
  // error's message.
  cl::Event launch_after(const cl::Kernel& k, size_t global, const std::vector<cl_event>& wait,
                         const std::string& what) const;

  BufferPool& pool() { return *pool_; }

 private:
  // `what`, when not null, leads an error's message.
  void enqueue(const cl::Kernel& k, int dims, const size_t* global, const size_t* local,
               const std::vector<cl_event>& wait, cl_event* event, const char* what) const;

  cl_device_id id_;
  cl::Context ctx_;
  cl::Queue queue_;
  DeviceInfo info_;
  int index_;
  KernelShape shape_;
  KernelTuning tuning_;
  bool pocl_cpu_ = false;  // its launches go through PoclKernelOrder
  std::unique_ptr<BufferPool> pool_;
  std::map<std::string, cl::Kernel> kernels_;
  std::mutex mu_;
};

// Writes that go up together and are waited for once, not once each: every wait is a round trip
// to the device's threads (about 25 us on PoCL on the 2-core EPYC VM). Each write is queued as it
// comes; all have completed when wait() returns and when the batch goes out of scope (waiting
// then too, without throwing: an exception may be on its way), so a source need live only as
// long as the batch. upload_mla_prefill_plan: one wait for two buffers.
class WriteBatch {
 public:
  explicit WriteBatch(const Device& dev) : dev_(dev) {}
  WriteBatch(const WriteBatch&) = delete;
  WriteBatch& operator=(const WriteBatch&) = delete;
  ~WriteBatch();
  void write(const cl::Mem& m, const void* src, size_t bytes, size_t offset = 0);
  void wait();

 private:
  const Device& dev_;
  bool queued_ = false;
};

// A scratch buffer from a device's pool that goes back when it goes out of scope.
class Scratch {
 public:
  Scratch() = default;
  Scratch(Device& dev, size_t bytes) : dev_(&dev), bytes_(bytes), mem_(dev.pool().take(bytes)) {}
  Scratch(Scratch&& o) noexcept { *this = std::move(o); }
  Scratch& operator=(Scratch&& o) noexcept {
    release();
    dev_ = std::exchange(o.dev_, nullptr);
    bytes_ = o.bytes_;
    mem_ = std::move(o.mem_);
    return *this;
  }
  ~Scratch() { release(); }
  const cl::Mem& mem() const { return mem_; }
  size_t bytes() const { return bytes_; }

 private:
  void release() {
    if (dev_ && mem_) dev_->pool().give_back(std::move(mem_), bytes_);
    dev_ = nullptr;
  }
  Device* dev_ = nullptr;
  size_t bytes_ = 0;
  cl::Mem mem_;
};

}  // namespace clshard
