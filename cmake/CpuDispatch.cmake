# The CPU kernels compiled twice, the copy picked at run time (FASTAXIAL_CPU_DISPATCH; docs/install.md,
# "The CPU kernels' instruction sets").
#
# fastaxial_cpu_dispatch_supported(out): whether this toolchain can: an x86-64 target, a compiler
# that takes -mavx2 -mfma and __builtin_cpu_supports, and GNU ld (-r --force-group-allocation), objcopy
# and nm beside it.
#
# fastaxial_cpu_copies(target SOURCES...): SOURCES (src/cpu's kernel files, the ones that use
# Eigen) leave `target` and are compiled twice, in object libraries <target>_cpu_baseline (the
# target's flags: any x86-64) and <target>_cpu_avx2 (-mavx2 -mfma), each with
# FASTAXIAL_CPU_COPY=<copy> (their code in namespace fastaxial::cpu::<copy>, src/cpu/cpu_common.h)
# and hidden visibility. Each copy's objects are then linked into one object and every symbol it
# defines made local but its entry points (cmake/cpu_copy_link.cmake), and both objects go into
# `target`, where src/cpu/dispatch.cpp (compiled with FASTAXIAL_CPU_DISPATCH) calls one of them.
set(FASTAXIAL_CPU_COPY_LINK_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/cpu_copy_link.cmake)
set(FASTAXIAL_CPU_AVX2_FLAGS -mavx2 -mfma)

function(fastaxial_cpu_dispatch_supported out)
  set(why "")
  if(NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
    set(why "not an x86-64 target (${CMAKE_SYSTEM_PROCESSOR})")
  elseif(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    set(why "compiler ${CMAKE_CXX_COMPILER_ID}, not GCC or Clang")
  elseif(NOT CMAKE_LINKER OR NOT CMAKE_OBJCOPY OR NOT CMAKE_NM)
    set(why "no ld, objcopy or nm found")
  else()
    include(CheckCXXCompilerFlag)
    check_cxx_compiler_flag("-mavx2 -mfma" FASTAXIAL_HAS_MAVX2_MFMA)
    execute_process(COMMAND ${CMAKE_LINKER} --help OUTPUT_VARIABLE ld_help ERROR_QUIET)
    if(NOT FASTAXIAL_HAS_MAVX2_MFMA)
      set(why "${CMAKE_CXX_COMPILER} does not take -mavx2 -mfma")
    elseif(NOT ld_help MATCHES "--force-group-allocation")
      set(why "${CMAKE_LINKER} has no --force-group-allocation (GNU binutils 2.30 or later has)")
    endif()
  endif()
  if(why)
    set(${out} OFF PARENT_SCOPE)
  else()
    set(${out} ON PARENT_SCOPE)
  endif()
  set(${out}_why "${why}" PARENT_SCOPE)
endfunction()

function(fastaxial_cpu_copies target)
  set(sources ${ARGN})
  get_target_property(all_sources ${target} SOURCES)
  list(REMOVE_ITEM all_sources ${sources})
  set_property(TARGET ${target} PROPERTY SOURCES ${all_sources})
  set(objects "")
  foreach(copy baseline avx2)
    set(lib ${target}_cpu_${copy})
    add_library(${lib} OBJECT ${sources})
    set_target_properties(${lib} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_compile_features(${lib} PRIVATE cxx_std_17)
    # The target's own settings (include paths, definitions, warnings, OpenMP), its private
    # dependencies' (Eigen, Random123), then the copy's.
    target_include_directories(${lib} PRIVATE $<TARGET_PROPERTY:${target},INCLUDE_DIRECTORIES>)
    target_compile_definitions(${lib} PRIVATE $<TARGET_PROPERTY:${target},COMPILE_DEFINITIONS>
                                              FASTAXIAL_CPU_COPY=${copy})
    # Hidden visibility, and (GCC) static locals of inline functions as plain weak objects, not
    # STB_GNU_UNIQUE ones, which objcopy cannot make local and the dynamic linker would share between
    # the copies (Eigen's manage_caching_sizes keeps its cache sizes in one).
    target_compile_options(${lib} PRIVATE $<TARGET_PROPERTY:${target},COMPILE_OPTIONS>
                                          -fvisibility=hidden -fvisibility-inlines-hidden
                                          $<$<CXX_COMPILER_ID:GNU>:-fno-gnu-unique>)
    target_link_libraries(${lib} PRIVATE Eigen3::Eigen)
    if(TARGET Random123::Random123)
      target_link_libraries(${lib} PRIVATE Random123::Random123)
    endif()
    if(copy STREQUAL "avx2")
      target_compile_options(${lib} PRIVATE ${FASTAXIAL_CPU_AVX2_FLAGS})
    endif()
    set(out ${CMAKE_CURRENT_BINARY_DIR}/${target}_cpu_${copy}.o)
    add_custom_command(
      OUTPUT ${out}
      COMMAND ${CMAKE_COMMAND} -DCOPY=${copy} "-DOBJECTS=$<JOIN:$<TARGET_OBJECTS:${lib}>,|>" -DOUT=${out}
              -DLD=${CMAKE_LINKER} -DOBJCOPY=${CMAKE_OBJCOPY} -DNM=${CMAKE_NM} -DREADELF=${CMAKE_READELF}
              -P ${FASTAXIAL_CPU_COPY_LINK_SCRIPT}
      DEPENDS ${lib} $<TARGET_OBJECTS:${lib}> ${FASTAXIAL_CPU_COPY_LINK_SCRIPT}
      COMMENT "Linking copy ${copy} of the CPU kernels into one object, its symbols private to it"
      VERBATIM)
    set_source_files_properties(${out} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
    target_sources(${target} PRIVATE ${out})
    list(APPEND objects ${out})
  endforeach()
  set_property(TARGET ${target} PROPERTY FASTAXIAL_CPU_COPY_OBJECTS "${objects}")
endfunction()
