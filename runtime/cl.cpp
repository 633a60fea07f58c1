#include "runtime/cl.h"

namespace clshard::cl {

const char* error_name(cl_int code) {
  switch (code) {
#define CASE(x) \
  case x:       \
    return #x;
    CASE(CL_SUCCESS)
    CASE(CL_DEVICE_NOT_FOUND)
    CASE(CL_DEVICE_NOT_AVAILABLE)
    CASE(CL_COMPILER_NOT_AVAILABLE)
    CASE(CL_MEM_OBJECT_ALLOCATION_FAILURE)
    CASE(CL_OUT_OF_RESOURCES)
    CASE(CL_OUT_OF_HOST_MEMORY)
    CASE(CL_PROFILING_INFO_NOT_AVAILABLE)
    CASE(CL_MEM_COPY_OVERLAP)
    CASE(CL_IMAGE_FORMAT_MISMATCH)
    CASE(CL_IMAGE_FORMAT_NOT_SUPPORTED)
    CASE(CL_BUILD_PROGRAM_FAILURE)
    CASE(CL_MAP_FAILURE)
    CASE(CL_MISALIGNED_SUB_BUFFER_OFFSET)
    CASE(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
    CASE(CL_COMPILE_PROGRAM_FAILURE)
    CASE(CL_LINKER_NOT_AVAILABLE)
    CASE(CL_LINK_PROGRAM_FAILURE)
    CASE(CL_DEVICE_PARTITION_FAILED)
    CASE(CL_KERNEL_ARG_INFO_NOT_AVAILABLE)
    CASE(CL_INVALID_VALUE)
    CASE(CL_INVALID_DEVICE_TYPE)
    CASE(CL_INVALID_PLATFORM)
    CASE(CL_INVALID_DEVICE)
    CASE(CL_INVALID_CONTEXT)
    CASE(CL_INVALID_QUEUE_PROPERTIES)
    CASE(CL_INVALID_COMMAND_QUEUE)
    CASE(CL_INVALID_HOST_PTR)
    CASE(CL_INVALID_MEM_OBJECT)
    CASE(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
    CASE(CL_INVALID_IMAGE_SIZE)
    CASE(CL_INVALID_SAMPLER)
    CASE(CL_INVALID_BINARY)
    CASE(CL_INVALID_BUILD_OPTIONS)
    CASE(CL_INVALID_PROGRAM)
    CASE(CL_INVALID_PROGRAM_EXECUTABLE)
    CASE(CL_INVALID_KERNEL_NAME)
    CASE(CL_INVALID_KERNEL_DEFINITION)
    CASE(CL_INVALID_KERNEL)
    CASE(CL_INVALID_ARG_INDEX)
    CASE(CL_INVALID_ARG_VALUE)
    CASE(CL_INVALID_ARG_SIZE)
    CASE(CL_INVALID_KERNEL_ARGS)
    CASE(CL_INVALID_WORK_DIMENSION)
    CASE(CL_INVALID_WORK_GROUP_SIZE)
    CASE(CL_INVALID_WORK_ITEM_SIZE)
    CASE(CL_INVALID_GLOBAL_OFFSET)
    CASE(CL_INVALID_EVENT_WAIT_LIST)
    CASE(CL_INVALID_EVENT)
    CASE(CL_INVALID_OPERATION)
    CASE(CL_INVALID_GL_OBJECT)
    CASE(CL_INVALID_BUFFER_SIZE)
    CASE(CL_INVALID_MIP_LEVEL)
    CASE(CL_INVALID_GLOBAL_WORK_SIZE)
    CASE(CL_INVALID_PROPERTY)
    CASE(CL_INVALID_IMAGE_DESCRIPTOR)
    CASE(CL_INVALID_COMPILER_OPTIONS)
    CASE(CL_INVALID_LINKER_OPTIONS)
    CASE(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef CASE
    case -1001:
      return "CL_PLATFORM_NOT_FOUND_KHR (no OpenCL driver installed: run scripts/setup.sh)";
    default:
      return "unknown OpenCL error";
  }
}

Error::Error(cl_int code, const std::string& what_was_done)
    : std::runtime_error("OpenCL error " + std::string(error_name(code)) + " (" +
                         std::to_string(code) + ") while " + what_was_done),
      code_(code) {}

std::string device_string(cl_device_id d, cl_device_info what) {
  size_t n = 0;
  check(clGetDeviceInfo(d, what, 0, nullptr, &n), "clGetDeviceInfo(size)");
  std::string s(n, '\0');
  check(clGetDeviceInfo(d, what, n, s.data(), nullptr), "clGetDeviceInfo");
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::string platform_string(cl_platform_id p, cl_platform_info what) {
  size_t n = 0;
  check(clGetPlatformInfo(p, what, 0, nullptr, &n), "clGetPlatformInfo(size)");
  std::string s(n, '\0');
  check(clGetPlatformInfo(p, what, n, s.data(), nullptr), "clGetPlatformInfo");
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

}  // namespace clshard::cl
