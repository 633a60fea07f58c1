#include "runtime/device_manager.h"

#include <hwloc.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace clshard {

namespace {

std::vector<cl_platform_id> platforms() {
  cl_uint n = 0;
  cl_int err = clGetPlatformIDs(0, nullptr, &n);
  if (err == -1001 || n == 0) return {};  // no ICD installed or no platform
  cl::check(err, "listing OpenCL platforms");
  std::vector<cl_platform_id> p(n);
  cl::check(clGetPlatformIDs(n, p.data(), nullptr), "listing OpenCL platforms");
  return p;
}

std::vector<cl_device_id> platform_devices(cl_platform_id p) {
  cl_uint n = 0;
  cl_int err = clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
  if (err == CL_DEVICE_NOT_FOUND) return {};
  cl::check(err, "listing OpenCL devices");
  std::vector<cl_device_id> d(n);
  cl::check(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, d.data(), nullptr), "listing devices");
  return d;
}

bool type_matches(const std::string& want, DeviceKind k) {
  if (want.empty() || want == "any") return true;
  return want == device_kind_name(k);
}

std::string gib(uint64_t b) {
  std::ostringstream o;
  o.precision(1);
  o << std::fixed << double(b) / (1ull << 30) << " GiB";
  return o.str();
}

}  // namespace

std::vector<DeviceListing> list_devices() {
  std::vector<DeviceListing> rows;
  auto ps = platforms();
  for (size_t pi = 0; pi < ps.size(); ++pi) {
    auto ds = platform_devices(ps[pi]);
    for (size_t di = 0; di < ds.size(); ++di)
      rows.push_back({int(pi), int(di), query_device_info(ds[di], ps[pi])});
  }
  return rows;
}

std::string format_device_listing(const std::vector<DeviceListing>& rows) {
  std::ostringstream o;
  if (rows.empty()) {
    o << "No OpenCL devices found. Install a driver (scripts/setup.sh installs PoCL, the CPU "
         "driver) and check /etc/OpenCL/vendors.\n";
    return o.str();
  }
  for (const auto& r : rows) {
    const auto& d = r.info;
    o << "platform " << r.platform_index << " device " << r.device_index << ": " << d.name << "\n"
      << "  platform:       " << d.platform << " (" << d.platform_version << ")\n"
      << "  type:           " << device_kind_name(d.kind) << "\n"
      << "  vendor/driver:  " << d.vendor << " / " << d.driver_version << "\n"
      << "  compute units:  " << d.compute_units << "\n"
      << "  global memory:  " << gib(d.global_mem) << " (max allocation " << gib(d.max_alloc)
      << ")\n"
      << "  fp16 / fp64:    " << (d.fp16 ? "yes" : "no") << " / " << (d.fp64 ? "yes" : "no")
      << "\n"
      << "  host memory:    " << (d.host_unified_memory ? "shared (zero-copy weights)" : "separate")
      << "\n"
      << "  locality:       NUMA node(s) ";
    if (d.locality.numa_nodes.empty()) o << "unknown";
    for (size_t i = 0; i < d.locality.numa_nodes.size(); ++i)
      o << (i ? "," : "") << d.locality.numa_nodes[i];
    o << ", " << d.locality.cores << " core(s)";
    if (!d.locality.pci_bus.empty()) o << ", PCI " << d.locality.pci_bus;
    o << "\n";
  }
  return o.str();
}

DeviceManager::DeviceManager(const DeviceSelection& sel) {
  struct Match {
    cl_platform_id platform;
    cl_device_id device;
  };
  std::vector<Match> matches;
  std::ostringstream seen;
  for (cl_platform_id p : platforms()) {
    std::string pname = cl::platform_string(p, CL_PLATFORM_NAME);
    for (cl_device_id d : platform_devices(p)) {
      DeviceInfo info = query_device_info(d, p);
      seen << "\n  " << pname << ": " << info.name << " (" << device_kind_name(info.kind) << ")";
      if (!sel.platform.empty() && pname.find(sel.platform) == std::string::npos) continue;
      if (!type_matches(sel.type, info.kind)) continue;
      matches.push_back({p, d});
    }
  }
  std::vector<Match> chosen;
  if (sel.all) {
    chosen = matches;
  } else if (sel.ids.empty()) {
    if (!matches.empty()) chosen.push_back(matches[0]);
  } else {
    for (int id : sel.ids) {
      if (id < 0 || size_t(id) >= matches.size())
        throw std::runtime_error("devices: id " + std::to_string(id) + " asked for, but " +
                                 std::to_string(matches.size()) + " device(s) match platform '" +
                                 sel.platform + "' type '" + sel.type + "'. Devices here:" +
                                 seen.str());
      chosen.push_back(matches[id]);
    }
  }
  if (chosen.empty())
    throw std::runtime_error("devices: nothing matches platform '" + sel.platform + "' type '" +
                             sel.type + "'. Devices here:" +
                             (seen.str().empty() ? std::string(" none") : seen.str()));

  // Split CPU devices into sub-devices where asked.
  std::vector<Match> final_list;
  for (const Match& m : chosen) {
    auto kind = cl::device_value<cl_device_type>(m.device, CL_DEVICE_TYPE);
    if (sel.split.empty() || !(kind & CL_DEVICE_TYPE_CPU)) {
      final_list.push_back(m);
      continue;
    }
    cl_uint cus = cl::device_value<cl_uint>(m.device, CL_DEVICE_MAX_COMPUTE_UNITS);
    std::vector<cl_device_partition_property> props;
    if (sel.split == "cores") {
      props = {CL_DEVICE_PARTITION_EQUALLY, 1, 0};
    } else if (sel.split == "numa") {
      props = {CL_DEVICE_PARTITION_BY_AFFINITY_DOMAIN, CL_DEVICE_AFFINITY_DOMAIN_NUMA, 0};
    } else {
      int n = 0;
      try {
        n = std::stoi(sel.split);
      } catch (...) {
        throw std::runtime_error("devices.split: expected cores, numa or a number, got '" +
                                 sel.split + "'");
      }
      if (n < 1) throw std::runtime_error("devices.split: must be at least 1");
      // N sub-devices: compute units spread as evenly as possible (at least one each).
      props.push_back(CL_DEVICE_PARTITION_BY_COUNTS);
      for (int i = 0; i < n; ++i)
        props.push_back(std::max<cl_uint>(1, cus / n + (cl_uint(i) < cus % n ? 1 : 0)));
      props.push_back(CL_DEVICE_PARTITION_BY_COUNTS_LIST_END);
      props.push_back(0);
    }
    cl_uint count = 0;
    const cl_int err = clCreateSubDevices(m.device, props.data(), 0, nullptr, &count);
    if (err == CL_INVALID_DEVICE_PARTITION_COUNT || err == CL_DEVICE_PARTITION_FAILED)
      throw std::runtime_error(
          "devices.split: '" + sel.split + "' asks for more sub-devices than the CPU device has "
          "compute units (" + std::to_string(cus) + "); each sub-device needs one. On PoCL, "
          "POCL_MAX_PTHREAD_COUNT raises the count.");
    cl::check(err, "splitting a CPU device (split: " + sel.split + ")");
    std::vector<cl_device_id> subs(count);
    cl::check(clCreateSubDevices(m.device, props.data(), count, subs.data(), nullptr),
              "splitting a CPU device (split: " + sel.split + ")");
    for (cl_device_id s : subs) {
      sub_devices_.push_back(s);
      final_list.push_back({m.platform, s});
    }
  }

  // One context per platform holding all of that platform's chosen devices.
  std::vector<cl_platform_id> plats;
  for (const Match& m : final_list)
    if (std::find(plats.begin(), plats.end(), m.platform) == plats.end())
      plats.push_back(m.platform);
  std::vector<cl::Context> contexts;
  for (cl_platform_id p : plats) {
    std::vector<cl_device_id> ds;
    for (const Match& m : final_list)
      if (m.platform == p) ds.push_back(m.device);
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, cl_context_properties(p), 0};
    cl_int err = CL_SUCCESS;
    contexts.emplace_back(clCreateContext(props, cl_uint(ds.size()), ds.data(), nullptr, nullptr,
                                          &err));
    cl::check(err, "creating an OpenCL context");
  }
  for (const Match& m : final_list) {
    size_t pi = std::find(plats.begin(), plats.end(), m.platform) - plats.begin();
    devices_.push_back(
        std::make_unique<Device>(m.platform, m.device, contexts[pi], int(devices_.size())));
    if (sel.kernel_shape) devices_.back()->set_kernel_shape(*sel.kernel_shape);
  }
}

DeviceManager::~DeviceManager() {
  devices_.clear();
  for (cl_device_id s : sub_devices_) clReleaseDevice(s);
}

std::vector<Device*> DeviceManager::devices() {
  std::vector<Device*> out;
  for (auto& d : devices_) out.push_back(d.get());
  return out;
}

}  // namespace clshard
