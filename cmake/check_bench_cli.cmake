# The command line of one perf/ benchmark (parsed by CLI11, perf/bench_util.h's parse_args), run
# in an empty working directory so that nothing the benchmark would write goes unnoticed:
#   * `NAME --help` exits 0, prints the usage line "Usage: NAME ..." (once, under mpirun too) and
#     leaves the directory empty (no checkpoint written into a folder named --help, no benchmark);
#   * `NAME --no-such-option` exits 2 (non-zero under mpirun) with a message naming the option;
#   * with BAD_OPTION, `NAME BAD_OPTION not-a-number` exits the same way, naming option and value.
#   cmake -DEXE=<program> -DNAME=<name> -DWORK_DIR=<scratch dir> [-DBAD_OPTION=--reps]
#         [-DLAUNCHER=<mpirun> -DLAUNCHER_ARGS=<args separated by |>] -P cmake/check_bench_cli.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var EXE NAME WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "check_bench_cli: give -D${var}=...")
  endif()
endforeach()
set(launch)
if(LAUNCHER)
  string(REPLACE "|" ";" launcher_args "${LAUNCHER_ARGS}")
  set(launch ${LAUNCHER} ${launcher_args})
endif()

set(failures)
# Runs the program with `args` in a fresh, empty WORK_DIR; sets rc and out (stdout and stderr).
function(run_bench)
  file(REMOVE_RECURSE "${WORK_DIR}")
  file(MAKE_DIRECTORY "${WORK_DIR}")
  execute_process(COMMAND ${launch} "${EXE}" ${ARGN}
    WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE code OUTPUT_VARIABLE o ERROR_VARIABLE e
    TIMEOUT 60)
  file(GLOB_RECURSE written LIST_DIRECTORIES true "${WORK_DIR}/*")
  if(written)
    string(JOIN " " command_line ${ARGN})
    string(JOIN ", " written ${written})
    list(APPEND failures "${NAME} ${command_line}: wrote into its working directory: ${written}")
  endif()
  set(rc "${code}" PARENT_SCOPE)
  set(out "${o}${e}" PARENT_SCOPE)
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

# An error exit: 2 when run directly; under mpirun the launcher's own non-zero status.
function(expect_usage_error what)
  if(LAUNCHER)
    if(rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$")
      list(APPEND failures "${what}: expected a non-zero exit status, got '${rc}'")
    endif()
  elseif(NOT rc EQUAL 2)
    list(APPEND failures "${what}: expected exit status 2, got '${rc}'")
  endif()
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

run_bench(--help)
if(NOT rc EQUAL 0)
  list(APPEND failures "${NAME} --help: expected exit status 0, got '${rc}'")
endif()
string(REGEX MATCHALL "Usage: ${NAME} " usage_lines "${out}")
list(LENGTH usage_lines n_usage)
if(NOT n_usage EQUAL 1)
  list(APPEND failures "${NAME} --help: expected one line 'Usage: ${NAME} ...', found ${n_usage}")
endif()
set(help_out "${out}")

run_bench(--no-such-option)
expect_usage_error("${NAME} --no-such-option")
if(NOT out MATCHES "--no-such-option")
  list(APPEND failures "${NAME} --no-such-option: the message does not name the option")
endif()
set(unknown_out "${out}")

if(BAD_OPTION)
  run_bench(${BAD_OPTION} not-a-number)
  expect_usage_error("${NAME} ${BAD_OPTION} not-a-number")
  if(NOT out MATCHES "not-a-number" OR NOT out MATCHES "${BAD_OPTION}")
    list(APPEND failures
         "${NAME} ${BAD_OPTION} not-a-number: the message does not name the option and the value")
  endif()
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
if(failures)
  string(REPLACE ";" "\n  " lines "${failures}")
  message(FATAL_ERROR "check_bench_cli:\n  ${lines}\n--help printed:\n${help_out}\n"
                      "--no-such-option printed:\n${unknown_out}")
endif()
message(STATUS "${NAME}: --help exits 0 with its usage line; a bad command line exits with a "
               "usage error; nothing written")
