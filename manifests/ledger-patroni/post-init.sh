#!/bin/sh
# Patroni's post_init, run once on the member that bootstrapped the cluster ($1: a superuser
# connection string): the operator's login, as the dev overlay makes it. Not a superuser, cannot
# create roles or databases: it owns the database retex, where the operator's migrations create
# and own the schema retex.
set -eu
psql -v ON_ERROR_STOP=1 -v password="$RETEX_LEDGER_PASSWORD" -d "$1" <<'SQL'
CREATE ROLE retex LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD :'password';
CREATE DATABASE retex OWNER retex;
REVOKE ALL ON DATABASE retex FROM PUBLIC;
SQL
