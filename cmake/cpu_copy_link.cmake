# One copy of the CPU kernels made private to itself, and the check that it is (cmake -P):
#
#   cmake -DCOPY=avx2 -DOBJECTS="a.o|b.o" -DOUT=copy.o -DLD=ld -DOBJCOPY=objcopy -DNM=nm
#         [-DREADELF=readelf] -P cpu_copy_link.cmake        link: OBJECTS -> OUT, then check OUT
#   cmake -DCOPY=avx2 -DCHECK=copy.o -DNM=nm [-DREADELF=readelf] -P cpu_copy_link.cmake   check only
#
# Both copies of src/cpu's kernel files instantiate the same templates (Eigen's, the standard
# library's, the kernels' own inline functions) with different machine code, as weak symbols in
# COMDAT groups, which a linker merges by name: the program would keep one of each, and AVX2 code
# could run on a CPU without it (SIGILL). -fvisibility=hidden is not enough (libstdc++ gives
# namespace std default visibility). So:
#   1. ld -r --force-group-allocation: the copy's objects as one relocatable object, its COMDAT
#      groups resolved among themselves and dissolved into plain sections (no group left for a
#      later link to merge with another object's);
#   2. objcopy --keep-global-symbols: every symbol it defines made local, but for its entry points,
#      the strong functions of its own namespace fastaxial::cpu::COPY (mangled _ZN9fastaxial3cpu<n>COPY);
#   3. the check (also a CTest, cpu_copies_private): OUT defines no global or weak symbol but
#      those entry points (forward, backward, saved_o_floats and saved_p_floats among them), has no
#      section group, and leaves no Eigen symbol nor any of the kernels' namespace undefined (to be
#      taken from elsewhere).
cmake_minimum_required(VERSION 3.24)

foreach(v COPY NM)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "cpu_copy_link.cmake: -D${v}= missing")
  endif()
endforeach()
string(LENGTH "${COPY}" copy_len)
set(prefix "_ZN9fastaxial3cpu${copy_len}${COPY}")

# nm's defined symbols of `file` with the given extra flags, as a list of "TYPE NAME".
function(symbols out file)
  execute_process(COMMAND ${NM} ${ARGN} ${file} OUTPUT_VARIABLE text RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} ${ARGN} ${file} failed: ${err}")
  endif()
  string(REPLACE "\n" ";" lines "${text}")
  set(result "")
  foreach(line IN LISTS lines)
    # "address type name" (defined) or "type name" (undefined, with --undefined-only)
    if(line MATCHES "^([0-9a-fA-F]+ +)?([A-Za-z]) (.+)$")
      list(APPEND result "${CMAKE_MATCH_2} ${CMAKE_MATCH_3}")
    endif()
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

function(check file)
  set(errors "")
  # Defined global and weak symbols: only the copy's own strong functions.
  symbols(globals ${file} --defined-only --extern-only)
  set(entries 0)
  foreach(s IN LISTS globals)
    string(SUBSTRING "${s}" 2 -1 name)
    string(SUBSTRING "${s}" 0 1 type)
    string(FIND "${name}" "${prefix}" at)
    if(type STREQUAL "T" AND at EQUAL 0)
      math(EXPR entries "${entries} + 1")
    else()
      list(APPEND errors "defines ${type} ${name}: a global or weak symbol outside the copy's entry points")
    endif()
  endforeach()
  # The four entry points dispatch.cpp calls (entries.h).
  foreach(entry forward backward saved_o_floats saved_p_floats)
    string(LENGTH "${entry}" n)
    if(NOT globals MATCHES "T ${prefix}${n}${entry}E")
      list(APPEND errors "has no entry point fastaxial::cpu::${COPY}::${entry}")
    endif()
  endforeach()
  # Undefined: nothing of Eigen nor of the kernels' namespaces (all of it must be inside the copy).
  symbols(undefined ${file} --undefined-only)
  foreach(s IN LISTS undefined)
    if(s MATCHES "^. (_ZN5Eigen|_ZNK5Eigen|_ZN9fastaxial3cpu|_ZNK9fastaxial3cpu)")
      list(APPEND errors "leaves ${s} undefined: it would come from outside the copy")
    endif()
  endforeach()
  # No section group (COMDAT) that a later link could merge with another object's.
  if(DEFINED READELF AND READELF)
    execute_process(COMMAND ${READELF} -g -W ${file} OUTPUT_VARIABLE groups RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0 OR groups MATCHES "COMDAT")
      list(APPEND errors "keeps COMDAT section groups")
    endif()
  endif()
  list(LENGTH globals n_globals)
  if(errors)
    list(LENGTH errors n_errors)
    list(SUBLIST errors 0 20 shown)
    list(JOIN shown "\n  " shown)
    message(FATAL_ERROR "${file}, copy ${COPY} of the CPU kernels, is not private to itself (${n_errors} problems; "
                        "cmake/cpu_copy_link.cmake):\n  ${shown}")
  endif()
  message(STATUS "${file}: copy ${COPY} of the CPU kernels: ${entries} global symbols, all its own entry points "
                 "(fastaxial::cpu::${COPY}::); no weak symbol, no section group, no Eigen symbol taken from outside")
endfunction()

if(DEFINED CHECK)
  foreach(f IN LISTS CHECK)
    check(${f})
  endforeach()
  return()
endif()

foreach(v OBJECTS OUT LD OBJCOPY)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "cpu_copy_link.cmake: -D${v}= missing")
  endif()
endforeach()
string(REPLACE "|" ";" objects "${OBJECTS}")
set(partial "${OUT}.partial.o")
set(keep "${OUT}.keep")
execute_process(COMMAND ${LD} -r --force-group-allocation -o ${partial} ${objects} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${LD} -r --force-group-allocation failed for copy ${COPY}")
endif()
symbols(globals ${partial} --defined-only --extern-only)
set(names "")
foreach(s IN LISTS globals)
  string(SUBSTRING "${s}" 2 -1 name)
  string(FIND "${name}" "${prefix}" at)
  if(s MATCHES "^T " AND at EQUAL 0)
    string(APPEND names "${name}\n")
  endif()
endforeach()
file(WRITE ${keep} "${names}")
# Written under another name, checked, then renamed: a copy that fails the check is no build output.
execute_process(COMMAND ${OBJCOPY} --keep-global-symbols=${keep} ${partial} ${OUT}.tmp.o RESULT_VARIABLE rc)
file(REMOVE ${partial})
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${OBJCOPY} --keep-global-symbols failed for copy ${COPY}")
endif()
check(${OUT}.tmp.o)
file(RENAME ${OUT}.tmp.o ${OUT})
