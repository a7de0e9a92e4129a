-- DEV ONLY: the operator's login (its DSN is in manifests/overlays/dev/kustomization.yaml). Not a
-- superuser, cannot create roles or databases: it owns the database retex, where the operator's
-- migrations create and own the schema retex.
CREATE ROLE retex LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD 'retex-dev-only';
CREATE DATABASE retex OWNER retex;
REVOKE ALL ON DATABASE retex FROM PUBLIC;
