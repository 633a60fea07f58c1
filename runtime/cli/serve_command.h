// `clshard serve deploy.yaml`: the OpenAI-compatible server (runtime/serve/) until SIGINT/SIGTERM.
#pragma once

namespace CLI {
class App;
}

namespace clshard::cli {
void add_serve_command(CLI::App& app);
}  // namespace clshard::cli
