#!/usr/bin/env bash
# Installs every Debian package clshard needs to build, test and benchmark.
# Safe to run twice: apt-get install skips what is already there.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  ocl-icd-opencl-dev opencl-headers opencl-c-headers opencl-clhpp-headers
  pocl-opencl-icd clinfo
  libclblast-dev
  libhwloc-dev
  libyaml-cpp-dev
  nlohmann-json3-dev
  libpcre2-dev
  libcli11-dev
  libgtest-dev libgmock-dev
  libbenchmark-dev
  libopenblas-dev
  openmpi-bin libopenmpi-dev
  libcpp-httplib-dev curl
  clang libfuzzer-14-dev
  gnuplot-nox python3-yaml
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm for the server's client tests (tests/server/): Debian's, unless an npm is
# already there (a Node from elsewhere is kept as it is).
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
else
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: installed ${missing[*]}"
fi
# The official openai client the server tests use, at the version package-lock.json pins.
server_tests="$(dirname "$0")/../tests/server"
if [ ! -d "$server_tests/node_modules/openai" ]; then
  (cd "$server_tests" && npm ci --no-audit --no-fund --loglevel=error)
  echo "setup: installed the openai npm package into tests/server/node_modules"
fi
