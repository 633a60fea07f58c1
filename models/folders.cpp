// Every models/ folder, one line each: its register_folder adds its families to the registry
// (models/registry.h). A new folder adds its line here.
#include "models/registry.h"

namespace clshard {

namespace llama3 { void register_folder(ModelRegistry& registry); }
namespace deepseek_v3 { void register_folder(ModelRegistry& registry); }
namespace deepseek_v3_nextn { void register_folder(ModelRegistry& registry); }
namespace eagle3_deepseek_v3 { void register_folder(ModelRegistry& registry); }

void register_model_folders(ModelRegistry& registry) {
  llama3::register_folder(registry);
  deepseek_v3::register_folder(registry);
  deepseek_v3_nextn::register_folder(registry);
  eagle3_deepseek_v3::register_folder(registry);
}

}  // namespace clshard
