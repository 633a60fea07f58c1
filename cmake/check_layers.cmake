# The include-level twin of the library layers in CMakeLists.txt: fails, listing every offence, when a
# source file includes a project header of a layer above its own (runtime/ reaching into parallel/
# or models/, parallel/ into models/, anything below the engine into runtime/engine/ ...).
#   cmake -DSOURCE_DIR=<repository root> -P cmake/check_layers.cmake
# The layers, lowest first, and what each may include:
#   device    runtime/*            device
#   text      runtime/text/        device text
#   parallel  parallel/            device parallel
#   models    models/              device text parallel models
#   engine    runtime/engine/      device text parallel models engine
#   serve     runtime/serve/       device text parallel models engine serve
#   cli       runtime/cli/         everything
cmake_minimum_required(VERSION 3.25)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layers: give -DSOURCE_DIR=<repository root>")
endif()

set(allowed_device device)
set(allowed_text device text)
set(allowed_parallel device parallel)
set(allowed_models device text parallel models)
set(allowed_engine device text parallel models engine)
set(allowed_serve device text parallel models engine serve)
set(allowed_cli device text parallel models engine serve cli)

# The layer of a path relative to the repository root, or "" for a path outside the layers.
function(layer_of path out)
  if(path MATCHES "^runtime/text/")
    set(${out} text PARENT_SCOPE)
  elseif(path MATCHES "^runtime/engine/")
    set(${out} engine PARENT_SCOPE)
  elseif(path MATCHES "^runtime/serve/")
    set(${out} serve PARENT_SCOPE)
  elseif(path MATCHES "^runtime/cli/")
    set(${out} cli PARENT_SCOPE)
  elseif(path MATCHES "^runtime/[^/]+$")
    set(${out} device PARENT_SCOPE)
  elseif(path MATCHES "^parallel/")
    set(${out} parallel PARENT_SCOPE)
  elseif(path MATCHES "^models/")
    set(${out} models PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

file(GLOB_RECURSE sources RELATIVE ${SOURCE_DIR}
  ${SOURCE_DIR}/runtime/*.h ${SOURCE_DIR}/runtime/*.cpp
  ${SOURCE_DIR}/parallel/*.h ${SOURCE_DIR}/parallel/*.cpp
  ${SOURCE_DIR}/models/*.h ${SOURCE_DIR}/models/*.cpp)
set(offences "")
set(checked 0)
foreach(src IN LISTS sources)
  layer_of(${src} from)
  if(from STREQUAL "")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  file(STRINGS ${SOURCE_DIR}/${src} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" header "${line}")
    layer_of(${header} to)
    if(to STREQUAL "")
      continue()  # not a header of the layers (generated files, system headers in quotes)
    endif()
    if(NOT to IN_LIST allowed_${from})
      string(APPEND offences "\n  ${src} (${from}) includes ${header} (${to})")
    endif()
  endforeach()
endforeach()

if(offences)
  message(FATAL_ERROR "check_layers: includes against the layers:${offences}")
endif()
message(STATUS "check_layers: ${checked} files, every include points down")
