"""The day counts' Lua scripts, which ``stream/counts.py``'s :class:`DailyCounts` registers: the counting script
every write runs (``ZINCR_MANY``: counts, names and the write's marker, or a forget call), the bounded reads of
names (``NAMES_BOUNDED``) and of a page of a day's top (``TOP_PAGE_BOUNDED``), and the byte limits past which a
name or member read is not sent as it is (``NAME_MAX_BYTES``, ``MEMBER_MAX_BYTES``). Above each script, its keys,
arguments and reply."""

# KEYS[1] = the day's counts key, KEYS[2] = the kind's names key of that day, KEYS[3] = the markers of the counts key
# (a hash); ARGV = expire-at (unix s), this call's marker (a field of KEYS[3]), the number n of (count, member) pairs,
# those pairs, then (member, name) pairs. The markers key gets the counts key's expiry, the names key (a hash: another
# type is not touched) the counts key's where that is later (PTTL: EXPIREAT ... GT is Redis 7). A marker found means
# this very call ran before (a retry after its reply was lost): nothing is written again. Every key it writes is read
# first (ZSCORE, HEXISTS: WRONGTYPE for a key of another type), so a call refused writes nothing; the marker is set
# last. Returns whether the names key existed before the call. With an empty marker it is a forget call: ARGV[4..]
# are markers of writes the caller knows succeeded (never retried), deleted from KEYS[3] (KEYS[1], KEYS[2] unused): a
# cleanup, which a markers key of the wrong type must not turn into every later write failing.
ZINCR_MANY = """
if ARGV[2] == '' then
  if redis.call('TYPE', KEYS[3]).ok == 'hash' then
    for i = 4, #ARGV do redis.call('HDEL', KEYS[3], ARGV[i]) end
  end
  return 0
end
local had = redis.call('EXISTS', KEYS[2])
if redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then return had end
local last = 3 + 2 * tonumber(ARGV[3])
redis.call('ZSCORE', KEYS[1], '')
if #ARGV > last then redis.call('HEXISTS', KEYS[2], '') end
for i = 4, last, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIREAT', KEYS[1], ARGV[1])
for i = last + 1, #ARGV, 2 do redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) end
local left = redis.call('PTTL', KEYS[2])
if (left == -1 or (left >= 0 and left < redis.call('PTTL', KEYS[1])))
    and (#ARGV > last or redis.call('TYPE', KEYS[2]).ok == 'hash') then redis.call('EXPIREAT', KEYS[2], ARGV[1]) end
redis.call('HSET', KEYS[3], ARGV[2], 1)
redis.call('EXPIREAT', KEYS[3], ARGV[1])
return had
"""
# The longest name DailyCounts.names reads (bytes): 4 per character of the longest raw id shown by name (the hot set's
# NAME_MAX_CHARS, 4096; the joiner's raw ids are at most max_str_len, 256). A longer one (another client's HSET) is
# left in Redis and its member shown by hash: read, 20 names of 1 MB each crossed the socket on every refresh.
NAME_MAX_BYTES = 16_384
# KEYS = names keys (one hash slot: one kind's, or the layout before hash tags on a single node); ARGV = NAME_MAX_BYTES,
# then the members. Per key, each member's name as HMGET gives it, but the length (an integer) of one longer than
# ARGV[1], whose bytes are never copied (HSTRLEN first); '!wrongtype' for a key of another type than a hash. Any other
# error (an ACL's) fails the read.
NAMES_BOUNDED = """
local out, most = {}, tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  local got = {}
  for j = 2, #ARGV do
    local n = redis.pcall('HSTRLEN', k, ARGV[j])
    if type(n) == 'table' then
      if not string.find(n['err'], 'WRONGTYPE', 1, true) then return n end
      got = '!wrongtype' break
    end
    if n > most then got[j - 1] = n else got[j - 1] = redis.call('HGET', k, ARGV[j]) end
  end
  out[i] = got
end
return out
"""
# The longest member DailyCounts.top reads as it is (bytes): the joiner's and serving's members are a stable hash's text
# (at most 20 bytes), a caller's own raw ids at most max_str_len (256) characters. A longer one (another client's ZADD)
# reads as '!toolong:' and its SHA-1 (one per member, so pages and days still tell members apart): read, a 20 MB member
# in a day's top crossed the socket on every refresh, and was refused (no stable hash's text) only after.
MEMBER_MAX_BYTES = 1024
# KEYS[1] = a day's counts key, KEYS[2..] = the window's other days' keys (one hash slot); ARGV = start, stop,
# MEMBER_MAX_BYTES: {ZREVRANGE start stop WITHSCORES (a flat reply, member then score text) with the members longer
# than ARGV[3] replaced (above), and for each replaced member its index in the flat page (1-based) then its score
# (text, or nil) in KEYS[2], KEYS[3], ...}. A replaced member's scores in the other days are read here, where its bytes
# are: asked by ZMSCORE later, its '!toolong:' text is in no key, and a window's sum lost the days where it was below
# the first page.
TOP_PAGE_BOUNDED = """
local r, most, other = redis.call('ZREVRANGE', KEYS[1], ARGV[1], ARGV[2], 'WITHSCORES'), tonumber(ARGV[3]), {}
for i = 1, #r, 2 do if #r[i] > most then
  other[#other + 1] = i
  for j = 2, #KEYS do other[#other + 1] = redis.call('ZSCORE', KEYS[j], r[i]) end
  r[i] = '!toolong:' .. redis.sha1hex(r[i])
end end
return {r, other}
"""
