#include "runtime/device.h"

#include <CL/cl_ext.h>
#include <hwloc.h>
#include <sys/mman.h>

#include <cstdio>
#include <cstring>

#include "runtime/huge_pages.h"
#include "runtime/pocl_kernel_order.h"
#include "runtime/program_cache.h"

namespace clshard {

const char* device_kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::Cpu: return "cpu";
    case DeviceKind::Gpu: return "gpu";
    case DeviceKind::Accelerator: return "accelerator";
    default: return "other";
  }
}

const char* kernel_shape_name(KernelShape s) {
  return s == KernelShape::Chunks ? "cpu" : "gpu";
}

namespace {

// hwloc's view of the machine, loaded once.
hwloc_topology_t topology() {
  static hwloc_topology_t topo = [] {
    hwloc_topology_t t;
    hwloc_topology_init(&t);
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    hwloc_topology_load(t);
    return t;
  }();
  return topo;
}

DeviceLocality locality_of_cpuset(hwloc_const_cpuset_t set) {
  DeviceLocality loc;
  hwloc_topology_t t = topology();
  loc.cores = hwloc_get_nbobjs_inside_cpuset_by_type(t, set, HWLOC_OBJ_CORE);
  int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, i);
    if (hwloc_bitmap_intersects(node->cpuset, set)) loc.numa_nodes.push_back(node->os_index);
  }
  return loc;
}

DeviceLocality query_locality(cl_device_id id, DeviceKind kind, const std::string& extensions) {
  hwloc_topology_t t = topology();
  if (kind == DeviceKind::Cpu) {
    return locality_of_cpuset(hwloc_topology_get_complete_cpuset(t));
  }
#ifdef CL_DEVICE_PCI_BUS_INFO_KHR
  if (extensions.find("cl_khr_pci_bus_info") != std::string::npos) {
    cl_device_pci_bus_info_khr bus{};
    if (clGetDeviceInfo(id, CL_DEVICE_PCI_BUS_INFO_KHR, sizeof bus, &bus, nullptr) == CL_SUCCESS) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", bus.pci_domain, bus.pci_bus,
                    bus.pci_device, bus.pci_function);
      hwloc_obj_t pci =
          hwloc_get_pcidev_by_busid(t, bus.pci_domain, bus.pci_bus, bus.pci_device,
                                    bus.pci_function);
      DeviceLocality loc;
      if (pci) {
        hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(t, pci);
        if (parent) loc = locality_of_cpuset(parent->cpuset);
      }
      loc.pci_bus = buf;
      return loc;
    }
  }
#endif
  return {};
}

struct HostRegion {
  void* base;
  size_t len;
};

void CL_CALLBACK unmap_host_region(cl_mem, void* user) {
  auto* r = static_cast<HostRegion*>(user);
  munmap(r->base, r->len);
  delete r;
}

}  // namespace

cl_mem create_buffer(cl_context ctx, cl_mem_flags flags, size_t bytes, bool host_huge_pages,
                     cl_int* err) {
  constexpr cl_mem_flags kHostFlags =
      CL_MEM_USE_HOST_PTR | CL_MEM_ALLOC_HOST_PTR | CL_MEM_COPY_HOST_PTR;
  if (!host_huge_pages || bytes < kHugePage || (flags & kHostFlags) != 0)
    return clCreateBuffer(ctx, flags, bytes ? bytes : 4, nullptr, err);
  // Whole 2 MiB pages on a 2 MiB boundary.
  const size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* base = reserve_huge_aligned(len, PROT_READ | PROT_WRITE);
  if (!base) return clCreateBuffer(ctx, flags, bytes, nullptr, err);
  madvise(base, len, MADV_HUGEPAGE);  // where the kernel has no huge pages, 4 KiB ones as before
  cl_mem m = clCreateBuffer(ctx, flags | CL_MEM_USE_HOST_PTR, bytes, base, err);
  if (!m) {
    munmap(base, len);
    return nullptr;
  }
  auto* region = new HostRegion{base, len};
  if (clSetMemObjectDestructorCallback(m, unmap_host_region, region) != CL_SUCCESS) {
    clReleaseMemObject(m);
    munmap(base, len);
    delete region;
    return clCreateBuffer(ctx, flags, bytes, nullptr, err);
  }
  return m;
}

bool single_work_item_groups(DeviceKind kind, KernelShape shape) {
  // Before this rule a GPU forced to the CPU shape launched linear_bf16_packed in groups its
  // driver chose: on the H200 every GEMM test that forced that shape and took the packed GEMM
  // got wrong sums.
  return kind == DeviceKind::Cpu || shape == KernelShape::Chunks;
}

bool pocl_cpu(const DeviceInfo& info) {
  return info.kind == DeviceKind::Cpu &&
         info.platform.find("Portable Computing Language") != std::string::npos;
}

DeviceInfo query_device_info(cl_device_id id, cl_platform_id platform) {
  DeviceInfo d;
  d.platform = cl::platform_string(platform, CL_PLATFORM_NAME);
  d.platform_version = cl::platform_string(platform, CL_PLATFORM_VERSION);
  d.name = cl::device_string(id, CL_DEVICE_NAME);
  d.vendor = cl::device_string(id, CL_DEVICE_VENDOR);
  d.driver_version = cl::device_string(id, CL_DRIVER_VERSION);
  d.opencl_version = cl::device_string(id, CL_DEVICE_VERSION);
  auto type = cl::device_value<cl_device_type>(id, CL_DEVICE_TYPE);
  d.kind = (type & CL_DEVICE_TYPE_GPU)           ? DeviceKind::Gpu
           : (type & CL_DEVICE_TYPE_CPU)         ? DeviceKind::Cpu
           : (type & CL_DEVICE_TYPE_ACCELERATOR) ? DeviceKind::Accelerator
                                                 : DeviceKind::Other;
  d.compute_units = cl::device_value<cl_uint>(id, CL_DEVICE_MAX_COMPUTE_UNITS);
  d.global_mem = cl::device_value<cl_ulong>(id, CL_DEVICE_GLOBAL_MEM_SIZE);
  d.max_alloc = cl::device_value<cl_ulong>(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
  d.local_mem = cl::device_value<cl_ulong>(id, CL_DEVICE_LOCAL_MEM_SIZE);
  d.host_unified_memory = cl::device_value<cl_bool>(id, CL_DEVICE_HOST_UNIFIED_MEMORY);
  std::string ext = cl::device_string(id, CL_DEVICE_EXTENSIONS);
  d.fp16 = ext.find("cl_khr_fp16") != std::string::npos;
  d.fp64 = ext.find("cl_khr_fp64") != std::string::npos;
  d.is_sub_device = cl::device_value<cl_device_id>(id, CL_DEVICE_PARENT_DEVICE) != nullptr;
  d.locality = query_locality(id, d.kind, ext);
  if (d.is_sub_device && d.kind == DeviceKind::Cpu) d.locality.cores = d.compute_units;
  return d;
}

size_t BufferPool::size_class(size_t bytes) {
  size_t c = 256;
  while (c < bytes) c <<= 1;
  return c;
}

cl::Mem BufferPool::take(size_t bytes) {
  const size_t c = size_class(bytes);
  {
    std::lock_guard lock(mu_);
    auto it = free_.find(c);
    if (it != free_.end()) {
      cl::Mem m = std::move(it->second);
      free_.erase(it);
      return m;
    }
  }
  cl_int err = CL_SUCCESS;
  cl::Mem m(create_buffer(ctx_, CL_MEM_READ_WRITE, c, host_huge_pages_, &err));
  cl::check(err, "allocating a " + std::to_string(c) + "-byte scratch buffer");
  std::lock_guard lock(mu_);
  held_ += c;
  return m;
}

void BufferPool::give_back(cl::Mem m, size_t bytes) {
  std::lock_guard lock(mu_);
  free_.emplace(size_class(bytes), std::move(m));
}

Device::Device(cl_platform_id platform, cl_device_id id, cl::Context ctx, int index)
    : id_(id), ctx_(std::move(ctx)), info_(query_device_info(id, platform)), index_(index) {
  cl_int err = CL_SUCCESS;
  cl_queue_properties props[] = {0};
  queue_ = cl::Queue(clCreateCommandQueueWithProperties(ctx_.get(), id_, props, &err));
  cl::check(err, "creating a command queue on " + info_.name);
  shape_ = info_.kind == DeviceKind::Cpu ? KernelShape::Chunks : KernelShape::WorkGroups;
  tuning_ = lookup_kernel_tuning(info_);
  pocl_cpu_ = pocl_cpu(info_);
  pool_ = std::make_unique<BufferPool>(ctx_.get(), pocl_cpu_);
  if (pocl_cpu_) PoclKernelOrder::instance().add(queue_.get());
}

Device::~Device() {
  if (pocl_cpu_) PoclKernelOrder::instance().remove(queue_.get());
}

std::string Device::label() const {
  return "device " + std::to_string(index_) + " (" + info_.name + " on " + info_.platform + ")";
}

cl::Kernel Device::kernel(const std::string& file, const std::string& name,
                          const std::string& options) {
  std::lock_guard lock(mu_);
  const std::string key = file + "\n" + options + "\n" + name;
  if (auto it = kernels_.find(key); it != kernels_.end()) return it->second;
  // The kernel holds its program (clCreateKernel retains it).
  const cl::Program program = build_program(ctx_.get(), id_, info_, file, name, options);
  if (pocl_cpu_) PoclKernelOrder::instance().name_program(program.get(), info_.name + "\n" + key);
  cl_int err = CL_SUCCESS;
  cl::Kernel k(clCreateKernel(program.get(), name.c_str(), &err));
  cl::check(err, "creating kernel " + name + " from kernels_cl/" + file);
  kernels_.emplace(key, k);
  return k;
}

cl::Mem Device::alloc(size_t bytes, cl_mem_flags flags) const {
  cl_int err = CL_SUCCESS;
  cl::Mem m(create_buffer(ctx_.get(), flags, bytes, pocl_cpu_, &err));
  cl::check(err, "allocating " + std::to_string(bytes) + " bytes on " + label());
  return m;
}

cl::Mem Device::wrap_host(const void* data, size_t bytes) const {
  cl_int err = CL_SUCCESS;
  cl_mem_flags flags = CL_MEM_READ_ONLY | (info_.host_unified_memory ? CL_MEM_USE_HOST_PTR
                                                                      : CL_MEM_COPY_HOST_PTR);
  cl::Mem m(clCreateBuffer(ctx_.get(), flags, bytes, const_cast<void*>(data), &err));
  cl::check(err, "creating a " + std::to_string(bytes) + "-byte weight buffer on " + label());
  return m;
}

void Device::write(const cl::Mem& m, const void* src, size_t bytes, size_t offset) const {
  if (bytes == 0) return;
  cl::check(clEnqueueWriteBuffer(queue_.get(), m.get(), CL_TRUE, offset, bytes, src, 0, nullptr,
                                 nullptr),
            "writing a buffer on " + label());
}

void Device::read(const cl::Mem& m, void* dst, size_t bytes, size_t offset) const {
  if (bytes == 0) return;
  cl::check(clEnqueueReadBuffer(queue_.get(), m.get(), CL_TRUE, offset, bytes, dst, 0, nullptr,
                                nullptr),
            "reading a buffer on " + label());
}

void Device::fill_zero(const cl::Mem& m, size_t bytes, size_t offset) const {
  if (bytes == 0) return;
  const cl_uchar zero = 0;
  cl::check(clEnqueueFillBuffer(queue_.get(), m.get(), &zero, 1, offset, bytes, 0, nullptr, nullptr),
            "zeroing a buffer on " + label());
}

void Device::flush() const { cl::check(clFlush(queue_.get()), "flushing " + label()); }

void Device::finish() const { cl::check(clFinish(queue_.get()), "waiting for " + label()); }

void Device::launch(const cl::Kernel& k, std::array<size_t, 3> global, int dims,
                    const size_t* local) const {
  for (int i = 0; i < dims; ++i)
    if (global[i] == 0) return;  // nothing to do
  enqueue(k, dims, global.data(), local, {}, nullptr, nullptr);
}

cl::Event Device::launch_after(const cl::Kernel& k, size_t global,
                               const std::vector<cl_event>& wait, const std::string& what) const {
  cl_event event = nullptr;
  enqueue(k, 1, &global, nullptr, wait, &event, what.c_str());
  return cl::Event(event);
}

void Device::enqueue(const cl::Kernel& k, int dims, const size_t* global, const size_t* local,
                     const std::vector<cl_event>& wait, cl_event* event, const char* what) const {
  static const size_t ones[3] = {1, 1, 1};
  const size_t* l = local ? local : (single_work_item_groups(info_.kind, shape_) ? ones : nullptr);
  const cl_int err = pocl_cpu_
                         ? PoclKernelOrder::instance().enqueue(queue_.get(), k.get(), cl_uint(dims),
                                                               global, l, wait, event)
                         : clEnqueueNDRangeKernel(queue_.get(), k.get(), cl_uint(dims), nullptr,
                                                  global, l, cl_uint(wait.size()),
                                                  wait.empty() ? nullptr : wait.data(), event);
  if (err != CL_SUCCESS) {
    char name[128] = {0};
    clGetKernelInfo(k.get(), CL_KERNEL_FUNCTION_NAME, sizeof name - 1, name, nullptr);
    throw cl::Error(err, (what ? std::string(what) + ": " : std::string()) + "launching kernel " +
                             name + " on " + label());
  }
}

WriteBatch::~WriteBatch() {
  if (!queued_) return;
  clFinish(dev_.queue());  // no throw here: the sources go next, whatever the status
}

void WriteBatch::write(const cl::Mem& m, const void* src, size_t bytes, size_t offset) {
  if (bytes == 0) return;
  cl::check(clEnqueueWriteBuffer(dev_.queue(), m.get(), CL_FALSE, offset, bytes, src, 0, nullptr,
                                 nullptr),
            "writing a buffer on " + dev_.label());
  queued_ = true;
}

void WriteBatch::wait() {
  if (!queued_) return;
  queued_ = false;
  dev_.finish();
}

}  // namespace clshard
