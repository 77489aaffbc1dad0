# cmake -DLIBRARY=libposenc.so -DNM=nm -P posencCheckCxxRuntime.cmake: fails when the library defines libstdc++'s
# own locale machinery, that is, when it carries a copy of libstdc++ of its own (-static-libstdc++, or a compiler
# built to link it so). Loaded into a process whose shared libstdc++ set up the locale, that copy's iostreams are
# never set up: error messages lose their numbers, or the process crashes at the first number (docs/install.md).
execute_process(COMMAND "${NM}" -D --defined-only "${LIBRARY}" OUTPUT_VARIABLE symbols RESULT_VARIABLE failed
                ERROR_QUIET)
if(NOT failed AND symbols MATCHES "_ZNSt6locale[0-9]+_S_initialize")
  message(FATAL_ERROR "posenc: ${LIBRARY} carries a copy of libstdc++ of its own (it defines std::locale), so its "
                      "iostreams would not work in a process that loads the shared libstdc++, as Python and torch "
                      "do. Build it with a compiler that links libstdc++ as a shared library, and without "
                      "-static-libstdc++ (docs/install.md).")
endif()
