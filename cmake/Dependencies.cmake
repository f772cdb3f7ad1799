# Third-party libraries, from Debian packages but xgrammar (scripts/install-deps).
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json 3 CONFIG REQUIRED)
find_package(yaml-cpp CONFIG REQUIRED)  # target: yaml-cpp (no namespace in 0.7)

# oneDNN: Debian's dnnl CMake config requires the OpenCL ICD package because the
# library was built with OpenCL; the plain library and headers work without it.
find_path(DNNL_INCLUDE_DIR NAMES oneapi/dnnl/dnnl.hpp REQUIRED)
find_library(DNNL_LIBRARY NAMES dnnl REQUIRED)
add_library(mlarun_dnnl INTERFACE)
target_include_directories(mlarun_dnnl SYSTEM INTERFACE ${DNNL_INCLUDE_DIR})
target_link_libraries(mlarun_dnnl INTERFACE ${DNNL_LIBRARY})

if(MLARUN_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
endif()
find_package(benchmark CONFIG REQUIRED)

# Open MPI: ranks under mpirun. MPIEXEC_EXECUTABLE runs the multi-rank tests.
find_package(MPI REQUIRED COMPONENTS CXX)

# UCX (libucx-dev, which Open MPI uses too): the transfer plane of latent
# blocks (transfer/). Debian ships no CMake config, only pkg-config's.
find_package(PkgConfig REQUIRED)
pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)

# gRPC and Protobuf: the coordinator service. Protobuf has no CMake config on
# Debian ("Could NOT find c-ares" from gRPC's config is harmless).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)

# xgrammar (structured output's token masks): no Debian package, so
# scripts/install-deps builds its sdist into /opt/xgrammar as a static
# library. Only runtime/grammar links it. Without it (the sdist could not be
# fetched) everything builds and structured output is refused with the
# reason (runtime/grammar/grammar_unavailable.cc).
option(MLARUN_WITH_XGRAMMAR "Structured output with xgrammar (when found)" ON)
set(MLARUN_HAVE_XGRAMMAR OFF)
if(MLARUN_WITH_XGRAMMAR)
  find_path(XGRAMMAR_INCLUDE_DIR NAMES xgrammar/xgrammar.h HINTS /opt/xgrammar/include)
  find_library(XGRAMMAR_LIBRARY NAMES libxgrammar.a xgrammar HINTS /opt/xgrammar/lib /opt/xgrammar/lib64)
  if(XGRAMMAR_INCLUDE_DIR AND XGRAMMAR_LIBRARY)
    set(MLARUN_HAVE_XGRAMMAR ON)
    add_library(mlarun_xgrammar INTERFACE)
    target_include_directories(mlarun_xgrammar SYSTEM INTERFACE ${XGRAMMAR_INCLUDE_DIR})
    target_link_libraries(mlarun_xgrammar INTERFACE ${XGRAMMAR_LIBRARY})
  else()
    message(WARNING "xgrammar not found in /opt/xgrammar (scripts/install-deps builds it): "
                    "structured output will be refused")
  endif()
endif()
