# CPU kernels are compiled once per instruction set into namespaces kog::cpu::<isa> and the
# best one the running CPU supports is chosen at import (csrc/cpu/dispatch.cpp). A wheel thus
# never depends on the build machine's CPU.
#   generic  baseline of the target (x86-64: SSE2)
#   avx2     x86-64-v3: AVX2 + FMA + F16C
#   avx512   x86-64-v4 + AVX512-BF16 + AVX512-VNNI (every CPU with AVX512-BF16 has VNNI:
#            Cooper Lake, Sapphire Rapids and later, Zen 4 and later)
# NOTE: kernel sources must not call inline functions or templates shared with other TUs
# (std::max, std::sqrt, ...): the linker keeps one COMDAT copy, possibly the AVX-512 one, and
# a generic caller would then fault on an older CPU. csrc/cpu/vec.h gives ISA-local helpers.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(KOG_CPU_ISAS generic avx2 avx512)
else()
  set(KOG_CPU_ISAS generic)
endif()
set(KOG_CPU_ISA_FLAGS_generic "")
set(KOG_CPU_ISA_FLAGS_avx2 -mavx2 -mfma -mf16c -mbmi2)
set(KOG_CPU_ISA_FLAGS_avx512 -mavx2 -mfma -mf16c -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni)

function(kog_add_cpu_kernels target sources)
  set(defs "")
  foreach(isa IN LISTS KOG_CPU_ISAS)
    add_library(kog_cpu_${isa} OBJECT ${sources})
    target_include_directories(kog_cpu_${isa} PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
    target_compile_definitions(kog_cpu_${isa} PRIVATE KOG_ISA_NS=${isa})
    # -fno-math-errno / -fno-trapping-math: no kernel reads errno or FP exception flags, and
    # without them GCC keeps FP selects as branches (a trap could differ), so loops over
    # fast_exp or the bf16 rounding stay scalar. Values are unchanged (no reassociation).
    target_compile_options(kog_cpu_${isa} PRIVATE -O3 -fno-math-errno -fno-trapping-math -fopenmp-simd ${KOG_CPU_ISA_FLAGS_${isa}})
    target_link_libraries(kog_cpu_${isa} PRIVATE Threads::Threads pybind11::headers)
    target_link_libraries(${target} PRIVATE kog_cpu_${isa})
    string(TOUPPER ${isa} up)
    list(APPEND defs KOG_HAVE_ISA_${up}=1)
  endforeach()
  target_compile_definitions(${target} PRIVATE ${defs})
endfunction()
