"""Quota counters in Redis: each admit and each settle is one Lua script (EVALSHA, cached).

A script runs atomically in Redis, so checking every limit and taking from every counter can't
interleave with another gateway's admit: there is no read-then-write race to lose. All keys of
one admission carry the tenant's hash tag ("{t7}"), so the scripts also run on Redis Cluster.
The clock is the caller's (now_ms in ARGV): windows are 60 s, NTP-synced hosts agree to far
better than that, and tests can move time. Key expiry (PEXPIRE) only collects garbage; no
decision depends on it.
"""

from __future__ import annotations

import asyncio
import weakref

import redis
import redis.asyncio

from portal.quotas.limits import (
    CONCURRENCY_RETRY_MS,
    LIMIT_CODES,
    SETTLED_TTL_MS,
    WINDOW_MS,
    AdmitOutcome,
    Clock,
    Refusal,
    ScopeSpec,
    ScopeState,
    SettleTicket,
    month_counter_ttl_ms,
)
from portal.quotas.runtime import lease_ms

# KEYS, per scope i (1-based): [4i-3] window hash {start, req, tok}, [4i-2] in-flight zset
#   (member request id, score lease expiry ms), [4i-1] this month's token counter, [4i] this
#   month's spend counter (nano-USD).
# ARGV: [1] now ms, [2] request id, [3] estimated tokens, [4] window ms, [5] lease ms,
#   [6] month counter ttl ms, [7] ms to next month, [8] concurrency retry ms, [9] scope count,
#   [10] estimated spend, then per scope 5 limits: rpm, tpm, max concurrent, monthly budget,
#   monthly spend (-1 = unlimited).
# Returns {1, states} when admitted (states after the take) or
#   {0, states, scope index (1-based), limit code (1-5), retry ms, final 0|1} with nothing taken;
#   a state is {window start, requests, tokens, in flight, month tokens, month spend}.
ADMIT_LUA = """
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local est = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local lease = tonumber(ARGV[5])
local month_ttl = tonumber(ARGV[6])
local to_next_month = tonumber(ARGV[7])
local conc_retry = tonumber(ARGV[8])
local n = tonumber(ARGV[9])
local est_spend = tonumber(ARGV[10])

local states, fresh = {}, {}
local best = nil
local function consider(scope, code, retry, final)
  if best == nil or final > best[4] or (final == best[4] and retry > best[3]) then
    best = {scope, code, retry, final}
  end
end
local function flag(b) if b then return 1 else return 0 end end

-- 1. check everything (dropping expired leases is the only write: it takes nothing)
for i = 1, n do
  local win, inflight, month, spend = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local base = 10 + 5*(i-1)
  local rpm, tpm = tonumber(ARGV[base+1]), tonumber(ARGV[base+2])
  local cap, budget = tonumber(ARGV[base+3]), tonumber(ARGV[base+4])
  local spend_limit = tonumber(ARGV[base+5])

  local w = redis.call('HMGET', win, 'start', 'req', 'tok')
  local start, req, tok = tonumber(w[1]), tonumber(w[2]) or 0, tonumber(w[3]) or 0
  fresh[i] = (start == nil or now >= start + window)
  if fresh[i] then start, req, tok = now, 0, 0 end
  redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now)
  local running = redis.call('ZCARD', inflight)
  local used = tonumber(redis.call('GET', month) or '0')
  local spent = tonumber(redis.call('GET', spend) or '0')
  states[i] = {start, req, tok, running, used, spent}

  local reset = start + window - now
  if rpm >= 0 and req + 1 > rpm then consider(i, 1, reset, flag(rpm == 0)) end
  if tpm >= 0 and tok + est > tpm then consider(i, 2, reset, flag(est > tpm)) end
  if cap >= 0 and running + 1 > cap then consider(i, 3, conc_retry, flag(cap == 0)) end
  if budget >= 0 and used + est > budget then consider(i, 4, to_next_month, 1) end
  if spend_limit >= 0 and spent + est_spend > spend_limit then consider(i, 5, to_next_month, 1) end
end
if best ~= nil then
  return {0, states, best[1], best[2], best[3], best[4]}
end

-- 2. take from every scope
for i = 1, n do
  local win, inflight, month, spend = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local s = states[i]
  if fresh[i] then
    redis.call('HSET', win, 'start', ARGV[1], 'req', 1, 'tok', est)
  else
    redis.call('HINCRBY', win, 'req', 1)
    redis.call('HINCRBY', win, 'tok', est)
  end
  redis.call('PEXPIRE', win, s[1] + window - now + 1000)
  redis.call('ZADD', inflight, now + lease, rid)
  redis.call('PEXPIRE', inflight, lease + 1000)
  redis.call('INCRBY', month, est)
  redis.call('PEXPIRE', month, month_ttl)
  redis.call('INCRBY', spend, est_spend)
  redis.call('PEXPIRE', spend, month_ttl)
  states[i] = {s[1], s[2] + 1, s[3] + est, s[4] + 1, s[5] + est, s[6] + est_spend}
end
return {1, states}
"""

# KEYS: [1] the admission's "settled" marker, then per scope i: [4i-2] window hash,
#   [4i-1] in-flight zset, [4i] the admission month's token counter, [4i+1] its spend counter.
# ARGV: [1] request id, [2] tokens delta (actual - estimate), [3] settled ttl ms,
#   [4] scope count, [5] spend delta (actual - estimate), then per scope the window start the
#   estimate went into.
# Returns 1 when settled now, 0 when it had been settled before.
SETTLE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[3]) then
  return 0
end
local rid, delta, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local spend_delta = tonumber(ARGV[5])
for i = 1, n do
  local win, inflight, month, spend = KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i], KEYS[4*i+1]
  redis.call('ZREM', inflight, rid)
  if spend_delta ~= 0 and redis.call('EXISTS', spend) == 1 then
    if redis.call('INCRBY', spend, spend_delta) < 0 then redis.call('SET', spend, 0, 'KEEPTTL') end
  end
  if delta ~= 0 then
    if redis.call('HGET', win, 'start') == ARGV[5 + i] then
      if redis.call('HINCRBY', win, 'tok', delta) < 0 then redis.call('HSET', win, 'tok', 0) end
    end
    if redis.call('EXISTS', month) == 1 then
      if redis.call('INCRBY', month, delta) < 0 then redis.call('SET', month, 0, 'KEEPTTL') end
    end
  end
end
return 1
"""


class _LoopClient:
    def __init__(self, url: str) -> None:
        self.client = redis.asyncio.Redis.from_url(url)
        self.admit = self.client.register_script(ADMIT_LUA)
        self.settle = self.client.register_script(SETTLE_LUA)


class RedisQuotaBackend:
    """redis.asyncio clients, one per event loop (a connection belongs to the loop that made it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClient] = (
            weakref.WeakKeyDictionary()
        )
        self._sync_client: redis.Redis | None = None

    def _client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = _LoopClient(self.url)
        return client

    async def aclose(self) -> None:
        """Close this event loop's connections (tests; a server's loop lives as long as it)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.client.aclose()

    async def admit(
        self, *, scopes: tuple[ScopeSpec, ...], request_id: str, estimated_tokens: int, clock: Clock,
        estimated_spend: int = 0,
    ) -> AdmitOutcome:
        keys = []
        args: list[int | str] = [
            clock.now_ms,
            request_id,
            estimated_tokens,
            WINDOW_MS,
            lease_ms(),
            month_counter_ttl_ms(clock),
            clock.ms_to_next_month,
            CONCURRENCY_RETRY_MS,
            len(scopes),
            estimated_spend,
        ]
        for scope in scopes:
            keys += [scope.window_key(), scope.lease_key(), scope.month_key(clock.month), scope.spend_key(clock.month)]
            args += scope.limit_args()
        reply = await self._client().admit(keys=keys, args=args)
        states = tuple(ScopeState(*(int(v) for v in state)) for state in reply[1])
        if reply[0] == 1:
            return AdmitOutcome(states, None)
        scope_index, code, retry_ms, final = (int(v) for v in reply[2:6])
        return AdmitOutcome(
            states, Refusal(scope_index - 1, LIMIT_CODES[code - 1], retry_ms, bool(final))
        )

    async def settle(self, *, ticket: SettleTicket, actual_tokens: int, clock: Clock, actual_spend: int = 0) -> bool:
        keys = [ticket.settled_key]
        args: list[int | str] = [
            ticket.request_id,
            actual_tokens - ticket.estimated_tokens,
            SETTLED_TTL_MS,
            len(ticket.scopes),
            actual_spend - ticket.estimated_spend,
        ]
        for prefix, window_start in ticket.scopes:
            keys += [f"{prefix}:window", f"{prefix}:inflight", f"{prefix}:month:{ticket.month}",
                     f"{prefix}:spend:{ticket.month}"]
            args.append(window_start)
        return await self._client().settle(keys=keys, args=args) == 1

    def snapshot(self, *, scope: ScopeSpec, clock: Clock) -> ScopeState:
        if self._sync_client is None:
            self._sync_client = redis.Redis.from_url(self.url)
        now = clock.now_ms
        with self._sync_client.pipeline(transaction=True) as pipe:
            pipe.hmget(scope.window_key(), "start", "req", "tok")
            pipe.zcount(scope.lease_key(), f"({now}", "+inf")
            pipe.get(scope.month_key(clock.month))
            pipe.get(scope.spend_key(clock.month))
            (start, requests, tokens), in_flight, month_tokens, month_spend = pipe.execute()
        if start is None or now >= int(start) + WINDOW_MS:
            start, requests, tokens = now, 0, 0
        return ScopeState(
            int(start), int(requests or 0), int(tokens or 0), int(in_flight), int(month_tokens or 0),
            int(month_spend or 0),
        )
