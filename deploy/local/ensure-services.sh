#!/usr/bin/env bash
# Make sure the PostgreSQL and Redis the tests use are up: start them if they are
# installed and not running; if absent, say how to get them and fail.
# Usage: ensure-services.sh DATABASE_URL REDIS_URL
set -uo pipefail
db_url=${1:?DATABASE_URL}
redis_url=${2:?REDIS_URL}

hostport() {  # scheme://[user@]host:port/... -> "host port"
  local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}
  local host=${rest%:*} port=${rest##*:}
  [ "$host" = "$rest" ] && port=$2
  echo "${host:-127.0.0.1} ${port:-$2}"
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 50); do port_open "$1" "$2" && return 0; sleep 0.2; done
  return 1
}

read -r pg_host pg_port <<<"$(hostport "$db_url" 5432)"
read -r rd_host rd_port <<<"$(hostport "$redis_url" 6379)"

if ! port_open "$pg_host" "$pg_port"; then
  if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql >/dev/null 2>&1; then
    echo "PostgreSQL is not running on $pg_host:$pg_port; starting it"
    for v in /etc/postgresql/*; do pg_ctlcluster --skip-systemctl-redirect "$(basename "$v")" main start || true; done
    wait_port "$pg_host" "$pg_port" || { echo "error: PostgreSQL did not come up on $pg_host:$pg_port" >&2; exit 1; }
  else
    echo "error: PostgreSQL is not running on $pg_host:$pg_port and is not installed." >&2
    echo "       Install it (Debian/Ubuntu: apt-get install postgresql) or set DATABASE_URL to a reachable server." >&2
    exit 1
  fi
fi

if ! port_open "$rd_host" "$rd_port"; then
  if command -v redis-server >/dev/null; then
    echo "Redis is not running on $rd_host:$rd_port; starting it"
    mkdir -p /tmp/loraplex-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port "$rd_port" --save "" --appendonly no \
      --dir /tmp/loraplex-redis --logfile /tmp/loraplex-redis/redis.log
    wait_port "$rd_host" "$rd_port" || { echo "error: Redis did not come up on $rd_host:$rd_port" >&2; exit 1; }
  else
    echo "error: Redis is not running on $rd_host:$rd_port and is not installed." >&2
    echo "       Install it (Debian/Ubuntu: apt-get install redis-server) or set REDIS_URL to a reachable server." >&2
    exit 1
  fi
fi
echo "services: PostgreSQL $pg_host:$pg_port, Redis $rd_host:$rd_port"
