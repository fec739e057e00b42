#!lua name=outbox_consumer
--
-- The consumers' Redis function library, outbox_consumer: dead letters,
-- replay, and the partition leases of ordered consumers. Its contract (keys,
-- arguments, replies, errors) is in include/outbox/consumer.h and
-- docs/CONSUMERS.md. The consumer library loads it with FUNCTION LOAD REPLACE
-- on every connect, and so do the relay and "outbox-relay dlq replay", from
-- this file, embedded at build time (common/functions.h). It is a library of
-- its own: loading the relay's library, outbox_relay, from a consumer would
-- replace that one and drop the relay's publish function. By hand, exactly as
-- written:
--
--   redis-cli -x FUNCTION LOAD REPLACE < functions/outbox_consumer.lua

-- The dead-letter function, outbox_consumer_dead_letter_v1. KEYS[1] is the
-- dead-letter stream, KEYS[2] the stream the entry was read from; ARGV[1] the
-- group, ARGV[2] the entry id, ARGV[3..] the dead letter's fields and values.
-- A function body does not roll back either, so what could make the XACK fail
-- (a malformed entry id, a stream key of another type) is checked before
-- anything is written, and the XACK runs only after the XADD succeeded. The
-- XADD goes through redis.pcall so that its error comes back as a reply
-- instead of aborting the call, with what to do when the dead-letter key holds
-- another type. The dead letter is recorded even when XACK finds the entry no
-- longer pending, as MULTI/EXEC did: the "lost" record is made after XCLAIM in
-- Redis 7.0 has already dropped the deleted entry from the pending list, and a
-- dead letter recorded twice (two consumers giving up on one entry at once) is
-- the lesser harm next to none.
--
-- The dead letter itself, for both dead-letter functions: args[first] is the
-- entry id, the fields follow it.
local function move_to_dead_letters(dlq, stream, group, args, first)
  local id = args[first]
  if not string.match(id, '^%d+%-%d+$') then
    return redis.error_reply('ERR entry id "' .. id .. '" is not of the form <ms>-<seq>')
  end
  local t = redis.call('TYPE', stream)['ok']
  if t ~= 'stream' and t ~= 'none' then
    return redis.error_reply('WRONGTYPE stream key ' .. stream .. ' holds a ' .. t .. ', not a stream: nothing was dead-lettered or acknowledged')
  end
  local added = redis.pcall('XADD', dlq, '*', unpack(args, first + 1))
  if type(added) == 'table' and added['err'] then
    if string.sub(added['err'], 1, 9) == 'WRONGTYPE' then
      return redis.error_reply('WRONGTYPE dead-letter key ' .. dlq .. ' holds a ' .. redis.call('TYPE', dlq)['ok'] .. ', not a stream: delete or rename it; nothing was acknowledged')
    end
    return added
  end
  redis.call('XACK', stream, group, id)
  return added
end
local function dead_letter(keys, args)
  if #keys ~= 2 or #args < 4 or #args % 2 ~= 0 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_dead_letter_v1 2 <dead-letter stream> <stream> <group> <entry id> <field> <value> [<field> <value> ...]')
  end
  return move_to_dead_letters(keys[1], keys[2], args[1], args, 2)
end
redis.register_function('outbox_consumer_dead_letter_v1', dead_letter)

-- The replay function, outbox_consumer_replay_v1, for "outbox-relay dlq
-- replay". KEYS[1] is the dead-letter stream, KEYS[2] the group's replay
-- stream, ARGV[1] the dead letter's entry id. It reads the dead letter itself,
-- so a dead letter that another client has just replayed is not there to
-- replay twice, and keeps every field but dlq.*, in order. As above,
-- everything that can be checked is checked before the first write, the XADD
-- goes through redis.pcall, and the XDEL runs only once the XADD succeeded: an
-- XADD refused when it runs (a replay stream whose last id is the largest
-- possible one) leaves the dead letter where it was. MULTI/EXEC could not
-- promise that: the XDEL queued after a failed XADD still ran. A dead letter
-- the consumer wrote has at most 2 * (6 + 64 headers) fields for unpack, far
-- below Lua's limit.
local function replay(keys, args)
  if #keys ~= 2 or #args ~= 1 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_replay_v1 2 <dead-letter stream> <replay stream> <entry id>')
  end
  if not string.match(args[1], '^%d+%-%d+$') then
    return redis.error_reply('ERR entry id "' .. args[1] .. '" is not of the form <ms>-<seq>')
  end
  local names = {'dead-letter', 'replay'}
  for i = 1, 2 do
    local t = redis.call('TYPE', keys[i])['ok']
    if t ~= 'stream' and t ~= 'none' then
      return redis.error_reply('WRONGTYPE ' .. names[i] .. ' key ' .. keys[i] .. ' holds a ' .. t .. ', not a stream: nothing was replayed')
    end
  end
  local e = redis.call('XRANGE', keys[1], args[1], args[1])[1]
  if not e then
    return false
  end
  local fields = {}
  for i = 1, #e[2], 2 do
    if string.sub(e[2][i], 1, 4) ~= 'dlq.' then
      fields[#fields + 1] = e[2][i]
      fields[#fields + 1] = e[2][i + 1]
    end
  end
  if #fields == 0 then
    return redis.error_reply('NOTREPLAYABLE dead letter ' .. args[1] .. ' has no original fields (reason lost?): nothing was replayed')
  end
  local id = redis.pcall('XADD', keys[2], '*', unpack(fields))
  if type(id) == 'table' and id['err'] then
    return id
  end
  redis.call('XDEL', keys[1], args[1])
  return id
end
redis.register_function('outbox_consumer_replay_v1', replay)

-- Partition leases, for ordered consumers (docs/CONSUMERS.md, "Ordered
-- consumers"). A lease is a string "<token>:<consumer>" with a time to live,
-- in the partition stream's hash slot; its token comes from INCR of a counter
-- key that never expires, so each grant has a token larger than every one
-- before it. The functions that read, take over, acknowledge or dead-letter
-- check the token first and, when it is not the lease's, answer LEASELOST and
-- do nothing: a consumer that has lost its lease cannot touch the partition
-- any more, however late its call arrives.
local function lease_of(key)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'string' then return nil, nil end
  return string.match(v, '^(%d+):(.*)$')
end
local function lease_lost(key, token)
  local t = lease_of(key)
  if t ~= nil and t == token then return nil end
  return redis.error_reply('LEASELOST ' .. key .. ' is not held with token ' .. token .. (t and (' (token ' .. t .. ' holds it)') or ' (nobody holds it)') .. ': another consumer may own the partition; nothing was done')
end
local function lease(keys, args)
  if #keys ~= 2 or #args ~= 3 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_lease_v1 2 <lease key> <token counter key> <consumer> <ttl ms> <token, 0 to take>')
  end
  local ttl = tonumber(args[2])
  if args[1] == '' or not ttl or ttl < 1 or ttl > 86400000 or ttl % 1 ~= 0 then
    return redis.error_reply('ERR the consumer name must not be empty and the time to live must be 1 to 86400000 ms')
  end
  local t, who = lease_of(keys[1])
  if t ~= nil then
    if t == args[3] and who == args[1] then
      redis.call('PEXPIRE', keys[1], ttl)
      return {tonumber(t), who, ttl}
    end
    return {0, who, redis.call('PTTL', keys[1])}
  end
  if redis.call('EXISTS', keys[1]) == 1 then
    return redis.error_reply('WRONGTYPE lease key ' .. keys[1] .. ' holds something else: delete it')
  end
  -- A renewal of a lease that ran out takes nothing: its holder must learn
  -- that it lost the partition, and take it again as anyone would.
  if args[3] ~= '0' then return {0, '', 0} end
  local n = redis.call('INCR', keys[2])
  redis.call('SET', keys[1], n .. ':' .. args[1], 'PX', ttl)
  return {n, args[1], ttl}
end
redis.register_function('outbox_consumer_lease_v1', lease)
local function release(keys, args)
  if #keys ~= 1 or #args ~= 1 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_release_v1 1 <lease key> <token>')
  end
  if lease_of(keys[1]) == args[1] then
    return redis.call('DEL', keys[1])
  end
  return 0
end
redis.register_function('outbox_consumer_release_v1', release)
local function leased_read(keys, args)
  if #keys ~= 2 or #args ~= 5 or (args[5] ~= '>' and not string.match(args[5], '^%d+%-%d+$') and args[5] ~= '0') then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_read_v1 2 <stream> <lease key> <group> <consumer> <token> <count> <\'>\' or an id>')
  end
  local lost = lease_lost(keys[2], args[3])
  if lost then return lost end
  if args[5] == '>' then
    return redis.call('XREADGROUP', 'GROUP', args[1], args[2], 'COUNT', args[4], 'STREAMS', keys[1], '>')
  end
  -- The caller's own pending entries after the id, as XREADGROUP gives them,
  -- but read without counting a delivery each (XREADGROUP with an id does
  -- count one): {id, nil} for an entry deleted from the stream.
  local start = args[5] == '0' and '-' or ('(' .. args[5])
  local out = {}
  for _, p in ipairs(redis.call('XPENDING', keys[1], args[1], start, '+', args[4], args[2])) do
    local e = redis.call('XRANGE', keys[1], p[1], p[1])[1]
    out[#out + 1] = e or {p[1], false}
  end
  return {{keys[1], out}}
end
redis.register_function('outbox_consumer_read_v1', leased_read)
local function take(keys, args)
  if #keys ~= 2 or #args ~= 4 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_take_v1 2 <stream> <lease key> <group> <consumer> <token> <count>')
  end
  local lost = lease_lost(keys[2], args[3])
  if lost then return lost end
  -- Pages through the whole pending list: the caller's own entries may come
  -- first, and others' after them.
  local want, ids, start = tonumber(args[4]), {}, '-'
  if not want or want < 1 then
    return redis.error_reply('ERR the count must be a positive number')
  end
  while #ids < want do
    local page = redis.call('XPENDING', keys[1], args[1], start, '+', 100)
    for _, p in ipairs(page) do
      if p[2] ~= args[2] and #ids < want then ids[#ids + 1] = p[1] end
    end
    if #page < 100 then break end
    start = '(' .. page[#page][1]
  end
  if #ids == 0 then return {{}, {}} end
  return {ids, redis.call('XCLAIM', keys[1], args[1], args[2], 0, unpack(ids))}
end
redis.register_function('outbox_consumer_take_v1', take)
local function leased_ack(keys, args)
  if #keys ~= 2 or #args < 3 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_ack_v1 2 <stream> <lease key> <group> <token> <entry id> [<entry id> ...]')
  end
  local lost = lease_lost(keys[2], args[2])
  if lost then return lost end
  return redis.call('XACK', keys[1], args[1], unpack(args, 3))
end
redis.register_function('outbox_consumer_ack_v1', leased_ack)
local function leased_dead_letter(keys, args)
  if #keys ~= 3 or #args < 5 or #args % 2 ~= 1 then
    return redis.error_reply('ERR usage: FCALL outbox_consumer_dead_letter_leased_v1 3 <dead-letter stream> <stream> <lease key> <group> <token> <entry id> <field> <value> [<field> <value> ...]')
  end
  local lost = lease_lost(keys[3], args[2])
  if lost then return lost end
  return move_to_dead_letters(keys[1], keys[2], args[1], args, 3)
end
redis.register_function('outbox_consumer_dead_letter_leased_v1', leased_dead_letter)
