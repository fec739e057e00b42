# The manual pages outbox-relay(8), outbox-relay.conf(5) and
# outbox-email-consumer(1), and the example configuration with every key commented out at its default. The key table of
# the page and of the example is written at build time by relay-docgen from
# core/config.c's own table, so neither can drift from the code.

set(RELAY_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
  "Where the systemd units are installed, relative to CMAKE_INSTALL_PREFIX")
if(IS_ABSOLUTE "${RELAY_SYSTEMD_UNIT_DIR}")
  set(RELAY_SYSTEMD_UNIT_FULL_DIR "${RELAY_SYSTEMD_UNIT_DIR}")
else()
  set(RELAY_SYSTEMD_UNIT_FULL_DIR "${CMAKE_INSTALL_PREFIX}/${RELAY_SYSTEMD_UNIT_DIR}")
endif()
set(RELAY_DOC_EXAMPLES_DIR "${CMAKE_INSTALL_FULL_DOCDIR}/examples")
# Left in place by configure_file for relay-docgen to fill.
set(RELAY_CONFIG_KEYS "@RELAY_CONFIG_KEYS@")

add_executable(relay-docgen man/docgen.c)
target_link_libraries(relay-docgen PRIVATE relay_core)
relay_target_setup(relay-docgen)

set(RELAY_DOC_DIR ${CMAKE_BINARY_DIR}/doc)
configure_file(man/outbox-relay.8.in ${RELAY_DOC_DIR}/outbox-relay.8 @ONLY)
configure_file(man/outbox-email-consumer.1.in ${RELAY_DOC_DIR}/outbox-email-consumer.1 @ONLY)
configure_file(man/outbox-relay.conf.5.in ${RELAY_DOC_DIR}/outbox-relay.conf.5.in @ONLY)
configure_file(examples/relay.conf.in ${RELAY_DOC_DIR}/relay.conf.in @ONLY)

add_custom_command(OUTPUT ${RELAY_DOC_DIR}/outbox-relay.conf.5
  COMMAND relay-docgen roff ${RELAY_DOC_DIR}/outbox-relay.conf.5.in
    ${RELAY_DOC_DIR}/outbox-relay.conf.5
  DEPENDS relay-docgen ${RELAY_DOC_DIR}/outbox-relay.conf.5.in
  COMMENT "Generating outbox-relay.conf(5) from the configuration table" VERBATIM)
add_custom_command(OUTPUT ${RELAY_DOC_DIR}/relay.conf
  COMMAND relay-docgen file ${RELAY_DOC_DIR}/relay.conf.in ${RELAY_DOC_DIR}/relay.conf
  DEPENDS relay-docgen ${RELAY_DOC_DIR}/relay.conf.in
  COMMENT "Generating the example relay.conf from the configuration table" VERBATIM)
# Installed compressed, as Debian policy asks of manual pages (man reads both).
foreach(page outbox-relay.8 outbox-relay.conf.5 outbox-email-consumer.1)
  add_custom_command(OUTPUT ${RELAY_DOC_DIR}/${page}.gz
    COMMAND gzip -9 -n -c ${RELAY_DOC_DIR}/${page} > ${RELAY_DOC_DIR}/${page}.gz
    DEPENDS ${RELAY_DOC_DIR}/${page} VERBATIM)
endforeach()
add_custom_target(relay-docs ALL DEPENDS ${RELAY_DOC_DIR}/outbox-relay.8.gz
  ${RELAY_DOC_DIR}/outbox-relay.conf.5.gz ${RELAY_DOC_DIR}/outbox-email-consumer.1.gz
  ${RELAY_DOC_DIR}/relay.conf)

foreach(unit outbox-relay.service outbox-relay@.service)
  configure_file(systemd/${unit}.in ${CMAKE_BINARY_DIR}/systemd/${unit} @ONLY)
endforeach()
