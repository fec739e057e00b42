#!/usr/bin/python3
"""What the dedup records would cost Redis as fields of a hash: a key each against a hash per stream.

An experiment behind docs/PERFORMANCE.md ("What to change next", item 2), not part
of the run: one Redis as the benchmark runs it (append-only file on, everysec),
the relay's function (bench-naive --print-function) and a prototype with the same
rules that keeps each record as the field of one hash per stream (HGET/HSET, the
hash's life set once a call). Each round sends BENCH_PUBLISH_CALLS messages in the
relay's calls of 64 rows with redis-benchmark, eight calls in flight (as
bench.py's publish alone), then removes every record, 500 a command, with UNLINK
or HDEL. Rounds alternate the two layouts. Prints the rate, Redis's main-thread
CPU a message (INFO cpu), its time in the calls (commandstats), the removal's
CPU a record and used_memory. Needs build-bench (run bench/run.sh once first).

    PYTHONPATH=. /usr/bin/python3 bench/extra/record_layouts.py
"""
import subprocess

from bench import benchlib

PROTO = r"""#!lua name=proto
local function many_hash(keys, args)
  local n = tonumber(args[3])
  local first = #keys - n + 1
  local h = keys[1] .. ':dedup'
  local t = redis.call('TIME')
  local late = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(args[2])
  local held = first == 3 and redis.call('HEXISTS', h, keys[2]) == 0
  local out, at, wrote = {}, 4, false
  for i = 1, n do
    local nf, key = tonumber(args[at]), keys[first + i - 1]
    local seen = redis.pcall('HGET', h, key)
    if type(seen) == 'table' then
      out[i], held = seen, true
    elseif seen then
      out[i], held = seen, false
    elseif late then
      out[i] = redis.error_reply('EXPIRED')
    elseif held then
      out[i] = redis.error_reply('ORDER')
    else
      local id = redis.pcall('XADD', keys[1], '*', unpack(args, at + 1, at + nf))
      if type(id) == 'table' then
        out[i], held = id, true
      else
        redis.call('HSET', h, key, id)
        out[i], wrote = id, true
      end
    end
    at = at + 1 + nf
  end
  if wrote then redis.call('PEXPIRE', h, args[1]) end
  return out
end
redis.register_function('proto_many_hash', many_hash)
"""


def cpu(c):
    """Redis's main-thread CPU seconds."""
    i = c.info("cpu")
    return i["used_cpu_user_main_thread"] + i["used_cpu_sys_main_thread"]


def bench_calls(rd, c, fn):
    """One round of fn's calls (benchlib.publish_alone), then the removal of their records."""
    argv = subprocess.run([benchlib.NAIVE_BIN, "--print-argv", "--call-rows", "64"],
                          stdout=subprocess.PIPE, text=True, check=True).stdout.splitlines()
    stream, before = argv[3], argv[4]
    hashed = fn == "proto_many_hash"
    c.delete(stream + ":dedup")
    for k in c.scan_iter(match="*:dedup:*", count=10000):
        c.delete(k)
    c.hset(stream + ":dedup", before, "0-1")  # publish_alone records it as a key
    c.config_resetstat()
    c0 = cpu(c)
    res = benchlib.publish_alone(rd, 64, function=fn)
    c1 = cpu(c)
    n = benchlib.PUBLISH_CALLS // 64 * 64
    fc = c.info("commandstats").get("cmdstat_fcall", {})
    mem = c.info("memory")["used_memory"]
    # The removal after the commits, 500 records a command.
    records = (c.hkeys(stream + ":dedup") if hashed
               else list(c.scan_iter(match="*:dedup:*", count=10000)))
    r0 = cpu(c)
    p = c.pipeline(transaction=False)
    for i in range(0, len(records), 500):
        if hashed:
            p.hdel(stream + ":dedup", *records[i:i + 500])
        else:
            p.unlink(*records[i:i + 500])
    p.execute()
    rem = (cpu(c) - r0) / max(1, len(records))
    return dict(msgs=res["msgs"], main_us=(c1 - c0) / n * 1e6, fcall_us=fc.get("usec", 0) / n,
                remove_us=rem * 1e6, records=len(records), mem=mem)


def main():
    with benchlib.servers() as (pg, rd, conn, rc):
        src = subprocess.run([benchlib.NAIVE_BIN, "--print-function"], stdout=subprocess.PIPE,
                             text=True, check=True).stdout
        rc.execute_command("FUNCTION", "LOAD", "REPLACE", src)
        rc.execute_command("FUNCTION", "LOAD", "REPLACE", PROTO)
        for rnd in range(3):
            for fn in ("outbox_relay_publish_many_v1", "proto_many_hash"):
                r = bench_calls(rd, rc, fn)
                print(f"{rnd} {fn}: {r['msgs']:,.0f} msg/s, main {r['main_us']:.2f} us/msg,"
                      f" fcall {r['fcall_us']:.2f} us/msg, removal {r['remove_us']:.2f} us/record"
                      f" ({r['records']}), used_memory {r['mem']/1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
