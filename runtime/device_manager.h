// The device manager: every OpenCL platform and device, the selection a deployment asks for, and
// CPU devices split into sub-devices. It opens devices; placing replicas and experts on them is
// parallel/'s work.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/device.h"

namespace clshard {

// How a deployment names its devices (the `devices:` section of the YAML).
struct DeviceSelection {
  std::string platform;       // substring of the platform name; empty: any
  std::string type = "any";   // cpu | gpu | accelerator | any
  std::vector<int> ids;       // indexes among the matching devices; empty: the first one
  bool all = false;           // every matching device
  // CPU split into sub-devices: "" (none), "cores" (one core each), "numa" (one per NUMA node), or
  // a number N (N equal sub-devices).
  std::string split;
  // The kernel shape of every opened device: nullopt (auto) keeps each device's own (Chunks on
  // CPUs, WorkGroups elsewhere); a value forces it, e.g. the GPU shape on PoCL for testing.
  std::optional<KernelShape> kernel_shape;
};

// One row of `clshard devices`.
struct DeviceListing {
  int platform_index;
  int device_index;  // within the platform
  DeviceInfo info;
};

std::vector<DeviceListing> list_devices();
std::string format_device_listing(const std::vector<DeviceListing>& rows);

class DeviceManager {
 public:
  // Opens the selected devices. Devices of one platform share one context, so buffers move
  // between them without copies where the driver allows. Throws with what was asked and what
  // exists when nothing matches.
  explicit DeviceManager(const DeviceSelection& sel);
  DeviceManager(const DeviceManager&) = delete;

  size_t size() const { return devices_.size(); }
  Device& operator[](size_t i) { return *devices_[i]; }
  std::vector<Device*> devices();

 private:
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<cl_device_id> sub_devices_;  // released with the manager
 public:
  ~DeviceManager();
};

}  // namespace clshard
