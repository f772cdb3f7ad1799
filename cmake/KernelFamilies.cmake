# The CPU kernel families: one source (gemm/cpu/simd_kernels.inc)
# compiled once per family with that family's instructions; which one runs is
# decided at run time (base/cpu_isa.h). Nothing else in the build uses
# target flags, so the binary runs on any x86-64. Used by the main build
# (base) and by the fuzz project (tests/fuzz), which must compile the
# same files with the same flags.
#
# mlarun_kernel_family_sources(<out-var> <gemm/cpu directory>) sets
# <out-var> to the family sources and their per-file compile options (source
# properties are per directory, so each caller sets them for itself).
# GCC 12 warns of uninitialized values inside its own AVX-512 intrinsic
# headers: a known false positive, silenced for those files.
function(mlarun_kernel_family_sources out dir)
  set(avx2 -mavx2 -mfma -mf16c)
  set(avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq ${avx2})
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    list(APPEND avx512 -Wno-maybe-uninitialized -Wno-uninitialized)
  endif()
  set_source_files_properties(${dir}/kernels_avx2.cc PROPERTIES COMPILE_OPTIONS "${avx2}")
  set_source_files_properties(${dir}/kernels_avx512.cc PROPERTIES COMPILE_OPTIONS "${avx512}")
  set_source_files_properties(${dir}/kernels_amx.cc PROPERTIES
                              COMPILE_OPTIONS "${avx512};-mavx512bf16;-mamx-tile;-mamx-bf16")
  set(${out} ${dir}/kernels.cc ${dir}/kernels_scalar.cc ${dir}/kernels_avx2.cc ${dir}/kernels_avx512.cc
      ${dir}/kernels_amx.cc PARENT_SCOPE)
endfunction()
