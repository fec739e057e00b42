"""The outbox-relay benchmark, as a package: run from the repository root, with
the root on PYTHONPATH (bench/run.sh does both).

    bench.bench     the benchmark:  PYTHONPATH=. /usr/bin/python3 -m bench.bench
    bench.soak      the soak:       PYTHONPATH=. /usr/bin/python3 -m bench.soak
    bench.benchlib  what they and the measurements in bench/extra/ share
    bench/extra/    one-off measurements, run as files:
                    PYTHONPATH=. /usr/bin/python3 bench/extra/snapshot_cursor.py

bench.py and soak.py run as modules (-m), not as files: as a file, bench.py
would take the name "bench" from the package.
"""
