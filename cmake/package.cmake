# Debian packages (scripts/package.sh runs CPack with RELAY_DEB_PACKAGE=ON and
# the prefix /usr):
#   outbox-relay            the daemon, its units, manual pages, migrations,
#                           and the reference consumer outbox-email-consumer
#   liboutbox-consumer1     the consumer library, liboutbox_consumer.so.1
#   liboutbox-consumer-dev  its headers, static library, pkg-config and CMake files
# Dependencies on shared libraries come from dpkg-shlibdeps. Installing the
# daemon enables and starts nothing: it has no maintainer scripts.
option(RELAY_DEB_PACKAGE "Install the Debian copyright and changelog files (for CPack)" OFF)

set(RELAY_DEB_MAINTAINER "The outbox-relay authors <maintainers@outbox-relay.org>" CACHE STRING
  "Maintainer field of the Debian packages")
set(RELAY_DEB_PACKAGES outbox-relay liboutbox-consumer1 liboutbox-consumer-dev)
set(RELAY_DEB_COMPONENTS relay library development)

# The changelog's latest entry names the version being packaged.
file(STRINGS packaging/changelog RELAY_DEB_CHANGELOG_TOP LIMIT_COUNT 1)
if(NOT RELAY_DEB_CHANGELOG_TOP MATCHES "^outbox-relay \\(${PROJECT_VERSION}\\) ")
  message(WARNING "packaging/changelog has no entry for ${PROJECT_VERSION} at the top")
endif()

if(RELAY_DEB_PACKAGE)
  # debian/copyright in the machine-readable format, from LICENSE.
  file(READ LICENSE RELAY_LICENSE_TEXT)
  string(REGEX REPLACE "^.*All rights reserved\\.\n\n" "" RELAY_LICENSE_TEXT
    "${RELAY_LICENSE_TEXT}")
  string(REGEX REPLACE "\n+$" "" RELAY_LICENSE_TEXT "${RELAY_LICENSE_TEXT}")
  string(REPLACE "\n\n" "\n.\n" RELAY_LICENSE_TEXT "${RELAY_LICENSE_TEXT}")
  string(REPLACE "\n" "\n " RELAY_LICENSE_TEXT "${RELAY_LICENSE_TEXT}")
  configure_file(packaging/copyright.in ${CMAKE_BINARY_DIR}/packaging/copyright @ONLY)
  add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/packaging/changelog.gz
    COMMAND gzip -9 -n -c ${CMAKE_SOURCE_DIR}/packaging/changelog
      > ${CMAKE_BINARY_DIR}/packaging/changelog.gz
    DEPENDS ${CMAKE_SOURCE_DIR}/packaging/changelog VERBATIM)
  add_custom_target(relay-deb-changelog ALL DEPENDS ${CMAKE_BINARY_DIR}/packaging/changelog.gz)
  foreach(pkg comp IN ZIP_LISTS RELAY_DEB_PACKAGES RELAY_DEB_COMPONENTS)
    install(FILES ${CMAKE_BINARY_DIR}/packaging/copyright
      ${CMAKE_BINARY_DIR}/packaging/changelog.gz
      DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/${pkg} COMPONENT ${comp})
  endforeach()
endif()

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME outbox-relay)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "${RELAY_DEB_MAINTAINER}")
set(CPACK_PACKAGE_INSTALL_DIRECTORY outbox-relay)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL ${RELAY_DEB_COMPONENTS})
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SOURCE outbox-relay)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)

set(CPACK_DEBIAN_RELAY_PACKAGE_NAME outbox-relay)
set(CPACK_DEBIAN_RELAY_PACKAGE_SECTION database)
set(CPACK_DEBIAN_RELAY_DESCRIPTION
  "transactional outbox relay from PostgreSQL to Redis Streams
outbox-relay publishes the rows a service commits to an outbox table in
PostgreSQL to Redis Streams, at least once: it claims committed rows, publishes
each one to the stream of its topic, and marks it sent in the transaction that
claimed it, only after Redis acknowledged it. No message is lost between the
commit and the publish, whatever crashes where.
.
This package holds the daemon with its operator commands (failed, dlq,
status), the SQL migrations, the systemd units, the manual pages, and
outbox-email-consumer, a reference consumer of the streams. The
service is neither enabled nor started on installation: write
/etc/outbox-relay/relay.conf first.")
set(CPACK_DEBIAN_RELAY_PACKAGE_RECOMMENDS "postgresql-client")
set(CPACK_DEBIAN_RELAY_PACKAGE_SUGGESTS "postgresql, redis-server")

set(CPACK_DEBIAN_LIBRARY_PACKAGE_NAME liboutbox-consumer1)
set(CPACK_DEBIAN_LIBRARY_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_LIBRARY_PACKAGE_CONTROL_EXTRA ${CMAKE_SOURCE_DIR}/packaging/triggers)
set(CPACK_DEBIAN_LIBRARY_DESCRIPTION
  "consumer library for the Redis Streams of outbox-relay
A C library for services that consume the streams outbox-relay publishes:
consumer groups with retries after backoff, dead letters, replay, reclaiming
the entries of consumers that died, and ordered consumption of partitioned
topics.")

set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_NAME liboutbox-consumer-dev)
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_DEPENDS
  "liboutbox-consumer1 (= ${PROJECT_VERSION}), libhiredis-dev, libc-ares-dev")
if(OUTBOX_TLS)
  # With TLS to Redis the pkg-config file requires openssl (its .pc file,
  # also to resolve the flags of a dynamic link).
  string(APPEND CPACK_DEBIAN_DEVELOPMENT_PACKAGE_DEPENDS ", libssl-dev")
endif()
set(CPACK_DEBIAN_DEVELOPMENT_DESCRIPTION
  "consumer library for the Redis Streams of outbox-relay (development files)
A C library for services that consume the streams outbox-relay publishes.
.
This package holds the headers, the static library, and the files for
pkg-config (outbox-consumer) and CMake (find_package(OutboxConsumer)).")

include(CPack)
