#!lua name=outbox_relay
--
-- The relay's Redis function library, outbox_relay: the trim that
-- outbox-relay calls for stream retention (it publishes with plain XADD in
-- MULTI / EXEC and needs no function for that). The relay loads it with
-- FUNCTION LOAD REPLACE on every connect (functions are persisted and
-- replicated, unlike the script cache; REPLACE brings an older body up to
-- date, and drops the publish functions of 0.2 and earlier), from this
-- file, embedded at build time (common/functions.h). By hand, exactly as
-- written:
--
--   redis-cli -x FUNCTION LOAD REPLACE < functions/outbox_relay.lua

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
