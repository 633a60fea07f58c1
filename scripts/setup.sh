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
  libcpp-httplib-dev
  clang libfuzzer-14-dev
  gnuplot-nox python3-yaml
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: installed ${missing[*]}"
