# cmake --install: the daemon, the reference consumer (outbox-email-consumer
# and its table), the consumer library (static and shared, its headers,
# pkg-config and CMake package files), the SQL migrations, the systemd units,
# the manual pages and the documentation. Each rule names the
# Debian package it goes to (cmake/package.cmake): relay, library or
# development.
include(CMakePackageConfigHelpers)

install(TARGETS outbox-relay RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT relay)
# The reference consumer goes with the daemon (it needs libpq, as the daemon
# does, and links the static consumer library); its table beside the schema.
install(TARGETS outbox-email-consumer RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  COMPONENT relay)
install(FILES examples/email_schema.sql
  DESTINATION ${CMAKE_INSTALL_DATADIR}/outbox-relay/examples COMPONENT relay)

install(TARGETS outbox_consumer_shared EXPORT OutboxConsumerTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT library NAMELINK_SKIP)
install(TARGETS outbox_consumer_shared EXPORT OutboxConsumerTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development NAMELINK_ONLY)
install(TARGETS outbox_consumer EXPORT OutboxConsumerTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development)
install(FILES include/outbox/consumer.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/outbox COMPONENT development)

# pkg-config: hiredis and c-ares are private, since no public header includes it. The
# prefix is found from where the file lies (${pcfiledir}), so a tree installed
# with --prefix DIR, or moved after, still points at itself.
set(OUTBOX_PC_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  # Directories given as absolute paths stay as given.
  set(OUTBOX_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(OUTBOX_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(OUTBOX_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH OUTBOX_PC_TO_PREFIX /prefix/${OUTBOX_PC_DIR} /prefix)
  string(REGEX REPLACE "/$" "" OUTBOX_PC_TO_PREFIX "${OUTBOX_PC_TO_PREFIX}")
  set(OUTBOX_PC_PREFIX "\${pcfiledir}/${OUTBOX_PC_TO_PREFIX}")
  set(OUTBOX_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(OUTBOX_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(cmake/outbox-consumer.pc.in ${CMAKE_BINARY_DIR}/outbox-consumer.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/outbox-consumer.pc
  DESTINATION ${OUTBOX_PC_DIR} COMPONENT development)

# find_package(OutboxConsumer): OutboxConsumer::outbox_consumer (shared) and
# OutboxConsumer::outbox_consumer_static.
set(OUTBOX_CONSUMER_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/OutboxConsumer)
install(EXPORT OutboxConsumerTargets NAMESPACE OutboxConsumer::
  DESTINATION ${OUTBOX_CONSUMER_CMAKE_DIR} COMPONENT development)
configure_package_config_file(cmake/OutboxConsumerConfig.cmake.in
  ${CMAKE_BINARY_DIR}/OutboxConsumerConfig.cmake INSTALL_DESTINATION ${OUTBOX_CONSUMER_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/OutboxConsumerConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/OutboxConsumerConfig.cmake
  ${CMAKE_BINARY_DIR}/OutboxConsumerConfigVersion.cmake
  DESTINATION ${OUTBOX_CONSUMER_CMAKE_DIR} COMPONENT development)

# The Redis function libraries, as the programs embed them, for loading by
# hand (docs/CONSUMERS.md, "The Redis functions").
install(FILES functions/outbox_relay.lua functions/outbox_consumer.lua
  DESTINATION ${CMAKE_INSTALL_DATADIR}/outbox-relay/functions COMPONENT relay)

# The schema: migrations/ for the outbox, migrations/consumer/ for a consumer's database.
install(DIRECTORY migrations/ DESTINATION ${CMAKE_INSTALL_DATADIR}/outbox-relay/migrations
  COMPONENT relay FILES_MATCHING PATTERN "*.sql")

install(FILES ${CMAKE_BINARY_DIR}/systemd/outbox-relay.service
  ${CMAKE_BINARY_DIR}/systemd/outbox-relay@.service
  DESTINATION ${RELAY_SYSTEMD_UNIT_DIR} COMPONENT relay)

install(FILES ${RELAY_DOC_DIR}/outbox-relay.8.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man8
  COMPONENT relay)
install(FILES ${RELAY_DOC_DIR}/outbox-relay.conf.5.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man5
  COMPONENT relay)
install(FILES ${RELAY_DOC_DIR}/outbox-email-consumer.1.gz
  DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT relay)
install(FILES ${RELAY_DOC_DIR}/relay.conf systemd/redis-aof-repair.conf
  DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples COMPONENT relay)
install(FILES README.md DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT relay)
install(DIRECTORY docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs COMPONENT relay
  FILES_MATCHING PATTERN "*.md")
