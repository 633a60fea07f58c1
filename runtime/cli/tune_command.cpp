// `clshard tune`: times the candidate values of the per-device tuning fields on the present
// device(s) (runtime/kernel_tune.h) and writes each device's entry to tuning.json beside the
// kernel cache (runtime/kernel_tuning.h), which every later run on that device reads.
#include "runtime/cli/tune_command.h"

#include <cstdio>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/kernel_tune.h"
#include "runtime/kernel_tuning.h"

namespace clshard::cli {

namespace {

struct TuneFlags {
  std::string device_type = "any";
  std::string platform;
  int device = -1;
  std::string kernel_shape = "auto";
  std::string fields;
  bool quick = false;
  bool dry_run = false;
};

std::vector<std::string> split_fields(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

void run_tune(const TuneFlags& f) {
  DeviceSelection sel;
  sel.platform = f.platform;
  sel.type = f.device_type;
  if (f.device >= 0) sel.ids = {f.device};
  else sel.all = true;
  if (f.kernel_shape == "cpu") sel.kernel_shape = KernelShape::Chunks;
  else if (f.kernel_shape == "gpu") sel.kernel_shape = KernelShape::WorkGroups;
  else if (f.kernel_shape != "auto")
    throw std::invalid_argument("--kernel-shape: expected auto, cpu or gpu, got '" +
                                f.kernel_shape + "'");
  TuneOptions opt;
  opt.fields = split_fields(f.fields);
  opt.quick = f.quick;
  DeviceManager mgr(sel);
  std::set<std::pair<std::string, std::string>> done;  // (vendor, name): one entry each
  for (size_t i = 0; i < mgr.size(); ++i) {
    Device& dev = mgr[i];
    if (!done.insert({dev.info().vendor, dev.info().name}).second) {
      std::printf("%s: same vendor and name as a device tuned above, skipped\n",
                  dev.label().c_str());
      continue;
    }
    std::printf("%s\n", dev.label().c_str());
    std::fflush(stdout);
    const TuneResult r = tune_kernel_fields(dev, opt, stdout);
    std::string chosen;
    for (const TunedField& t : r.fields)
      chosen += (chosen.empty() ? "" : ", ") + t.field + " " + std::to_string(t.chosen);
    std::printf("chosen: %s\n", chosen.c_str());
    if (f.dry_run) {
      std::printf("--dry-run: %s not written\n", kernel_tuning_file().c_str());
    } else {
      save_kernel_tuning(dev.info(), r.tuning);
      std::printf("wrote the entry of \"%s\" / \"%s\" to %s\n", dev.info().vendor.c_str(),
                  dev.info().name.c_str(), kernel_tuning_file().c_str());
    }
    std::fflush(stdout);
  }
}

}  // namespace

void add_tune_command(CLI::App& app) {
  auto* tu = app.add_subcommand(
      "tune", "Time the candidate values of the per-device kernel tuning fields and write the "
              "device's entry to tuning.json in the kernel cache directory");
  auto f = std::make_shared<TuneFlags>();
  tu->add_option("--device-type", f->device_type, "cpu | gpu | accelerator | any")
      ->capture_default_str();
  tu->add_option("--platform", f->platform, "substring of the OpenCL platform name");
  tu->add_option("--device", f->device,
                 "index among the matching devices (default: every matching device)");
  tu->add_option("--kernel-shape", f->kernel_shape,
                 "auto | cpu | gpu: the shape whose fields are tuned (auto: the device's own; "
                 "gpu on a CPU driver tunes the forced GPU shape)")
      ->capture_default_str();
  tu->add_option("--fields", f->fields, "comma-separated fields (default: every tunable field "
                                        "of the shape)");
  tu->add_flag("--quick", f->quick, "smaller shapes and fewer timed runs");
  tu->add_flag("--dry-run", f->dry_run, "print the choices, write nothing");
  tu->callback([f] { run_tune(*f); });
}

}  // namespace clshard::cli
