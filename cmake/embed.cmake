# Writes a text file as a C string (cmake -P): the Redis function libraries of
# functions/ are embedded this way into outbox_common (CMakeLists.txt), so the
# programs load each file exactly as it stands in the tree.
#   -DSOURCE=<file> -DOUT=<.c file> -DNAME=<C name> -DHEADER=<header declaring it>
foreach(var SOURCE NAME OUT HEADER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "embed.cmake: -D${var}= is required")
  endif()
endforeach()

file(READ "${SOURCE}" text)
# One C string line per line of the file. "?" is escaped so that no "??x"
# becomes a trigraph (C11 without GNU extensions reads them).
string(REPLACE "\\" "\\\\" text "${text}")
string(REPLACE "\"" "\\\"" text "${text}")
string(REPLACE "?" "\\?" text "${text}")
string(REPLACE "\t" "\\t" text "${text}")
string(REPLACE "\r" "\\r" text "${text}")
string(REPLACE "\n" "\\n\"\n    \"" text "${text}")

file(RELATIVE_PATH shown "${CMAKE_CURRENT_LIST_DIR}/.." "${SOURCE}")
file(WRITE "${OUT}"
  "/* Generated from ${shown} by cmake/embed.cmake: edit that file instead. */\n"
  "#include \"${HEADER}\"\n"
  "\n"
  "const char ${NAME}[] =\n"
  "    \"${text}\";\n")
