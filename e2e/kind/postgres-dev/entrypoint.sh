#!/bin/sh
# What the official postgres image does at start that the dev overlay relies on: an empty PGDATA
# is initialised with POSTGRES_USER/POSTGRES_PASSWORD, the init scripts run once, then Postgres
# serves every address with password authentication.
set -eu
[ "$*" = postgres ] || { echo "usage: docker-entrypoint.sh postgres (the dev image serves Postgres only)" >&2; exit 2; }
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${PGDATA:?}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  echo "postgres-dev: initialising $PGDATA"
  password=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" >"$password"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$password" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --no-instructions
  rm -f "$password"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -c unix_socket_directories=/var/run/postgresql" start
  for script in /docker-entrypoint-initdb.d/*.sql; do
    [ -e "$script" ] || continue
    echo "postgres-dev: running $script"
    psql -v ON_ERROR_STOP=1 -h /var/run/postgresql -U "$POSTGRES_USER" -d postgres -f "$script"
  done
  pg_ctl -D "$PGDATA" -w -m fast stop
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql
