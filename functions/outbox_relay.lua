#!lua name=outbox_relay
--
-- The relay's Redis function library, outbox_relay: what outbox-relay calls
-- to publish, trim and retire. The relay loads it with FUNCTION LOAD REPLACE
-- on every connect (functions are persisted and replicated, unlike the script
-- cache; REPLACE brings an older body up to date), from this file, embedded
-- at build time (common/functions.h). By hand, exactly as written:
--
--   redis-cli -x FUNCTION LOAD REPLACE < functions/outbox_relay.lua

-- The publish function. KEYS[1] is the stream, KEYS[2] the message's dedup
-- record, and KEYS[3], when given, the dedup record of the message the relay
-- sent to the same stream just before this one in the same batch; all share
-- the stream's hash tag so the layout is Cluster-safe. ARGV[1] is the
-- record's time to live in ms, ARGV[2] the validity deadline (Unix ms on the
-- server's clock), ARGV[3..] the entry's fields.
--
-- A message id already recorded returns the entry id of the first copy.
-- Then a message past its deadline is refused (below), before any other
-- check. A message whose predecessor (KEYS[3]) is not recorded publishes
-- nothing: the batch's commands are pipelined, and when an earlier one failed
-- (its slot being migrated, memory full for a moment) a later one that ran
-- must not put its entry first, since the retry would then append the earlier
-- row behind it. The record must be a string (TYPE, which the relay's Redis
-- user may run, docs/OPERATIONS.md): one of another type failed the message
-- before (its GET answered WRONGTYPE), so it holds this one back too. A call
-- that runs after its deadline publishes nothing: the relay gave up on it and
-- will publish the row again, and by then it may have committed that second
-- publish and removed the record, so a late first copy would be a duplicate.
-- The record is written only after the entry is added: a function body does
-- not roll back, so recording first would turn a failed add into a lost
-- message.
local function publish(keys, args)
  local seen = redis.call('GET', keys[2])
  if seen then return seen end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if now > tonumber(args[2]) then
    return redis.error_reply('EXPIRED publish deadline passed; the relay retries it')
  end
  if keys[3] and redis.call('TYPE', keys[3])['ok'] ~= 'string' then
    return redis.error_reply('ORDER the message before this one in its stream was not published; the relay retries both in order')
  end
  local id = redis.call('XADD', keys[1], '*', unpack(args, 3))
  redis.call('SET', keys[2], id, 'PX', args[1])
  return id
end
redis.register_function('outbox_relay_publish_v2', publish)

-- The publish of several rows of one stream in one call, as the relay sends
-- them: the rules above, row by row, in one pass over the rows. KEYS[1] is
-- the stream, then, when given, the dedup record of the row sent to the
-- stream just before the first of these, then the rows' records in order.
-- ARGV[1] is the records' time to live, ARGV[2] the deadline, ARGV[3] the
-- number of rows, then for each row the number of its fields' arguments and
-- the fields. Answers one reply per row: its entry id, or an error of the
-- row's own. Each row is held back by the row before it, as a call of its own
-- would be: once a row fails, the rows after it are refused with ORDER up to
-- one already recorded (its entry is in the stream), after which rows are
-- published again. Reads TIME once: the call runs as one command.
local function publish_many(keys, args)
  local n = tonumber(args[3])
  local first = #keys - n + 1
  local t = redis.call('TIME')
  local late = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(args[2])
  local held = first == 3 and redis.call('TYPE', keys[2])['ok'] ~= 'string'
  local out, at = {}, 4
  for i = 1, n do
    local nf, key = tonumber(args[at]), keys[first + i - 1]
    local seen = redis.pcall('GET', key)
    if type(seen) == 'table' then
      out[i], held = seen, true
    elseif seen then
      out[i], held = seen, false
    elseif late then
      out[i] = redis.error_reply('EXPIRED publish deadline passed; the relay retries it')
    elseif held then
      out[i] = redis.error_reply('ORDER the message before this one in its stream was not published; the relay retries both in order')
    else
      local id = redis.pcall('XADD', keys[1], '*', unpack(args, at + 1, at + nf))
      if type(id) == 'table' then
        out[i], held = id, true
      else
        redis.call('SET', key, id, 'PX', args[1])
        out[i] = id
      end
    end
    at = at + 1 + nf
  end
  return out
end
redis.register_function('outbox_relay_publish_many_v1', publish_many)

-- The trim function (docs/DESIGN.md, "Retention"). KEYS[1] is a
-- stream, ARGV[1] the retention and ARGV[2] the longest a group may hold
-- trimming back (0: for ever), both in ms. It removes entries older than the
-- retention that every group has acknowledged: the bound is the lowest of the
-- time cutoff and, for each group, its oldest pending entry and the entry
-- after the last one delivered to it. Reading the groups and trimming in one
-- function leaves no gap for a group to be created, or to fall behind, in
-- between. MINID with "~" removes whole nodes only, never an entry at or
-- above the bound. A group whose oldest pending entry is older than ARGV[2]
-- allows holds the bound only at the entry after the last one delivered to
-- it: its pending entries may go (its consumers find them gone when they
-- claim them, and record them as lost), never one it has not been delivered,
-- which nothing would record. Such a group is named in the reply, so that the
-- relay can say so. Returns {entries removed, the bound, the group that held
-- the bound below the cutoff or "", the time in ms of the oldest entry left
-- when a group held it (else 0), the group passed over or ""}.
local function id_parts(id)
  local ms, seq = string.match(id or '', '^(%d+)-(%d+)$')
  return tonumber(ms) or 0, tonumber(seq) or 0
end
local function before(ams, aseq, bms, bseq)
  return ams < bms or (ams == bms and aseq < bseq)
end
local function trim(keys, args)
  if redis.call('TYPE', keys[1])['ok'] ~= 'stream' then return {0, '', '', 0, ''} end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local bms, bseq = now - tonumber(args[1]), 0
  local hold = tonumber(args[2])
  local holder, held, passed = '', 0, ''
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', keys[1])) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    local gms, gseq = id_parts(f['last-delivered-id'])
    gseq = gseq + 1
    if tonumber(f['pending']) > 0 then
      local p = redis.call('XPENDING', keys[1], f['name'])
      local pms, pseq = id_parts(p[2])
      if before(pms, pseq, gms, gseq) then
        if hold > 0 and pms < now - hold then
          passed = f['name']
        else
          gms, gseq = pms, pseq
        end
      end
    end
    if before(gms, gseq, bms, bseq) then
      bms, bseq, holder = gms, gseq, f['name']
    end
  end
  if bms < 0 then bms, bseq = 0, 0 end
  local bound = string.format('%.0f-%.0f', bms, bseq)
  local removed = redis.call('XTRIM', keys[1], 'MINID', '~', bound)
  if holder ~= '' then
    local first = redis.call('XRANGE', keys[1], '-', '+', 'COUNT', 1)[1]
    if first then held = id_parts(first[1]) end
  end
  return {removed, bound, holder, held, passed}
end
redis.register_function('outbox_relay_trim_v1', trim)

-- The retire function. KEYS are the dedup records of one stream's rows in a
-- committed batch, ARGV[1] a time to live in ms. Each record is left to
-- expire after it rather than removed at once: a copy another relay sent
-- before its claim ended (its PostgreSQL connection was cut, and this relay
-- took its rows over) may still reach Redis until that copy's deadline, which
-- is at most publish_timeout after the claim; it must find the record, not
-- append the row again. LT never lengthens a record's life.
local function retire(keys, args)
  for _, k in ipairs(keys) do redis.call('PEXPIRE', k, args[1], 'LT') end
  return #keys
end
redis.register_function('outbox_relay_retire_v1', retire)
