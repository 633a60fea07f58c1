# Writes OUT (a header defining CLSHARD_GIT_COMMIT: the source tree's commit, "-dirty" when tracked
# files differ from it, "" outside a git checkout) when its content changes, so `clshard bench`
# records what it was built from. Runs at every build:
#   cmake -DSOURCE_DIR=<repository root> -DOUT=<header> -P cmake/git_commit.cmake
cmake_minimum_required(VERSION 3.25)
set(commit "")
find_program(GIT git)
if(GIT)
  execute_process(COMMAND ${GIT} -C ${SOURCE_DIR} rev-parse HEAD
    OUTPUT_VARIABLE head OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND head)
    set(commit ${head})
    execute_process(COMMAND ${GIT} -C ${SOURCE_DIR} status --porcelain --untracked-files=no
      OUTPUT_VARIABLE changes ERROR_QUIET)
    if(changes)
      string(APPEND commit "-dirty")
    endif()
  endif()
endif()
set(content "#define CLSHARD_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL content)
  file(WRITE ${OUT} "${content}")
endif()
