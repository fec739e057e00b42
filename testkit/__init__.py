"""The integration-test harness: throwaway servers, the relay under test, and checks.

The integration tests (tests/integration/), the benchmark (bench/) and the demo
(scripts/demo.py) import it as a package, with the repository root on
PYTHONPATH:

    from testkit import harness               # everything a test uses, one namespace
    from testkit.harness import insert, wait_until
    from testkit import faults                # a controllable loopback TCP proxy
    from testkit import consumers             # the example consumer as a process

harness is also where to start reading: its docstring says which module
beside it (common, cleanup, postgres, redis_server, tls, relay, outbox,
producers, verify) holds what.

ctest sets PYTHONPATH (tests/CMakeLists.txt), as bench/run.sh and
scripts/demo.sh do. One test file by hand, from the repository root, after a
build into build/:

    PYTHONPATH=. /usr/bin/python3 tests/integration/test_delivery.py
"""
