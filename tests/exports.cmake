# unit.exports (cmake -P): the shared consumer library exports exactly the
# functions its public header declares, no more and no fewer
# (consumer/outbox_consumer.map).
#   -DNM=<nm> -DLIBRARY=<liboutbox_consumer.so> -DHEADER=<include/outbox/consumer.h>
foreach(var NM LIBRARY HEADER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "exports.cmake: -D${var}= is required")
  endif()
endforeach()

# What the library exports: "<address> <type> <name>@@<version>" per line,
# and the version node itself as an absolute symbol (type A), left out.
execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY} OUTPUT_VARIABLE nm_out
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIBRARY} failed")
endif()
string(REGEX MATCHALL "[^\n]+" lines "${nm_out}")
set(exported "")
foreach(line IN LISTS lines)
  if(line MATCHES "^[0-9a-fA-F]* *([A-Za-z]) ([^@ ]+)" AND NOT CMAKE_MATCH_1 STREQUAL "A")
    list(APPEND exported ${CMAKE_MATCH_2})
  endif()
endforeach()

# What the header declares: every name followed by "(" once the comments and
# the typedefs (the handler's and the log hook's types) are taken out.
file(READ ${HEADER} text)
string(REGEX REPLACE "/\\*([^*]|\\*+[^*/])*\\*+/" "" text "${text}")
string(REGEX REPLACE "typedef[^;]*;" "" text "${text}")
string(REGEX REPLACE "#[^\n]*" "" text "${text}")
string(REGEX MATCHALL "[A-Za-z_][A-Za-z0-9_]*[ \t\n]*\\(" calls "${text}")
set(declared "")
foreach(call IN LISTS calls)
  string(REGEX REPLACE "[ \t\n]*\\($" "" name "${call}")
  list(APPEND declared ${name})
endforeach()

list(REMOVE_DUPLICATES exported)
list(REMOVE_DUPLICATES declared)
list(SORT exported)
list(SORT declared)
set(extra ${exported})
list(REMOVE_ITEM extra ${declared})
set(missing ${declared})
list(REMOVE_ITEM missing ${exported})
list(LENGTH declared ndeclared)
if(ndeclared LESS 10)
  message(FATAL_ERROR "found only ${ndeclared} functions in ${HEADER}: ${declared}")
endif()
if(extra OR missing)
  string(REPLACE ";" " " extra "${extra}")
  string(REPLACE ";" " " missing "${missing}")
  message(FATAL_ERROR "${LIBRARY} does not export the API of ${HEADER}:\n"
    "  exported, not declared: ${extra}\n"
    "  declared, not exported: ${missing}\n"
    "Name each public function in consumer/outbox_consumer.map, and nothing else.")
endif()
message(STATUS "${ndeclared} functions exported, as declared in ${HEADER}")
