#!lua name=cursor_proto
--
-- The prototype's publish function (bench/extra/snapshot_cursor.sql has the
-- design): one call appends a stream's entries of one chunk of a batch and
-- moves that stream's cursor, only if the cursor is where the relay expects
-- it. No per-message record, no time to live, no clock.
--
--   FCALL cursor_proto_publish_v1 2 <stream> {<stream>}:cursor
--         <expected> <new> <count> (<nfields> <field> <value> ...) x count
--
-- The cursor is "<tick>:<txid>:<id>", the position in the outbox of the last
-- entry appended to the stream, each number zero-padded to 19, 20 and 19
-- digits so that positions compare as strings; <expected> is '' for a stream
-- that has none. The cursor key shares the stream's hash tag, so one call
-- touches one slot. The cursor never moves back: a <new> not after <expected>
-- is an error of the caller's, and appends nothing.
--
-- Answers {1, <new>} when it appended every entry and moved the cursor, or
-- {0, <cursor>} when the cursor is not at <expected>: then it appended
-- nothing, and <cursor> (or '') tells the relay where the stream stands: a
-- relay that restarted after a crash skips what is already there, and a second
-- relay working on the same batches finds its calls refused.
--
-- Nothing is appended unless everything can be: the stream must be a stream
-- (or absent) before the first XADD, and a function that starts when Redis is
-- over maxmemory is refused before it runs. The cursor is set after the
-- entries: a function body does not roll back, and a cursor moved over
-- entries that failed would lose them.
local function publish(keys, args)
  local cur = redis.call('GET', keys[2]) or ''
  if cur ~= args[1] then return {0, cur} end
  if args[2] <= cur then
    return redis.error_reply('BACKWARDS the new cursor is not after the current one')
  end
  local t = redis.call('TYPE', keys[1])['ok']
  if t ~= 'stream' and t ~= 'none' then
    return redis.error_reply('WRONGTYPE the stream key holds a ' .. t)
  end
  local n, at = tonumber(args[3]), 4
  for _ = 1, n do
    local nf = tonumber(args[at])
    redis.call('XADD', keys[1], '*', unpack(args, at + 1, at + nf))
    at = at + 1 + nf
  end
  redis.call('SET', keys[2], args[2])
  return {1, args[2]}
end
redis.register_function('cursor_proto_publish_v1', publish)
